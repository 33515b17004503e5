"""What one packed linear layer costs per call at each row count: torch's path against packcache's compiled kernel.

Method (printed first when run):

* One layer per shape (default: a 1.24 B Llama's 8192x2048 gate/up, 2048x8192 down and 128256x2048 output head),
  a random float32 weight packed by the scheme's packer (``--scheme int8`` or ``int4``), prepared on the ``fp32``
  kernel path; bias none.
* Per row count (default 1, 2, 4, 8, 12, 16, 24, 32, 48, 64: continuous batching's decode steps, one row per
  running sequence), ``packer.linear`` on random activations, twice: with ``packers_torch.NATIVE_MAX_ROWS`` of
  the scheme's compiled operation (``int8``, ``int4``) set to 0 (torch's path: the weight dequantised per call, a
  block of output channels at a time, and the GEMM) and to ``None``
  (packcache's compiled product at every row count, what a packed layer runs, on the code ``native.status()``
  picks; ``--native-isas`` also on a code ``NATIVE_ISAS`` leaves out).
* Each call timed alone for ``--seconds`` per point after a warm-up; reported: the 10th percentile ms per call
  (``--percentile``). ``--threads 1`` times the calling thread's CPU time instead of the wall clock, so a
  shared machine's other processes do not count; with 2 threads a call waits for both, and any other process
  on the machine stalls it (the load average is printed).

Usage: python benchmarks/linear_rows.py [--scheme int8|int4] [--shapes 8192x2048,...] [--rows 1,2,...]
    [--threads N] [--seconds S] [--percentile P] [--native-isas] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import core  # noqa: E402  (benchmarks/core.py)

SHAPES = "8192x2048,2048x8192,128256x2048"
ROWS = "1,2,4,8,12,16,24,32,48,64"


def measure(scheme: str, shapes: list[tuple[int, int]], rows_list: list[int], args: argparse.Namespace) -> list[Any]:
    import numpy as np
    import torch

    import packcache.packers_torch as P
    from packcache import native

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    isa = native.status().isa
    packer = {"int8": P.Int8WeightOnly(), "int4": P.Int4WeightOnly(32)}[scheme]
    op = packer.native_op  # the knobs are per compiled operation
    assert op is not None
    if args.native_isas and isa is not None:
        P.NATIVE_ISAS[op] = (isa,)
    results = []
    for n, k in shapes:
        source = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32) * np.float32(0.02)
        parts = packer.pack(source, "F32")
        del source
        operands: dict[str, Any] = {p: P.as_tensor(a, packer.part_dtypes().get(p)) for p, a in parts.items()}
        operands["bias"] = None
        prepared = packer.prepare(operands, "fp32")
        for rows in rows_list:
            x = torch.randn(rows, k)
            point: dict[str, Any] = {"shape": f"{n}x{k}", "rows": rows}
            for name, limit in (("torch", 0), ("packcache", None)):
                saved = P.NATIVE_MAX_ROWS[op]
                P.NATIVE_MAX_ROWS[op] = limit
                try:
                    point[f"{name}_kernel"] = packer.kernel("fp32", rows)
                    packer.linear(prepared, x, "fp32")
                    times: list[float] = []
                    start = clock()
                    while clock() - start < args.seconds or len(times) < 5:
                        t = clock()
                        packer.linear(prepared, x, "fp32")
                        times.append(clock() - t)
                finally:
                    P.NATIVE_MAX_ROWS[op] = saved
                times.sort()
                point[f"{name}_ms"] = times[len(times) * args.percentile // 100] * 1000
            print(f"  {scheme} {n}x{k} rows {rows:3d}: torch {point['torch_ms']:8.3f} ms  packcache "
                  f"{point['packcache_ms']:8.3f} ms  ({point['packcache_kernel']}; "
                  f"load avg {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip
            results.append(point)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheme", choices=("int8", "int4"), default="int8")
    parser.add_argument("--shapes", default=SHAPES, help="out x in, comma-separated")
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--percentile", type=int, default=10)
    parser.add_argument("--native-isas", action="store_true", help="use the compiled kernel on any code it runs")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    shapes = [(int(a), int(b)) for a, b in (s.split("x") for s in args.shapes.split(","))]
    rows = [int(r) for r in args.rows.split(",")]
    print(__doc__.split("Usage:")[0].strip())
    from packcache import native

    print(f"\ncpu: {core.cpu_model()}, {os.cpu_count()} CPUs, {args.threads} threads, packcache code "
          f"{native.status().isa} ({native.status().reason})\n")  # fmt: skip
    results = measure(args.scheme, shapes, rows, args)
    print("\n| rows | " + " | ".join(f"{n}x{k} torch / packcache ms" for n, k in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for r in rows:
        cells = [next(p for p in results if p["rows"] == r and p["shape"] == f"{n}x{k}") for n, k in shapes]
        print(f"| {r} | " + " | ".join(f"{c['torch_ms']:.2f} / {c['packcache_ms']:.2f}" for c in cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": core.cpu_model(), "threads": args.threads, "scheme": args.scheme, "results": results},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
