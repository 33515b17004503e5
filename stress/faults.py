"""Fault matrix: real faults at every phase of a cache's life, each load in its own process.

Method. Every case sets up a cache directory (a tiny tmpfs, a read-only bind
mount, a directory owned by someone else, a valid, missing or corrupt file),
then runs the load in a child interpreter: as root, as root with
``CAP_DAC_OVERRIDE``/``CAP_DAC_READ_SEARCH`` dropped, or as the real user
``nobody``, under ``RLIMIT_FSIZE`` / ``RLIMIT_NOFILE`` / ``RLIMIT_AS`` where the
fault needs it. The child reports JSON; the parent checks, per load:

* the child exited cleanly (a SIGBUS or any other death fails the case);
* every served array is bit-identical to ``pack()``;
* hits, stored packs and heap bytes per reason are the expected ones, and so is
  the errno the cache keeps;
* exactly one ERROR record per failing reason, naming the reason, the errno
  and the path (and none when nothing failed);
* what must survive did: a failed rebuild or append leaves the old file
  byte-identical, a failed build leaves no file and no temp file.

Phases: ``open`` (first session on a missing file), ``build`` (a fresh build
that fails mid-way), ``append`` (new packs for a valid cache), ``rebuild``
(replacing a corrupt file). Faults: ENOSPC (tmpfs ``size=``), inode
exhaustion (tmpfs ``nr_inodes=``: this kernel has no ``CONFIG_TMPFS_QUOTA``, so
``usrquota_block_hardlimit`` is refused and EDQUOT cannot be made for real;
inode exhaustion is the quota-like fault that remains, and gives ENOSPC on
create), EFBIG (``RLIMIT_FSIZE``), EACCES (``nobody``; root without DAC
override), EROFS (read-only bind mount), EMFILE (``RLIMIT_NOFILE``), mapping
failure (``RLIMIT_AS``), the file replaced, deleted or truncated by another
process while a reader has it mapped, and random bit flips in header, index
and data (data flips with ``verify=True``, and ``packcache.verify`` must name
the entry and offset: opening never reads data pages, by design).

Truncation of a file a reader has mapped is SIGBUS for any mmap user (kernel
behaviour); packcache never truncates, and detects a truncated file at the next
session or open. The matrix checks exactly that, and runs one child that does
touch a view after an external truncation: it is reported as a documented
limit, not counted as a pass.

Prints one summary line (plus one line per failing case) and exits 1 on any
failure. Needs root (mounts, setpriv, chown).

Usage: python stress/faults.py [--flips 24] [--only SUBSTRING] [--list]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness

from harness.driver import environment, run_case
from harness.faults import all_cases, truncate_while_mapped_limit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flips", type=int, default=24, help="random bit-flip cases per region (data: half)")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    cases = [c for c in all_cases(args.flips) if args.only in c.name]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    started = time.monotonic()
    failed = 0
    with environment() as env:
        for item in cases:
            problems = run_case(env, item)
            if problems:
                failed += 1
                print(f"FAIL {item.name}: {'; '.join(problems)}", flush=True)
        limit = truncate_while_mapped_limit(env) if not args.only else None
    if limit is not None:
        print(f"documented limit: touching a view after another process truncated the file: {limit}")
    seconds = time.monotonic() - started
    print(f"faults: cases={len(cases)} passed={len(cases) - failed} failed={failed} seconds={seconds:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
