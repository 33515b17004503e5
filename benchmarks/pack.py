"""Cold packing: int4 against int8, per layer shape of a Llama-3.2-1B-shaped model and for the whole model.

Method (printed first when run):

* workload — one float32 weight per layer shape of Llama-3.2-1B (1.24 B parameters):
  q/o 2048x2048, k/v 512x2048, gate/up 8192x2048, down 2048x8192 (each 16 times) and the
  128256x2048 output head, made as ``np.random.default_rng(0).standard_normal(shape) * 0.02``
  (packing time does not depend on the values).
* packers — ``packcache.packers_torch.Int8WeightOnly().pack`` (per-channel int8) and
  ``Int4WeightOnly(32).pack`` (group 32, weight-only: no calibration statistics), each from the
  same float32 array, alternating int8 and int4 in every repetition.
* figures — per shape, the median of the repetitions for each packer and the ratio of the medians
  (int4 / int8); the model's totals weight each shape by how often it occurs. Times drift on a
  shared machine; the ratios, measured in the same run, are what to compare.
* statistics — with ``--stats``, int4 packs with calibration statistics (activation-aware:
  ``quantize_int4_activation_aware``, one search per alpha of ``AWQ_EXPONENTS`` and five
  ``[out, in] @ [in, in]`` error products) on all-MiniLM-L6-v2's layer shapes, the model packcache
  calibrates (384x384 x 24, 1536x384 x 6, 384x1536 x 6; a 1 B model's layers take minutes each
  this way). ``E[x x^T]`` comes from 512 random rows, each feature scaled by its own factor from
  0.05 to 20 (what spreads the alphas' column scales).
* before — with ``--before SRC``, the int4 packer also runs with the ``quantize_int4_groups`` and
  ``quantize_int4_activation_aware`` of another source tree (``git archive <commit> src | tar -x
  -C DIR``, then ``--before DIR/src``) in the same repetitions, and the two packs are checked byte
  for byte.

Usage: python benchmarks/pack.py [--quick] [--stats] [--repeat N] [--before SRC] [--json FILE]
  --quick   only the largest shape (8192x2048; 1536x384 with --stats)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

import packcache.packers_torch as packers_torch
from packcache.packers_torch import Int4WeightOnly, Int8WeightOnly

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import core

#: (layer, shape, how many the model holds): Llama-3.2-1B, 16 decoder layers and a 128256-token head.
LLAMA_1B = (
    ("q_proj, o_proj", (2048, 2048), 32),
    ("k_proj, v_proj", (512, 2048), 32),
    ("gate_proj, up_proj", (8192, 2048), 32),
    ("down_proj", (2048, 8192), 16),
    ("lm_head", (128256, 2048), 1),
)
#: The same for all-MiniLM-L6-v2 (6 layers): what ``--stats`` packs.
MINILM_L6 = (
    ("query, key, value, dense", (384, 384), 24),
    ("intermediate", (1536, 384), 6),
    ("output", (384, 1536), 6),
)
#: What ``--before`` replaces in :mod:`packcache.packers_torch` (what ``Int4WeightOnly`` calls).
QUANTIZERS = ("quantize_int4_groups", "quantize_int4_activation_aware")


def before_quantizer(src: str) -> dict[str, Any]:
    """The int4 quantizers (:data:`QUANTIZERS`) of the source tree ``src``, loaded beside the installed ones."""
    path = os.path.join(src, "packcache", "quantize.py")
    if not os.path.exists(path):  # a tree whose quantisation search is still in packers.py
        path = os.path.join(src, "packcache", "packers.py")
    # Named inside the package, so its relative imports (``.errors``) resolve to the installed modules.
    spec = importlib.util.spec_from_file_location("packcache._packers_before", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, name) for name in QUANTIZERS}


def second_moment(in_features: int) -> np.ndarray[Any, Any]:
    """``E[x x^T]`` of 512 random rows of ``in_features`` features, each scaled by its own factor (0.05 to 20)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((512, in_features)) * np.geomspace(0.05, 20.0, in_features)[rng.permutation(in_features)]
    h: np.ndarray[Any, Any] = x.T @ x / len(x)
    return h


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench_shape(
    layer: str, shape: tuple[int, int], count: int, repeat: int, before: dict[str, Any] | None, stats: bool
) -> dict[str, Any]:
    weight = np.random.default_rng(0).standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    moments = second_moment(shape[1]) if stats else None
    int8, int4 = Int8WeightOnly(), Int4WeightOnly(32)
    current = {name: getattr(packers_torch, name) for name in QUANTIZERS}
    times: dict[str, list[float]] = {"int8": [], "int4": [], "int4_before": []}
    identical = None
    for _ in range(repeat):
        times["int8"].append(timed(lambda: int8.pack(weight, "F32"))[0])
        seconds, packed = timed(lambda: int4.pack(weight, "F32", moments))
        times["int4"].append(seconds)
        if before is not None:
            for name, function in before.items():  # what Int4WeightOnly calls
                setattr(packers_torch, name, function)
            try:
                seconds, old = timed(lambda: int4.pack(weight, "F32", moments))
            finally:
                for name, function in current.items():
                    setattr(packers_torch, name, function)
            times["int4_before"].append(seconds)
            same = all(packed[p].tobytes() == old[p].tobytes() for p in int4.parts)
            identical = same if identical is None else identical and same
        del packed
    int8_s, int4_s = statistics.median(times["int8"]), statistics.median(times["int4"])
    before_s = statistics.median(times["int4_before"]) if before is not None else None
    return {
        "layer": layer,
        "shape": list(shape),
        "count": count,
        "int8_s": int8_s,
        "int4_s": int4_s,
        "ratio": int4_s / int8_s,
        "int4_before_s": before_s,
        "ratio_before": None if before_s is None else before_s / int8_s,
        "identical_to_before": identical,
        "samples": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the largest shape")
    parser.add_argument("--stats", action="store_true", help="int4 with statistics, on MiniLM's shapes")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per shape (default 3)")
    parser.add_argument("--before", metavar="SRC", help="also time int4 with the quantizer of this source tree")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    print(__doc__.split("Usage:")[0].strip())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    machine = {
        "cpu": core.cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "usable_cpus": cpus,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
    }
    print("\nmachine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + "\n")
    model, quick = (MINILM_L6, (1536, 384)) if args.stats else (LLAMA_1B, (8192, 2048))
    shapes = [s for s in model if s[1] == quick] if args.quick else list(model)
    before = before_quantizer(args.before) if args.before else None
    rows = []
    extra = f" {'before s':>8} {'before/int8':>11} {'same bytes':>10}" if before else ""
    print(f"{'layer':<20} {'shape':>13} {'count':>5} {'int8 s':>8} {'int4 s':>8} {'int4/int8':>9}" + extra)
    for layer, shape, count in shapes:
        row = bench_shape(layer, shape, count, args.repeat, before, args.stats)
        rows.append(row)
        same = "yes" if row["identical_to_before"] else "NO"
        extra = f" {row['int4_before_s']:8.3f} {row['ratio_before']:11.2f} {same:>10}" if before else ""
        print(
            f"{layer:<20} {'x'.join(map(str, shape)):>13} {count:>5} "
            f"{row['int8_s']:8.3f} {row['int4_s']:8.3f} {row['ratio']:9.2f}" + extra
        )
    total: dict[str, float] = {key: sum(r[key] * r["count"] for r in rows) for key in ("int8_s", "int4_s")}
    if before:
        total["int4_before_s"] = sum(r["int4_before_s"] * r["count"] for r in rows)
    label = f"{'x'.join(map(str, quick))} x {shapes[0][2]}" if args.quick else "whole model"
    extra = f" {total['int4_before_s']:8.2f} {total['int4_before_s'] / total['int8_s']:11.2f}" if before else ""
    print(
        f"{label:<20} {'':>13} {'':>5} {total['int8_s']:8.2f} {total['int4_s']:8.2f} "
        f"{total['int4_s'] / total['int8_s']:9.2f}" + extra
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "shapes": rows, "total": total}, f, indent=2)


if __name__ == "__main__":
    main()
