"""Decode: a packed LLM's tokens per second on the CPU, against transformers and llama.cpp.

Method (printed first when run):

* The model, made by this script (random weights: speed does not depend on their values): a
  Llama-3.2-1B-shaped ``LlamaForCausalLM`` (hidden 2048, intermediate 8192, 16 layers, 32 heads,
  8 KV heads, head dim 64, vocabulary 128256, output head tied to the input embeddings: 1.24 B
  parameters), ``torch.manual_seed(0)`` and transformers' own initialisation, saved in bfloat16
  by ``save_pretrained`` (safetensors). ``--quick``: 4 layers, 512 wide (vocabulary kept: the
  output head is a large part of a small model's decode).
* Systems, each in fresh processes with 2 threads: transformers fp32 and bf16
  (``AutoModelForCausalLM.from_pretrained(dir, dtype=...)``); packcache fp32, bf16, int8 and int4
  (``packcache.hf.from_pretrained(dir, scheme, cache)``, loaded warm from a cache file built
  beforehand by one cold launch, whose time is the "build"); llama.cpp BF16, Q8_0 and Q4_0
  through ``llama-cpp-python`` compiled from its PyPI sdist for this CPU
  (``benchmarks/setup_decode.sh``), the GGUF files made from the same checkpoint by llama.cpp's
  own ``convert_hf_to_gguf.py`` (BF16) and quantiser (``llama_model_quantize``: Q8_0, Q4_0).
* A launch: load (timed; not the imports), then the 32-token prompt ``1000..1031`` in one
  forward asking the logits of the last position only, as ``generate()`` does: the first such
  forward ("first prefill": a mapped model's pages are faulted in there), then again on a fresh
  KV cache ("prefill", the compute); llama.cpp's prefill is its first (its load reads the file,
  and Q4_0 copies its weights into a repacked layout at load). Then 64 greedy tokens: the first
  from the prompt's logits, 63 more one forward each with the KV cache (decode, timed): decode
  tok/s = 63 / decode seconds. Then a long prompt, ``1000..1511`` (512 tokens, ``--long-prompt``),
  in one forward on a fresh KV cache ("prefill 512", once per launch; llama.cpp in batches of 512).
  Peak RSS (the child's own ``VmHWM``) and PSS (``/proc/self/smaps_rollup``) at the end.
  ``--runs`` launches of every system in rounds (order rotated each round), page cache warm;
  medians. Then one launch of each with its weight files dropped from the page cache first
  (``posix_fadvise DONTNEED``): the load "out of the page cache".
* Quality: cosine of the prompt's last-position logits against transformers fp32 and whether
  the 64 greedy tokens are the same.
* Bytes per token: the weight bytes a decode step reads (every linear layer's operands and the
  output head; the embedding lookup reads one row), and the bandwidth they imply at the
  measured tok/s: what limits a row is bytes per token over achieved bandwidth.

Ratios are of medians in the same run; absolute times drift on a shared machine.

Usage: .bench/decode/venv/bin/python benchmarks/decode.py [--quick] [--isa native|avx2] [--runs N] [--json FILE]
       [--only SYSTEMS]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from a hub: the model is made here
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import core  # noqa: E402  (benchmarks/core.py)

THREADS = 2
PROMPT = list(range(1000, 1032))
LONG_PROMPT = 512
NEW_TOKENS = 64
CAUSAL = "AutoModelForCausalLM"

MODEL_FULL: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 2048,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
}  # fmt: skip
MODEL_QUICK: dict[str, Any] = {
    **MODEL_FULL, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4,
}  # fmt: skip

#: (system, scheme) rows, in the order of the report.
TORCH_ROWS = [("transformers", "fp32"), ("transformers", "bf16"), ("packcache", "fp32"), ("packcache", "bf16"),
              ("packcache", "int8"), ("packcache", "int4")]  # fmt: skip
LLAMA_ROWS = [("llama.cpp", "BF16"), ("llama.cpp", "Q8_0"), ("llama.cpp", "Q4_0")]


#: What the report keeps of every launch.
RUN_FIELDS = ("tok_s", "tok_s_median_step", "prefill_s", "prefill_long_s", "load_s", "others_cpu_share")


def label(system: str, scheme: str) -> str:
    return f"{system} {scheme}"


# --------------------------------------------------------------------------- the model


def make_model(directory: Path, shape: dict[str, Any]) -> None:
    """The benchmark's checkpoint in ``directory`` (made once; a stamp names its shape)."""
    stamp = directory / "decode-shape.json"
    if stamp.exists() and json.loads(stamp.read_text()) == shape:
        return
    import torch
    import transformers

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape)
    model = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    del model
    try:
        import decode_llamacpp
    except ImportError:
        pass  # no llama.cpp rows without it: said where they are missing
    else:
        decode_llamacpp.add_tokenizer(directory)
    stamp.write_text(json.dumps(shape))


# --------------------------------------------------------------------------- one launch (a child process)


def _pss_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))


def _weight_bytes_per_token(model: Any) -> int:
    """Bytes of the operands every decode step reads: each linear layer's (packed or not), output head included."""
    from torch import nn

    from packcache.torch import PackedLinear

    total = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            total += sum(t.numel() * t.element_size() for t in module._buffers.values() if t is not None)
        elif isinstance(module, nn.Linear):
            total += sum(t.numel() * t.element_size() for t in module.parameters())
    return total


def _kernels(model: Any) -> dict[str, str]:
    """Per kind of packed layer (its last name part: q_proj, lm_head, ...), the ops it runs for 1 and 32 rows."""
    from packcache.torch import PackedLinear

    kinds: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            kind = name.rpartition(".")[2]
            kinds.setdefault(kind, f"1 row: {module.kernel(1)}; {len(PROMPT)} rows: {module.kernel(len(PROMPT))}")
    return kinds


def child_torch(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    torch.set_num_threads(THREADS)
    if spec.get("drop"):
        core.drop_pages(spec["drop"])
    result: dict[str, Any] = {}
    import transformers  # imports (and the model class's module) are not part of the timed load

    from packcache import hf

    transformers.LlamaForCausalLM  # noqa: B018  (imports the modeling module)
    started = time.perf_counter()
    if spec["system"] == "transformers":
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["scheme"]]
        model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype)
        model.eval()
    else:
        model = hf.from_pretrained(spec["model"], spec["scheme"], spec["cache"], auto_class=CAUSAL)
        stats = model.packcache.stats()
        result.update(state=stats.state, heap_bytes=stats.heap_bytes, mapped_bytes=stats.mapped_bytes,
                      kernel_path=hf.load_report(model).kernel_path, kernels=_kernels(model))  # fmt: skip
    result["load_s"] = time.perf_counter() - started
    if spec.get("build"):
        return result
    result["weight_bytes_per_token"] = _weight_bytes_per_token(model)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        started = time.perf_counter()
        # Logits of the last position only, as generate() asks (and as llama.cpp computes them). The first
        # forward after a load also faults a mapped model's pages in: timed apart, then the prompt again.
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        result["first_prefill_s"] = time.perf_counter() - started
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        result["prefill_s"] = time.perf_counter() - started
        logits = out.logits[0, -1].float()
        past = out.past_key_values
        token = int(logits.argmax())
        tokens = [token]
        steps: list[float] = []
        busy_start, own_start = core.cpu_seconds()
        started = time.perf_counter()
        for _ in range(NEW_TOKENS - 1):
            step = time.perf_counter()
            out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            steps.append(time.perf_counter() - step)
        decode_s = time.perf_counter() - started
        busy_end, own_end = core.cpu_seconds()
        if spec.get("long"):  # a fresh KV cache: the long prompt's own prefill, as a chat's first request
            long_ids = torch.tensor([list(range(1000, 1000 + spec["long"]))])
            started = time.perf_counter()
            model(input_ids=long_ids, use_cache=True, logits_to_keep=1)
            result["prefill_long_s"] = time.perf_counter() - started
    np.save(spec["logits"], logits.numpy())
    # Two threads on two shared cores stall at every barrier when anything else runs: the CPU share other
    # processes took while decoding says whether a launch was contended (above ~0.05), and the median step's
    # rate is robust to such stalls.
    others = max(0.0, (busy_end - busy_start) - (own_end - own_start)) / (decode_s * (os.cpu_count() or 1))
    result.update(
        decode_s=decode_s, tok_s=(NEW_TOKENS - 1) / decode_s, tokens=tokens,
        tok_s_median_step=1 / sorted(steps)[len(steps) // 2], others_cpu_share=others,
        peak_rss_kib=core.peak_rss_kib(), pss_kib=_pss_kib(),
    )  # fmt: skip
    return result


def child_profile(spec: dict[str, Any]) -> dict[str, Any]:
    """torch.profiler over 16 decode steps: the ops' share of the time (where a row's time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(THREADS)
    if spec["system"] == "transformers":
        import transformers

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["scheme"]]
        model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype)
    else:
        from packcache import hf

        model = hf.from_pretrained(spec["model"], spec["scheme"], spec["cache"], auto_class=CAUSAL)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([PROMPT]), use_cache=True, logits_to_keep=1)
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        for _ in range(3):
            out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(16):
                out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return {"ops": [{"op": e.key, "share": e.self_cpu_time_total / total, "calls_per_token": e.count / 16,
                     "ms_per_token": e.self_cpu_time_total / 16 / 1000} for e in top]}  # fmt: skip


def child_llamacpp(spec: dict[str, Any]) -> dict[str, Any]:
    import decode_llamacpp

    if spec.get("drop"):
        core.drop_pages(spec["drop"])
    result: dict[str, Any] = decode_llamacpp.run(spec["gguf"], PROMPT, NEW_TOKENS, threads=THREADS,
                                                 logits_path=spec["logits"],
                                                 long_prompt=spec.get("long", 0))  # fmt: skip
    return result


#: Extra environment of the torch children (``--isa avx2``: ``core.AVX2_ENV``; llama.cpp keeps the build
#: ``setup_decode.sh`` made for this CPU, so the comparison is then against its faster code).
CHILD_ENV: dict[str, str] = {}


def child_bandwidth(spec: dict[str, Any]) -> dict[str, Any]:
    """The machine's bandwidth as the kernels see it: ``spec['file']`` mapped read-only and read whole (after one read
    that faults it in) by packcache's compiled stream probe with :data:`THREADS` threads; the median of 5 reads."""
    import mmap

    import torch

    from packcache import native

    torch.set_num_threads(THREADS)
    with open(spec["file"], "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    size = len(mapping)
    native.stream(mapping, THREADS)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        native.stream(mapping, THREADS)
        times.append(time.perf_counter() - began)
    return {"gib_s": size / median(times) / 2**30, "bytes": size}


def launch(spec: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
    """One fresh process running ``spec``; its JSON result (a failure stops the benchmark, printing why)."""
    extra = CHILD_ENV if spec.get("kind", "torch") != "llamacpp" else {}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **extra},
    )  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"launch {spec} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------- the run


def median(values: list[float]) -> float:
    return core.quartiles(values)[1] if len(values) > 1 else values[0]


def cosine(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def rounds(rows: list[tuple[str, str]], runs: int) -> Iterator[tuple[int, tuple[str, str]]]:
    for r in range(runs):
        shift = r % len(rows)
        for row in rows[shift:] + rows[:shift]:
            yield r, row


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    work = Path(args.work).resolve()
    shape = MODEL_QUICK if args.quick else MODEL_FULL
    model_dir = work / ("model-quick" if args.quick else "model")
    started = time.perf_counter()
    make_model(model_dir, shape)
    print(f"model: {model_dir} made/checked in {time.perf_counter() - started:.1f} s", flush=True)
    rows = [row for row in TORCH_ROWS if not args.only or label(*row) in args.only]
    llama_rows: list[tuple[str, str]] = []
    missing: list[str] = []
    ggufs: dict[str, str] = {}
    builds: dict[str, Any] = {}
    try:
        import decode_llamacpp
    except ImportError as exc:
        missing.append(f"llama.cpp rows: {exc} (run benchmarks/setup_decode.sh and this script with its python)")
    else:
        wanted = [row for row in LLAMA_ROWS if not args.only or label(*row) in args.only]
        if wanted:
            made = decode_llamacpp.make_ggufs(model_dir, work / ("gguf-quick" if args.quick else "gguf"))
            ggufs = {kind: str(path) for kind, path in made["files"].items()}
            builds.update({label("llama.cpp", k): v for k, v in made["seconds"].items()})
            llama_rows = [row for row in wanted if row[1] in ggufs]
    logits_dir = work / "logits"
    logits_dir.mkdir(exist_ok=True)
    caches: dict[str, str] = {}
    for system, scheme in rows:
        if system != "packcache":
            continue
        cache = work / f"{model_dir.name}-{scheme}{'-avx2' if CHILD_ENV else ''}.pcache"
        cache.unlink(missing_ok=True)
        caches[scheme] = str(cache)
        built = launch({"system": system, "scheme": scheme, "model": str(model_dir), "cache": str(cache),
                        "build": True})  # fmt: skip
        if built["state"] != "stored":
            sys.exit(f"the cold launch of {label(system, scheme)} left state {built['state']!r}, not 'stored'")
        builds[label(system, scheme)] = built["load_s"]
        print(f"built {label(system, scheme)}: {built['load_s']:.1f} s", flush=True)

    def spec(row: tuple[str, str], tag: str, drop: bool = False) -> dict[str, Any]:
        system, scheme = row
        logits = str(logits_dir / f"{system}-{scheme}-{tag}.npy")
        long = 0 if drop else args.long_prompt  # a cold launch measures the load and the first prefill
        if system == "llama.cpp":
            return {"kind": "llamacpp", "gguf": ggufs[scheme], "logits": logits,
                    "drop": [ggufs[scheme]] if drop else [], "long": long}  # fmt: skip
        files = [caches[scheme]] if system == "packcache" else [str(p) for p in model_dir.glob("*.safetensors")]
        return {"kind": "torch", "system": system, "scheme": scheme, "model": str(model_dir),
                "cache": caches.get(scheme), "logits": logits, "drop": files if drop else [], "long": long}  # fmt: skip

    probe = caches.get("bf16") or next(iter(caches.values()), None) or str(next(model_dir.glob("*.safetensors")))
    bandwidth = [launch({"kind": "bandwidth", "file": probe})]
    print(f"bandwidth (a streaming read of {Path(probe).name}, mapped, {THREADS} threads): "
          f"{bandwidth[0]['gib_s']:.1f} GiB/s", flush=True)  # fmt: skip
    every = rows + llama_rows
    samples: dict[str, list[dict[str, Any]]] = {label(*row): [] for row in every}
    for r, row in rounds(every, args.runs):
        result = launch(spec(row, f"r{r}"))
        if row[0] == "packcache" and (result["state"] != "mapped" or result["heap_bytes"]):
            sys.exit(f"a warm launch of {label(*row)} was not all mapped: {result}")
        samples[label(*row)].append(result)
        long = f" ({args.long_prompt}: {result['prefill_long_s']:.2f} s)" if args.long_prompt else ""
        print(f"  round {r} {label(*row):<22} load {result['load_s']:.2f} s  "
              f"prefill {result['prefill_s']:.2f} s{long}  decode {result['tok_s']:.2f} tok/s "
              f"(median step {result['tok_s_median_step']:.2f})  "
              f"others' CPU {result['others_cpu_share']:.2f}", flush=True)  # fmt: skip
    bandwidth.append(launch({"kind": "bandwidth", "file": probe}))
    print(f"bandwidth after the rounds: {bandwidth[1]['gib_s']:.1f} GiB/s", flush=True)
    machine_gib_s = median([b["gib_s"] for b in bandwidth])
    cold: dict[str, dict[str, Any]] = {}
    for row in every:
        cold[label(*row)] = launch(spec(row, "cold", drop=True))
    profiles: dict[str, Any] = {}
    if args.profile:
        for row in rows:
            profiles[label(*row)] = launch({**spec(row, "profile"), "kind": "profile"})

    reference = np.load(logits_dir / "transformers-fp32-r0.npy") if ("transformers", "fp32") in rows else None
    ref_tokens = samples.get("transformers fp32", [{}])[0].get("tokens") if reference is not None else None
    table: dict[str, Any] = {}
    for row in every:
        name = label(*row)
        runs_ = samples[name]
        entry: dict[str, Any] = {
            "tok_s": median([s["tok_s"] for s in runs_]),
            "tok_s_median_step": median([s["tok_s_median_step"] for s in runs_]),
            "others_cpu_share_max": max(s["others_cpu_share"] for s in runs_),
            "prefill_s": median([s["prefill_s"] for s in runs_]),
            "first_prefill_s": median([s.get("first_prefill_s", s["prefill_s"]) for s in runs_]),
            "prefill_long_s": median([s["prefill_long_s"] for s in runs_]) if args.long_prompt else None,
            "load_warm_s": median([s["load_s"] for s in runs_]),
            "load_cold_s": cold[name]["load_s"],
            "prefill_cold_s": cold[name].get("first_prefill_s", cold[name]["prefill_s"]),
            "peak_rss_mib": max(s["peak_rss_kib"] for s in runs_) / 1024,
            "pss_mib": median([s["pss_kib"] for s in runs_]) / 1024,
            "runs": [{k: s.get(k) for k in RUN_FIELDS} for s in runs_],
            "build_s": builds.get(name),
        }
        first = runs_[0]
        for key in ("kernel_path", "kernels", "system_info", "weight_bytes_per_token", "file_types"):
            if key in first:
                entry[key] = first[key]
        if entry.get("weight_bytes_per_token"):
            entry["achieved_gib_s"] = entry["weight_bytes_per_token"] * entry["tok_s"] / 2**30
            entry["of_bandwidth"] = entry["achieved_gib_s"] / machine_gib_s
        if reference is not None:
            entry["logits_cosine"] = cosine(np.load(logits_dir / f"{row[0]}-{row[1]}-r0.npy"), reference)
            entry["same_tokens"] = first["tokens"] == ref_tokens
            entry["first_token_difference"] = next(
                (i for i, (a, b) in enumerate(zip(first["tokens"], ref_tokens or [], strict=False)) if a != b), None
            )
        table[name] = entry
    return {"table": table, "profiles": profiles, "missing": missing, "model": shape, "model_dir": str(model_dir),
            "bandwidth_gib_s": [b["gib_s"] for b in bandwidth], "long_prompt": args.long_prompt}  # fmt: skip


def goals(table: dict[str, Any], long_prompt: int = LONG_PROMPT) -> list[tuple[str, float | None, bool | None]]:
    """The issue's goals: each a ratio of this run (``None`` where a row is missing), met at 1.0, 1.5 for a
    packed prefill against transformers bf16 (fp32: 1.0), or 0.8 for a share of the measured bandwidth."""

    def ratio(key: str, a: str, b: str, invert: bool = False) -> float | None:
        if a not in table or b not in table or table[a].get(key) is None or table[b].get(key) is None:
            return None
        x, y = table[a][key], table[b][key]
        return y / x if invert else x / y

    checks: list[tuple[str, float | None, float]] = [
        ("packcache int8 decode tok/s / llama.cpp Q8_0", ratio("tok_s", "packcache int8", "llama.cpp Q8_0"), 1.0),
        ("packcache int4 decode tok/s / llama.cpp Q4_0", ratio("tok_s", "packcache int4", "llama.cpp Q4_0"), 1.0),
        ("packcache bf16 decode tok/s / llama.cpp BF16", ratio("tok_s", "packcache bf16", "llama.cpp BF16"), 1.0),
        ("packcache bf16 decode tok/s / transformers bf16", ratio("tok_s", "packcache bf16", "transformers bf16"),
         1.0),
    ]  # fmt: skip
    for scheme in ("int8", "int4", "bf16"):
        row = table.get(f"packcache {scheme}", {})
        checks.append((f"packcache {scheme} achieved / measured bandwidth", row.get("of_bandwidth"), 0.8))
    # the prefill goal: 1.5x transformers bf16, at 32 and at 512 tokens, for int8, int4 and bf16
    for key, tokens in (("prefill_s", len(PROMPT)), ("prefill_long_s", long_prompt)):
        for scheme in ("fp32", "bf16", "int8", "int4"):
            checks.append((f"transformers bf16 prefill {tokens} s / packcache {scheme}",
                           ratio(key, f"packcache {scheme}", "transformers bf16", invert=True),
                           1.0 if scheme == "fp32" else 1.5))  # fmt: skip
    return [(what, value, None if value is None else value >= goal) for what, value, goal in checks]


def print_report(result: dict[str, Any]) -> None:
    table = result["table"]
    bf16 = table.get("transformers bf16", {}).get("tok_s")
    q8 = table.get("llama.cpp Q8_0", {}).get("tok_s")
    print("\n| system / scheme | decode tok/s (median step) | x transformers bf16 | x llama.cpp Q8_0 | "
          "prefill 32 tok (first) | prefill 512 tok | load warm / cold page cache | peak RSS | PSS | build | "
          "weight bytes/token | "
          "achieved (of bandwidth) | logits cos | same 64 tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, e in table.items():
        x_bf16 = f"{e['tok_s'] / bf16:.2f}" if bf16 else "-"
        x_q8 = f"{e['tok_s'] / q8:.2f}" if q8 else "-"
        build = f"{e['build_s']:.1f} s" if e.get("build_s") is not None else "-"
        per_token = f"{e['weight_bytes_per_token'] / 2**20:.0f} MiB" if e.get("weight_bytes_per_token") else "-"
        achieved = f"{e['achieved_gib_s']:.1f} GiB/s ({e['of_bandwidth']:.0%})" if e.get("achieved_gib_s") else "-"
        cos = f"{e['logits_cosine']:.5f}" if "logits_cosine" in e else "-"
        same = "-"
        if "same_tokens" in e:
            same = "yes" if e["same_tokens"] else f"no (from {e['first_token_difference']})"
        print(f"| {name} | {e['tok_s']:.2f} ({e['tok_s_median_step']:.2f}) | {x_bf16} | {x_q8} | "
              f"{e['prefill_s']:.2f} s ({e['first_prefill_s']:.2f} s) | "
              f"{'-' if e.get('prefill_long_s') is None else format(e['prefill_long_s'], '.2f') + ' s'} | "
              f"{e['load_warm_s']:.2f} / {e['load_cold_s']:.2f} s | "
              f"{e['peak_rss_mib']:.0f} MiB | {e['pss_mib']:.0f} MiB | "
              f"{build} | {per_token} | {achieved} | {cos} | {same} |")  # fmt: skip
    print("\nkernels per layer kind:")
    for name, e in table.items():
        if "kernels" in e:
            print(f"  {name} (path {e.get('kernel_path')}):")
            for kind, ops in e["kernels"].items():
                print(f"    {kind:<10} {ops}")
        if "system_info" in e:
            print(f"  {name}: {e['system_info']}")
    for name, profile in result["profiles"].items():
        print(f"\nprofile of {name} (16 decode steps; self CPU time):")
        for op in profile["ops"]:
            print(f"  {op['share'] * 100:5.1f} %  {op['ms_per_token']:7.2f} ms/token  "
                  f"{op['calls_per_token']:5.0f}/token  {op['op']}")  # fmt: skip
    worst = max((e["others_cpu_share_max"], name) for name, e in table.items()) if table else (0.0, "")
    print(
        f"\nlargest CPU share other processes took while a row decoded: {worst[0]:.3f} ({worst[1]}; "
        "above ~0.05 that launch was contended)"
    )
    for line in result["missing"]:
        print(f"\nMISSING: {line}")


def machine() -> dict[str, Any]:
    import torch
    import transformers

    from packcache import native
    from packcache.kernels import cpu_kernels

    return {
        "cpu": core.cpu_model(), "cpu_count": os.cpu_count(), "threads": THREADS, "kernels": cpu_kernels().flags(),
        "native": native.status().flags(), "isa_env": CHILD_ENV,
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 4-layer, 512-wide model (vocabulary kept)")
    parser.add_argument("--runs", type=int, default=3, help="warm launches of every system (median)")
    parser.add_argument("--long-prompt", type=int, default=LONG_PROMPT,
                        help="tokens of the long prompt each warm launch prefills last (0: none)")  # fmt: skip
    parser.add_argument("--only", nargs="*", help="rows to run, e.g. 'packcache int8' 'llama.cpp Q8_0'")
    parser.add_argument("--profile", action="store_true", help="also profile the decode of every torch row")
    parser.add_argument("--work", default=str(HERE.parent / ".bench" / "decode" / "work"), help="model, GGUF, caches")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: torch, oneDNN and packcache's kernels on their AVX2 code (a CPU without AVX512)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.isa == "avx2":
        CHILD_ENV.update(core.AVX2_ENV)
        os.environ.update(core.AVX2_ENV)  # machine() below reports what the children run
    if args.child:
        spec = json.loads(args.child)
        kind = spec.get("kind", "torch")
        work = {"torch": child_torch, "profile": child_profile, "llamacpp": child_llamacpp,
                "bandwidth": child_bandwidth}[kind]  # fmt: skip
        print(json.dumps(work(spec)), flush=True)
        return
    began, load_start = time.perf_counter(), os.getloadavg()
    print(__doc__.split("Usage:")[0].strip())
    info = machine()
    print(f"\nmachine: {info}\n1/5/15-min load average at start: {load_start}", flush=True)
    result = run(args)
    print_report(result)
    print("\ngoals (ratios of this run; >= 1 is met):")
    for what, value, ok in goals(result["table"], result["long_prompt"]):
        shown = "missing" if value is None else f"{value:.2f}"
        print(f"  {'-' if ok is None else 'met' if ok else 'NOT met':<8} {what:<60} {shown}")
    load_end, elapsed = os.getloadavg(), time.perf_counter() - began
    print(f"\n1/5/15-min load average at end: {load_end}; total {elapsed:.0f} s")
    if args.json:
        info.update(load_average_start=list(load_start), load_average_end=list(load_end))
        with open(args.json, "w") as f:
            json.dump({"quick": args.quick, "machine": info, "elapsed_s": elapsed, **result,
                       "goals": [{"what": w, "value": v, "met": ok}
                                 for w, v, ok in goals(result["table"], result["long_prompt"])]},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
