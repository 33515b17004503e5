"""What one decode step's linear layers cost per kernel: weight bytes streamed per second (where a decode's limit is).

Method (printed first when run):

* The linear layers of a Llama-3.2-1B-shaped model (16 layers of q/o 2048x2048, k/v 512x2048,
  gate/up 8192x2048, down 2048x8192, and the 128256x2048 output head: 1.24 B weights), each
  holding its own random weight in the kernel's operand format, so a pass streams the whole model
  from memory as a decode step does (the set is larger than the caches).
* Per kernel, one row of activations through every layer in order (a decode step's GEMVs), five
  passes after a warm-up; the median pass. Reported: ms per pass, the weight bytes a pass reads,
  GiB/s, and the tok/s that bound allows (the rest of a step, attention and norms, comes on top).
* Kernels: ``linear`` float32 (MKL), ``linear`` bfloat16 (oneDNN), ``_weight_int8pack_mm`` (int8
  weight, per-channel bf16 scales), ``_weight_int4pack_mm_for_cpu`` (torch's int4 layout, group
  32, bf16 scales and zeros), ``_int_mm`` (int8 activations quantised per call x int8 weight:
  the W8A8 alternative), and packcache's compiled kernels (``packcache.native``) on the
  operands of packcache's packs: ``packcache int8`` (int8 codes with a bfloat16 scale per block of 32, what
  the int8 layers run), ``packcache int4`` (its row-major int4 layout, group 32), ``packcache bf16``, and
  ``packcache int8`` on a 32-row prefill; ``packcache dense`` (what the packed fp32 and bf16 layers run, one sum
  order at every row count: float32 activations, each weight widened exactly) on int8 (a float32 scale per row:
  what int8 layers ran before its blocks), bf16 and float32 weights, and on int8 for the 32-row prefill. Threads:
  ``--threads`` (2); ``--kernel`` (repeated) runs only the kernels named.
* A prefill's int8 layers (32 rows; the 16 layers, not the head, which a prefill runs on its last
  row only): each weight converted to bf16 whole per call and multiplied (packcache before issue
  22), against the weight converted 8 MiB of output channels at a time (what ``Int8WeightOnly`` did without
  its compiled product before its blocks). GiB/s there counts the int8 bytes.
* ``--isa avx2`` runs the same in a child with ``ATEN_CPU_CAPABILITY=avx2``, ``PACKCACHE_NATIVE=avx2`` and
  ``ONEDNN_MAX_CPU_ISA=AVX2``: torch's and oneDNN's AVX2 code on this CPU, a stand-in for a CPU
  without AVX512 (same memory system, so only the compute-bound kernels move).

Absolute figures drift on a shared machine (two threads stall at every barrier when anything else
runs: check the load average printed beside them); compare kernels within one run.

Usage: python benchmarks/decode_kernels.py [--threads N] [--isa native|avx2|both] [--kernel NAME ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import core  # noqa: E402  (benchmarks/core.py)

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV = 2048, 8192, 16, 128256, 512
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN),
          (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS + [(VOCAB, HIDDEN)]  # fmt: skip
KERNELS = ("linear f32", "linear bf16", "_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_int_mm (W8A8)",
           "packcache int8", "packcache int4", "packcache bf16", "int8 prefill 32 rows, whole",
           "int8 prefill 32 rows, blocks", "packcache int8 prefill 32 rows", "packcache dense int8",
           "packcache dense bf16", "packcache dense f32", "packcache dense int8 prefill 32 rows")  # fmt: skip
PREFILL_ROWS = 32


def measure(kernel: str, threads: int, passes: int = 5) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    layers: list[tuple[Any, ...]] = []
    nbytes = 0
    prefill = "prefill" in kernel
    for n, k in SHAPES[:-1] if prefill else SHAPES:
        if kernel in ("packcache int8", "packcache int8 prefill 32 rows"):
            rows = PREFILL_ROWS if prefill else 1
            weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
            scales = (torch.rand(n, k // 32, generator=generator) / 100).bfloat16()
            layers.append((weight, scales, torch.randn(rows, k), torch.empty(rows, n)))
            nbytes += n * k + scales.numel() * 2
        elif kernel in ("packcache dense int8", "packcache dense int8 prefill 32 rows"):
            rows = PREFILL_ROWS if prefill else 1
            weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
            layers.append((weight, torch.rand(n), torch.randn(rows, k), torch.empty(rows, n)))
            nbytes += n * k + n * 4
        elif kernel == "packcache bf16":
            weight = torch.randn(n, k, generator=generator).bfloat16()
            layers.append((weight, torch.randn(1, k).bfloat16(), torch.empty(1, n, dtype=torch.bfloat16)))
            nbytes += n * k * 2
        elif kernel in ("packcache dense bf16", "packcache dense f32"):
            dtype = torch.bfloat16 if kernel.endswith("bf16") else torch.float32
            layers.append((torch.randn(n, k, generator=generator).to(dtype), torch.randn(1, k)))
            nbytes += n * k * (2 if dtype == torch.bfloat16 else 4)
        elif kernel == "linear f32":
            layers.append((torch.randn(n, k, generator=generator), torch.randn(1, k)))
            nbytes += n * k * 4
        elif kernel == "linear bf16":
            layers.append((torch.randn(n, k, generator=generator).bfloat16(), torch.randn(1, k).bfloat16()))
            nbytes += n * k * 2
        elif kernel in ("_weight_int8pack_mm", "_int_mm (W8A8)") or prefill:
            weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
            rows = PREFILL_ROWS if prefill else 1
            layers.append((weight, torch.rand(n).bfloat16(), torch.randn(rows, k).bfloat16(), torch.rand(n)))
            nbytes += n * k + n * 2
        elif kernel == "packcache int4":  # packcache's row-major layout (pack_int4_rows)
            packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
            scales_and_zeros = torch.rand(n, k // 32, 2).bfloat16()
            layers.append((packed, scales_and_zeros, torch.randn(1, k), torch.empty(1, n)))
            nbytes += packed.numel() + scales_and_zeros.numel() * 2
        else:  # torch's own int4 layout and kernel
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator)
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
            scales_and_zeros = torch.rand(k // 32, n, 2).bfloat16()
            layers.append((packed, scales_and_zeros, torch.randn(1, k).bfloat16(), torch.empty(1, n)))
            nbytes += packed.numel() + scales_and_zeros.numel() * 2
    call: Callable[[tuple[Any, ...]], Any]
    if kernel.startswith("packcache"):
        from packcache import native
        from packcache.packers_torch import Int4WeightOnly, Int8WeightOnly, LinearBFloat16, LinearFloat32

        if native.status().isa is None:
            sys.exit(f"{kernel}: no compiled kernels in this process ({native.status().reason})")
        # Each layer's operands bound (checked) once, as a packed layer's are; a call checks only its activations.
        bound: list[tuple[Any, ...]] = []
        for layer in layers:
            if kernel in ("packcache bf16", "packcache dense bf16"):
                bound.append((LinearBFloat16().bind({"weight": layer[0]}), layer[1]))
            elif kernel == "packcache dense f32":
                bound.append((LinearFloat32().bind({"weight": layer[0]}), layer[1]))
            elif kernel == "packcache int4":
                parts = {
                    "weight": layer[0],
                    "scales_and_zeros": layer[1],
                    "input_scales": torch.ones(layer[2].shape[1]),
                }
                bound.append((Int4WeightOnly(32).bind(parts), layer[2]))
            elif kernel.startswith("packcache dense int8"):  # a float32 scale per row
                n, k = layer[0].shape
                spec = {"weight": (torch.int8, (n, k)), "scales": (torch.float32, (n,))}
                bound.append((native.bind(spec, {"weight": layer[0], "scales": layer[1]}), layer[2]))
            else:
                bound.append((Int8WeightOnly().bind({"weight": layer[0], "scales": layer[1]}), layer[2]))
        layers = bound

        def call(layer: tuple[Any, ...]) -> Any:
            operands, x = layer
            if kernel.startswith("packcache dense"):
                return native.dense_product(x, operands, threads)
            if kernel == "packcache bf16":
                return native.bf16_product(x, operands, threads)
            if kernel == "packcache int4":
                return native.int4_product(x, operands, 32, threads, input_scales=False)
            return native.int8_product(x, operands, threads)

    elif kernel.startswith("linear"):

        def call(layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return torch.nn.functional.linear(layer[1], layer[0])

    elif kernel == "_weight_int8pack_mm":

        def call(layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return torch._weight_int8pack_mm(layer[2], layer[0], layer[1])

    elif kernel == "int8 prefill 32 rows, whole":

        def call(layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return torch.nn.functional.linear(layer[2], layer[0].to(torch.bfloat16)).mul_(layer[1])

    elif kernel == "int8 prefill 32 rows, blocks":

        def call(layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
            weight, x = layer[0], layer[2]
            block = max(16, (8 << 20) // (weight.shape[1] * x.element_size()))
            starts = range(0, len(weight), block)
            parts = [torch.nn.functional.linear(x, weight[i : i + block].to(x.dtype)) for i in starts]
            return torch.cat(parts, dim=1).mul_(layer[1])

    elif kernel == "_int_mm (W8A8)":

        def call(layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
            x = layer[2].float()
            scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
            quantised = torch.round(x / scale).to(torch.int8)
            return torch._int_mm(quantised, layer[0].t()).float().mul_(scale).mul_(layer[3])

    else:

        def call(layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return torch._weight_int4pack_mm_for_cpu(layer[2], layer[0], 32, layer[1])

    with torch.inference_mode():
        for layer in layers:
            call(layer)
        times = []
        for _ in range(passes):
            started = time.perf_counter()
            for layer in layers:
                call(layer)
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    return {"kernel": kernel, "ms_per_pass": seconds * 1000, "gib_per_pass": nbytes / 2**30,
            "gib_s": nbytes / seconds / 2**30, "tok_s_bound": 1 / seconds,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_average": os.getloadavg()[0],
            "native": _native_isa()}  # fmt: skip


def _native_isa() -> str | None:
    from packcache import native

    return native.status().isa


def run_isa(isa: str, threads: int, kernels: tuple[str, ...] = KERNELS) -> list[dict[str, Any]]:
    env = dict(os.environ)
    if isa == "avx2":
        env.update(core.AVX2_ENV)
    results = []
    for kernel in kernels:
        proc = subprocess.run([sys.executable, __file__, "--child", kernel, "--threads", str(threads)],
                              capture_output=True, text=True, env=env, timeout=1800, check=True)  # fmt: skip
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["isa"] = isa
        bound = "" if "prefill" in kernel else f"-> {result['tok_s_bound']:6.1f} tok/s bound  "
        print(f"  {isa:<6} {kernel:<32} {result['ms_per_pass']:8.1f} ms  {result['gib_per_pass']:5.2f} GiB  "
              f"{result['gib_s']:6.1f} GiB/s  {bound}"
              f"(torch {result['cpu_capability']}, packcache {result['native']}, "
              f"load avg {result['load_average']:.2f})", flush=True)  # fmt: skip
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", choices=("native", "avx2", "both"), default="both")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--kernel", action="append", help="a kernel to run, by name; repeat it (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kernels = tuple(args.kernel) if args.kernel else KERNELS
    if set(kernels) - set(KERNELS):
        parser.error(f"--kernel: unknown {sorted(set(kernels) - set(KERNELS))}; one of {'; '.join(KERNELS)}")
    if args.child:
        print(json.dumps(measure(args.child, args.threads)), flush=True)
        return
    print(__doc__.split("Usage:")[0].strip())
    print(f"\ncpu: {core.cpu_model()}, {os.cpu_count()} CPUs, {args.threads} threads\n")
    results: list[dict[str, Any]] = []
    for isa in ("native", "avx2") if args.isa == "both" else (args.isa,):
        results += run_isa(isa, args.threads, kernels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": core.cpu_model(), "threads": args.threads, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
