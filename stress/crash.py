"""Crash safety: a writer SIGKILLed at a random instant never serves a wrong byte nor costs a valid cache.

Method: scenarios run round-robin, each trial in its own directory:

* ``fresh``   -- build a cache of 41 packs from nothing;
* ``append``  -- open a valid two-generation cache of 21 packs, append 20 new
  packs and replace one stale key (``s``), one session;
* ``compact`` -- ``packcache.compact()`` a cache of 31 live packs holding 11
  superseded ones.

A writer runs in a fresh interpreter, signals that it is ready, is told to go,
and is SIGKILLed after a delay drawn uniformly from [0, T], where T is the
median duration of uninterrupted runs of that scenario under the same
parallel load (kills land throughout the work, and some after it: runs vary).
Then a *fresh* interpreter (the checker) looks at the directory before touching it
(was anything written? committed?), runs ``packcache.verify``, opens the cache
read-only and requests every pack of the generation before and after the
trial, comparing each served array with a fresh deterministic pack; then it
opens the cache normally and loads the full model (the cache must heal:
no heap, no errno), reopens it (a full hit) and verifies again.

Figures: ``killed_mid_write`` counts kills that landed before the writer had
finished; ``uncommitted_on_disk`` those that left bytes of an unfinished write
on disk (a temp file, or data past the committed end), the proof that kills
landed in the middle of writing. Must be zero: ``wrong_bytes`` (arrays served
with other bytes than a fresh pack), ``caches_lost`` (an entry valid before
the trial no longer served from the file), ``mixed_generations`` (the visible
entries are neither the old nor the new generation), ``verify_failures``,
``heal_failures`` and ``errors`` (a child that crashed for another reason).
``orphans_left`` is informational: temp files of killed writers still present
after the healing session.

SIGKILL kills the process, not the machine: what completed syscalls wrote is
in the page cache. This harness therefore checks the ordering of writes as
seen by other processes; it cannot prove durability across a power cut.

Usage: .venv/bin/python stress/crash.py [--trials 510] [--seed 1] [--quick] [--workers 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness

from harness import crash


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=510, help="trials, round-robin over the scenarios")
    parser.add_argument("--seed", type=int, default=1, help="seed of the kill delays")
    parser.add_argument("--workers", type=int, default=2, help="trials run in parallel")
    parser.add_argument("--quick", action="store_true", help="30 trials (10 per scenario)")
    args = parser.parse_args(argv)
    trials = 30 if args.quick else args.trials
    with tempfile.TemporaryDirectory(prefix="packcache-crash-") as directory:
        result = crash.run(
            directory, trials, seed=args.seed, workers=args.workers, calibration_runs=2 if args.quick else 4
        )
        for failure in result["failures"][:20]:
            print("FAIL", failure, file=sys.stderr)
        if result["failures"]:
            kept = tempfile.mkdtemp(prefix="packcache-crash-failed-")
            shutil.copytree(directory, kept, dirs_exist_ok=True)
            print(f"failing trial directories kept in {kept}", file=sys.stderr)
    limits = " ".join(f"T({s})={t * 1000:.0f}ms" for s, t in result["limits"].items())
    print(
        f"method: {trials} trials round-robin over {'/'.join(crash.SCENARIOS)}, {args.workers} in parallel, "
        f"seed {args.seed}; "
        f"writer in a fresh interpreter SIGKILLed after uniform [0, T] of work, T = median uninterrupted run "
        f"({limits}); checker in a fresh interpreter: verify, read-only open, heal, reopen"
    )
    print(crash.summary(result))
    bad = [k for k in crash.MUST_BE_ZERO if result[k]]
    if bad or result["uncommitted_on_disk"] == 0:
        print(f"FAILED: {', '.join(bad) or 'no kill landed in the middle of a write'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
