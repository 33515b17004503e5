"""Interrupts: Ctrl-C at a random instant of a load never leaves a cache unusable or a file invalid.

Method. One child interpreter per worker runs trials back to back. Each trial
picks a scenario — a fresh build, an append to a valid cache, a rebuild of a
corrupt file, or a build by four threads sharing one session — and arms a
timer that raises ``KeyboardInterrupt`` (as a real SIGINT does, from a signal
handler, between any two bytecodes) after a delay drawn uniformly from
[0, T], T the median duration of uninterrupted runs of that scenario. After
the interrupt, with the timer disarmed, the trial checks on the *same*
``WeightCache`` instance:

* a new session starts and finishes, in this thread (never "already active")
  and then in another thread within 10 s (nothing is left locked);
* every array served before and after the interrupt is bit-identical to ``pack()``;
* the ledger adds up: held bytes = mapped + heap bytes of the statistics;
* ``packcache.verify`` passes on the file (when there is one);

and then that a fresh instance maps or heals every pack.

Prints one summary line; exits 1 if any must-be-zero figure is not zero.

Usage: python stress/interrupts.py [--trials 400] [--seed 1] [--workers 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness

from harness import interrupts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="packcache-interrupts-") as base:
        result = interrupts.run(Path(base), trials=args.trials, seed=args.seed, workers=args.workers)
    for failure in result["failures"][:20]:
        print(f"FAILED {failure}")
    figures = " ".join(f"{k}={v}" for k, v in result.items() if k not in ("failures", "medians_ms"))
    print(f"interrupts: {figures} medians_ms={result['medians_ms']}")
    return 1 if any(result[k] for k in interrupts.MUST_BE_ZERO) else 0


if __name__ == "__main__":
    sys.exit(main())
