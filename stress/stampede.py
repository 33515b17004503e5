"""Stampede: many processes start at once on one cache; exactly one builds, nobody errs or sees a wrong byte.

Method: every process is a fresh interpreter. After its imports it reports
ready on a shared pipe and blocks reading a second pipe (the start gun); when
all are ready the parent closes the gun's write end and every process wakes
at the same instant. Three modes, each in a fresh directory per round:

* ``wait``: 8 processes load the same 24 packs from an empty cache with a 60 s
  lock timeout. Exactly one stores all of them; the other seven wait on the
  build lock, then map everything (hits, nothing stored, no heap, state
  ``mapped``, errno 0).
* ``zero-timeout``: the same with ``lock_timeout=0``. Exactly one builds; a
  process that finds the lock held packs every pack to heap with reason
  ``locked`` (counted; state ``heap`` as nothing is mapped, errno EAGAIN), one that arrives after
  the build maps it (counted as ``late_mapped``).
* ``mixed``: a warm cache of 16 packs; 7 readers repeatedly read the committed
  index, open the cache and load every pack it lists (all must be hits with
  the right bytes, nothing written), while one writer appends 8 new packs in
  each of 5 sessions. Afterwards a fresh reader must map every pack.

Every process compares each array it is served with a fresh deterministic pack
and reports a digest of all of them; in ``wait`` and ``zero-timeout`` the
digests of all 8 processes must be equal, and the file must hold exactly one
copy of each pack: one generation whose packs lie back to back (alignment
padding only), followed by its index, ending exactly at the end of the file
(``packcache._generations.read_committed``).

Prints one summary line per mode; exits 1 if any check fails.

Usage: .venv/bin/python stress/stampede.py [--rounds 20] [--mixed-rounds 5] [--processes 8] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness

from harness import stampede


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds of the wait and zero-timeout modes")
    parser.add_argument("--mixed-rounds", type=int, default=5, help="rounds of the mixed mode")
    parser.add_argument("--processes", type=int, default=8, help="processes started together")
    parser.add_argument("--quick", action="store_true", help="3 rounds per mode")
    args = parser.parse_args(argv)
    rounds, mixed_rounds = (3, 3) if args.quick else (args.rounds, args.mixed_rounds)
    packs, warm, appended, sessions = (
        len(stampede.PACKS),
        len(stampede.WARM),
        len(stampede.APPENDED),
        stampede.WRITER_SESSIONS,
    )
    print(
        f"method: {args.processes} fresh interpreters released together by a start-gun pipe, a fresh directory per "
        f"round; wait (lock_timeout 60 s) and zero-timeout: {rounds} rounds of {packs} packs on an empty cache; "
        f"mixed: {mixed_rounds} rounds, {args.processes - 1} readers re-opening a warm cache of {warm} packs "
        f"while a writer appends {appended} in {sessions} sessions; every array checked against a "
        "fresh pack"
    )
    with tempfile.TemporaryDirectory(prefix="packcache-stampede-") as directory:
        results = stampede.run(directory, rounds, mixed_rounds, args.processes)
    ok = True
    for mode, result in results.items():
        print(stampede.summary(mode, result))
        for failure in result["failures"][:10]:
            print("FAIL", mode, failure, file=sys.stderr)
        ok = stampede.passed(mode, result) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
