"""Two versions of packcache, alternating launch by launch: a warm ``minilm.load`` and a cold build.

Method (printed first when run). Each launch is a fresh ``python`` process with ``PYTHONPATH`` set to one
version's ``src``; the two versions take turns, and which goes first alternates, so drift on a shared machine
lands on both. What is timed, with ``time.perf_counter`` around the call alone:

* ``load``: ``minilm.load(scheme, cache=FILE, tokenizer=...)`` of a warm cache file that version built before
  the timed launches: ``benchmarks/warm.py``'s own MiniLM child (after ``import torch``, the tokenizer loaded,
  ``gc.collect()``); the load must map.
* ``cold``: a new cache file of 100 packs of 640 KiB (64 MiB), from ``WeightCache(...)`` to its close (two
  ``fdatasync`` calls: the figure is bound by the disk).

Prints the median and the range of each version's launches. This is how ``docs/BENCHMARKS.md`` settles a
before/after ratio that moved between two runs of ``warm.py`` or ``core.py``.

Usage: python benchmarks/versions.py BEFORE_SRC AFTER_SRC [--what load|cold] [--scheme int8] [--launches 9]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import warm

BUILD = r"""
import sys
from packcache.models import minilm
minilm.load(sys.argv[1], cache=sys.argv[2]).close()
print('{"s": 0}')
"""

COLD = r"""
import json, sys, time
import numpy as np
import packcache
arrays = [np.full(640 * 256, i, dtype=np.float32) for i in range(100)]
started = time.perf_counter()
with packcache.WeightCache(sys.argv[1]) as cache, cache.session() as s:
    for i, array in enumerate(arrays):
        s.get_or_pack(f"w{i}", lambda array=array: array, {"v": 1})
print(json.dumps({"s": time.perf_counter() - started}))
"""


def _launch(code: str, src: str, *argv: str) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, "-c", code, *argv], env=env, check=True, capture_output=True, text=True)
    seconds: float = json.loads(done.stdout.strip().splitlines()[-1])["s"]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the src directory of the first version")
    parser.add_argument("after", help="the src directory of the second version")
    parser.add_argument("--what", choices=("load", "cold"), default="load")
    parser.add_argument("--scheme", default="int8", help="the scheme of a load (default int8)")
    parser.add_argument("--launches", type=int, default=9, help="timed launches of each version (default 9)")
    args = parser.parse_args()
    print(__doc__.split("Usage:")[0].strip(), end="\n\n")
    versions = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    scratch = tempfile.mkdtemp(prefix="packcache-versions-")
    times: dict[str, list[float]] = {name: [] for name in versions}
    try:
        if args.what == "load":
            for name, src in versions.items():  # each version's own warm file
                _launch(BUILD, src, args.scheme, os.path.join(scratch, f"{name}.pcache"))
        for i in range(args.launches):
            order = list(versions.items()) if i % 2 == 0 else list(reversed(versions.items()))
            for name, src in order:
                if args.what == "load":
                    path = os.path.join(scratch, f"{name}.pcache")
                    spec = {"method": "packcache", "scheme": args.scheme, "path": path}
                    times[name].append(warm.launch("minilm", spec, src)["seconds"])
                else:
                    path = os.path.join(scratch, f"cold-{name}-{i}.pcache")
                    times[name].append(_launch(COLD, src, path))
                    os.unlink(path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    what = f"minilm.load {args.scheme}, warm" if args.what == "load" else "cold build, 100 packs, 64 MiB"
    for name, values in times.items():
        values.sort()
        print(f"{what}, {name} ({versions[name]}): median {statistics.median(values) * 1e3:.1f} ms, "
              f"range {values[0] * 1e3:.1f}-{values[-1] * 1e3:.1f} ms, {len(values)} launches")  # fmt: skip


if __name__ == "__main__":
    main()
