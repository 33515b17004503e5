"""Stability: a complete cache reloaded many times never changes; caches converge after a packer change.

Method: build a cache of ``--packs`` packs, then

1. reload it ``--cycles`` times (each cycle a new WeightCache, a session requesting
   every pack, close; every third cycle in a fresh subprocess) and require the
   file's size, mtime and inode to stay unchanged and every pack to be a hit;
2. change the packer version: the first load after it must pack and store every
   pack exactly once, and every later load must be a full hit again (converged);
   that first build superseded more bytes than it left live, so it must have
   compacted the file to one copy of each live pack (no reclaimable byte left);
3. compact: nothing more to reclaim, and every pack stays bit-identical.

Prints one summary line; exits 1 if any check fails.

Usage: python stress/stability.py [--cycles 100] [--packs 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness

from harness import stability


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--packs", type=int, default=32)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="packcache-stability-") as d:
        r = stability.run(d, args.cycles, args.packs)
    for failure in r["failures"]:
        print(f"FAIL {failure}")
    print(
        f"stability: cycles={r['cycles']} packs={r['packs']} file_changes={r['file_changes']} "
        f"stored_per_load_after_version_change={r['stored_per_load_after_version_change']} "
        f"compaction_bytes={r['bytes_before_compaction']}->{r['bytes_after_compaction']} (live {r['live_bytes']}) "
        f"failures={len(r['failures'])} seconds={time.perf_counter() - started:.1f}"
    )
    return 1 if r["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
