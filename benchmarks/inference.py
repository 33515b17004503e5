"""Inference and model load: packcache's MiniLM against sentence-transformers and torchao.

Method (printed first when run):

* Texts: batch 1 is one short sentence; batch 64 is 64 sentences of 6 to 48 words
  (uniform), made deterministically from a fixed word list and seed (none is a test or
  calibration sentence). Quality is measured on those 65 texts plus the empty string.
* Throughput (one process, page cache warm, every model loaded and run once before
  timing, then rounds interleaving every method so drift hits all alike): the wall
  time of one ``embed``/``encode`` call of the batch, tokenisation included, as
  sentences/s. Methods: packcache ``minilm`` fp32/bf16/int8/int4 from a warm cache
  (weights mapped), on this machine's default kernel path and forced onto the other
  one; sentence-transformers (``SentenceTransformer(<the same model dir>)``, batch size
  32) in float32 and cast to bfloat16; torchao 0.18 ``Int8WeightOnlyConfig()`` (its only
  version, 2) applied to the float32 and to the bfloat16 sentence-transformers model.
* Quality: minimum cosine of each method's embeddings against sentence-transformers
  float32 on the 66 quality texts, and the empty string's own cosine.
* Time to the first embedding: a fresh ``python`` process (interpreter start and imports
  included) that loads the model and embeds one sentence; wall time measured by the
  parent from spawn to the embedding line. packcache loads its default scheme from a
  warm cache; sentence-transformers loads the same model directory (``HF_HUB_OFFLINE=1``).
* Model load (in-process, page cache warm, interleaved): ``minilm.load(scheme, cache,
  tokenizer=...)`` from a warm cache, against (c) safetensors ``safe_open`` +
  ``get_tensor`` of every tensor of the source checkpoint and (a) repacking with
  packcache's own packers (``minilm.load(scheme, cache=False)``, int4 including its
  calibration). A cProfile of the warm load splits its time between the core cache
  (``Session``/``WeightCache``/store/format/stats) and the rest.

Figures are medians with the interquartile range; ratios are of medians from the same
run. Absolute times drift on a shared machine; compare the ratios.

Usage: python benchmarks/inference.py [--quick] [--json FILE] [--threads N]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# Nothing may come from a hub: every model is a local directory (set before anything imports huggingface_hub).
os.environ["HF_HUB_OFFLINE"] = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import core  # noqa: E402  (benchmarks/core.py: quartiles)

SHORT = "The train to the coast leaves at noon."
WORDS = tuple(
    " ".join(
        [
            "the a of and to in is was for on that with as by at from his her an be this are which have had it not",
            "people time year city water music model data system school river light house night world market train",
            "report garden window letter doctor kitchen island bridge engine forest paper story answer",
            "small large early late quiet bright green heavy simple careful modern ancient local public",
            "quickly slowly under over between against during before after without through around",
            "runs grew opened built measured found wrote reads played sold moved changed carried explained",
        ]
    ).split()
)
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def bench_texts(count: int = 64, seed: int = 20261130) -> list[str]:
    """``count`` sentences of 6 to 48 words, the same on every run."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 48))]
        texts.append(" ".join(words).capitalize() + rng.choice(".!?"))
    return texts


def summary(samples: list[float]) -> dict[str, float]:
    q1, med, q3 = core.quartiles(samples) if len(samples) > 1 else (samples[0],) * 3
    return {"median_s": med, "q1_s": q1, "q3_s": q3, "n": len(samples)}


def cpu_report() -> dict[str, Any]:
    """The facts that decided the kernel path: torch's view and the CPU's own flags."""
    from packcache.kernels import cpu_kernels

    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {**cpu_kernels().flags(), "cpuinfo_flags": [f for f in CPU_FLAGS if f in flags]}


def _cosines(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    result: np.ndarray[Any, Any] = (a64 * b64).sum(1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))
    return result


# ---------------------------------------------------------------- the methods


def _sentence_transformer(dtype: Any, torchao: bool) -> Any:
    import torch
    from sentence_transformers import SentenceTransformer

    from packcache.models import minilm

    model = SentenceTransformer(str(minilm.default_model_path()), device="cpu")
    if dtype is not torch.float32:
        model = model.to(dtype)
    if torchao:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(model, Int8WeightOnlyConfig())
    return model


def methods(directory: str) -> dict[str, Callable[[list[str]], np.ndarray[Any, Any]]]:
    """Every method, loaded and ready: name -> embed(texts) returning float32 ``[n, 384]``."""
    import torch

    from packcache.kernels import cpu_kernels
    from packcache.models import minilm

    out: dict[str, Callable[[list[str]], np.ndarray[Any, Any]]] = {}
    tokenizer = minilm.load_tokenizer()
    default = cpu_kernels().default_path
    for scheme in minilm.SCHEMES:
        path = os.path.join(directory, f"infer-{scheme}.pcache")
        minilm.load(scheme, cache=path, tokenizer=tokenizer).close()  # build: every timed load is warm
        paths = ["fp32"] if scheme == "fp32" else [default, *(p for p in ("bf16", "fp32") if p != default)]
        for kernel_path in paths:
            model = minilm.load(scheme, cache=path, tokenizer=tokenizer, kernel_path=kernel_path)
            assert model.cache.stats().state == "mapped", model.cache.stats()
            out[f"packcache {scheme} [{kernel_path}]"] = model.embed
    for label, dtype, torchao in (
        ("sentence-transformers fp32", torch.float32, False),
        ("sentence-transformers bf16", torch.bfloat16, False),
        ("torchao int8wo (fp32 model)", torch.float32, True),
        ("torchao int8wo (bf16 model)", torch.bfloat16, True),
    ):
        st = _sentence_transformer(dtype, torchao)

        def encode(texts: list[str], st: Any = st) -> np.ndarray[Any, Any]:
            with torch.inference_mode():
                return np.asarray(st.encode(texts, batch_size=32, convert_to_tensor=True).float().numpy())

        out[label] = encode
    return out


def bench_throughput(repeat: int, directory: str) -> dict[str, Any]:
    texts, short = bench_texts(), [SHORT]
    quality = [*texts, SHORT, ""]
    ms = methods(directory)
    reference = ms["sentence-transformers fp32"](quality)
    rows: dict[str, dict[str, Any]] = {}
    budget: dict[str, int] = {}
    for name, embed in ms.items():
        got = embed(quality)
        cos = _cosines(got, reference)
        started = time.perf_counter()
        embed(texts)  # warm-up, and a first estimate: very slow methods get fewer rounds
        first = time.perf_counter() - started
        embed(short)
        budget[name] = repeat if first < 1.0 else max(2, min(repeat, 3))
        rows[name] = {"min_cosine": float(cos.min()), "empty_cosine": float(cos[-1]), "b64": [], "b1": []}
    for round_ in range(repeat):
        for name, embed in ms.items():
            if round_ >= budget[name]:
                continue
            gc.collect()
            started = time.perf_counter()
            embed(texts)
            rows[name]["b64"].append(time.perf_counter() - started)
            started = time.perf_counter()
            embed(short)
            rows[name]["b1"].append(time.perf_counter() - started)
    base = {
        b: {k: summary(rows[f"sentence-transformers {b}"][k])["median_s"] for k in ("b1", "b64")}
        for b in ("fp32", "bf16")
    }
    result = []
    for name, row in rows.items():
        entry: dict[str, Any] = {"method": name, "min_cosine": row["min_cosine"], "empty_cosine": row["empty_cosine"]}
        for batch, count in (("b1", 1), ("b64", len(texts))):
            s = summary(row[batch])
            entry[batch] = {
                **s,
                "sentences_per_s": count / s["median_s"],
                "speedup_vs_st_fp32": base["fp32"][batch] / s["median_s"],
                "speedup_vs_st_bf16": base["bf16"][batch] / s["median_s"],
            }
        result.append(entry)
    return {
        "workload": "inference: MiniLM embedding throughput, batch 1 and 64, min cosine vs sentence-transformers fp32",
        "batch64_words": [len(t.split()) for t in texts],
        "rows": result,
    }


# ---------------------------------------------------------------- time to the first embedding

FIRST_EMBEDDING = {
    "packcache": (
        "import time, sys\n"
        "t0 = time.perf_counter()\n"
        "from packcache.models import minilm\n"
        "t1 = time.perf_counter()\n"
        "m = minilm.load(sys.argv[2], cache=sys.argv[1])\n"
        "t2 = time.perf_counter()\n"
        "m.embed([sys.argv[3]])\n"
        "t3 = time.perf_counter()\n"
        "assert m.cache.stats().state == 'mapped'\n"
        'print(\'{"import_s": %r, "load_s": %r, "embed_s": %r}\' % (t1 - t0, t2 - t1, t3 - t2), flush=True)\n'
    ),
    "sentence-transformers": (
        "import time, sys\n"
        "t0 = time.perf_counter()\n"
        "from sentence_transformers import SentenceTransformer\n"
        "t1 = time.perf_counter()\n"
        "m = SentenceTransformer(sys.argv[1], device='cpu')\n"
        "t2 = time.perf_counter()\n"
        "m.encode([sys.argv[3]])\n"
        "t3 = time.perf_counter()\n"
        'print(\'{"import_s": %r, "load_s": %r, "embed_s": %r}\' % (t1 - t0, t2 - t1, t3 - t2), flush=True)\n'
    ),
}


def _first_embedding(kind: str, target: str, scheme: str) -> dict[str, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    argv = [sys.executable, "-c", FIRST_EMBEDDING[kind], target, scheme, SHORT]
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{proc.stderr[-2000:]}")
    parts: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, **parts}


def bench_first_embedding(directory: str, repeat: int) -> dict[str, Any]:
    from packcache.models import minilm

    scheme = minilm.default_scheme()
    path = os.path.join(directory, f"first-{scheme}.pcache")
    minilm.load(scheme, cache=path).close()
    model_dir = str(minilm.default_model_path())
    samples: dict[str, list[dict[str, float]]] = {"packcache": [], "sentence-transformers": []}
    for _ in range(repeat):
        samples["packcache"].append(_first_embedding("packcache", path, scheme))
        samples["sentence-transformers"].append(_first_embedding("sentence-transformers", model_dir, scheme))
    times = {
        f"{kind} {part}": summary([s[part] for s in rows])
        for kind, rows in samples.items()
        for part in ("wall_s", "import_s", "load_s", "embed_s")
    }
    ours, theirs = times["packcache wall_s"]["median_s"], times["sentence-transformers wall_s"]["median_s"]
    return {
        "workload": f"time to first embedding, fresh process: packcache {scheme} warm vs sentence-transformers fp32",
        "scheme": scheme,
        "times": times,
        "ratios": {"st_over_packcache_wall": theirs / ours},
    }


# ---------------------------------------------------------------- model load


def _core_share(scheme: str, path: str, tokenizer: Any, loads: int) -> dict[str, float]:
    """cProfile of ``loads`` warm loads: total, and the inclusive time inside the core cache."""
    from packcache.models import minilm

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(loads):
        minilm.load(scheme, cache=path, tokenizer=tokenizer).close()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    core_entry = {("cache.py", "get_or_pack"), ("cache.py", "__enter__"), ("cache.py", "__exit__"),
                  ("cache.py", "__init__"), ("cache.py", "close")}  # fmt: skip
    core_s = total_s = 0.0
    by_module: collections.Counter[str] = collections.Counter()
    for (filename, _line, name), (_cc, _nc, self_s, cumulative_s, _callers) in stats.items():
        total_s += self_s
        if "packcache" in filename and (os.path.basename(filename), name) in core_entry:
            core_s += cumulative_s
        module = (
            filename.split("packcache/")[-1]
            if "packcache/" in filename
            else ("torch" if "torch/" in filename else "other")
        )
        by_module[module] += self_s
    return {
        "profiled_load_ms": total_s / loads * 1e3,
        "core_cache_share": core_s / total_s,
        **{f"self_share {k}": v / total_s for k, v in by_module.most_common(8)},
    }


def bench_model_load(directory: str, repeat: int, repack_repeat: dict[str, int]) -> list[dict[str, Any]]:
    from safetensors import safe_open

    from packcache.models import minilm

    tokenizer = minilm.load_tokenizer()
    source = str(minilm.default_model_path() / "model.safetensors")

    def safetensors_open() -> object:
        with safe_open(source, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)

    results = []
    for scheme in ("int8", "int4"):
        path = os.path.join(directory, f"load-{scheme}.pcache")
        minilm.load(scheme, cache=path, tokenizer=tokenizer).close()

        def warm(scheme: str = scheme, path: str = path) -> None:
            m = minilm.load(scheme, cache=path, tokenizer=tokenizer)
            assert m.cache.stats().state == "mapped"
            m.close()

        def repack(scheme: str = scheme) -> None:
            minilm.load(scheme, cache=False, tokenizer=tokenizer).close()

        samples: dict[str, list[float]] = {"minilm_load_warm": [], "safetensors_source": [], "repack_own_packers": []}
        for round_ in range(repeat):
            plan = [("minilm_load_warm", warm), ("safetensors_source", safetensors_open)]
            if round_ < repack_repeat[scheme]:
                plan.append(("repack_own_packers", repack))
            for key, fn in plan:
                gc.collect()
                started = time.perf_counter()
                fn()
                samples[key].append(time.perf_counter() - started)
        times = {k: summary(v) for k, v in samples.items()}
        ours = times["minilm_load_warm"]["median_s"]
        results.append(
            {
                "workload": f"model load, minilm {scheme} (tokenizer passed in), page cache warm",
                "times": times,
                "ratios": {
                    "warm_over_safetensors": ours / times["safetensors_source"]["median_s"],
                    "repack_over_warm": times["repack_own_packers"]["median_s"] / ours,
                },
                "profile": _core_share(scheme, path, tokenizer, 30),
            }
        )
    return results


# ---------------------------------------------------------------- driver


def run(directory: str, quick: bool) -> list[dict[str, Any]]:
    """Every measurement of this file, in ``directory``; returns the result dicts, each with the
    machine's load average before and after it (other jobs on a shared machine skew absolute times,
    and with 2 threads per op a busy core stalls every parallel region)."""
    steps: list[Callable[[], dict[str, Any] | list[dict[str, Any]]]] = [
        lambda: bench_throughput(5 if quick else 11, directory),
        lambda: bench_first_embedding(directory, 2 if quick else 5),
        lambda: bench_model_load(directory, 7 if quick else 21, {"int8": 3 if quick else 7, "int4": 1 if quick else 3}),
    ]
    results: list[dict[str, Any]] = []
    for step in steps:
        before = os.getloadavg()[0]
        found = step()
        after = os.getloadavg()[0]
        for r in found if isinstance(found, list) else [found]:
            r["load_average_1min"] = [round(before, 2), round(after, 2)]
            results.append(r)
    return results


def ms(s: dict[str, float]) -> str:
    return f"{s['median_s'] * 1e3:.2f} ms ({s['q1_s'] * 1e3:.2f}-{s['q3_s'] * 1e3:.2f})"


def print_results(results: list[dict[str, Any]]) -> None:
    for r in results:
        print(f"\n{r['workload']}  (1-min load average before/after: {r.get('load_average_1min')})")
        if "rows" in r and r["workload"].startswith("inference"):
            print("| method | b1 median (IQR) | b1 sent/s | vs ST fp32 | vs ST bf16 | b64 median (IQR) | b64 sent/s "
                  "| vs ST fp32 | vs ST bf16 | min cos | empty |")  # fmt: skip
            print("|" + "---|" * 11)
            for row in r["rows"]:
                b1, b64 = row["b1"], row["b64"]
                print(
                    f"| {row['method']} | {ms(b1)} | {b1['sentences_per_s']:.0f} | {b1['speedup_vs_st_fp32']:.2f}x "
                    f"| {b1['speedup_vs_st_bf16']:.2f}x | {ms(b64)} | {b64['sentences_per_s']:.0f} "
                    f"| {b64['speedup_vs_st_fp32']:.2f}x | {b64['speedup_vs_st_bf16']:.2f}x | {row['min_cosine']:.5f} "
                    f"| {row['empty_cosine']:.5f} |"
                )
            continue
        for k, v in r.get("times", {}).items():
            print(f"  {k:<40} {ms(v) if v['median_s'] < 10 else str(round(v['median_s'], 2)) + ' s'}  n={v['n']}")
        for k, v in r.get("ratios", {}).items():
            print(f"  {k:<40} {v:10.2f}x")
        for k, v in r.get("profile", {}).items():
            print(f"  profile {k:<32} {v:.3f}")


def targets(results: list[dict[str, Any]], thresholds: dict[str, float]) -> list[tuple[str, float, bool]]:
    """The issue's targets for inference and model load, with the measured figure (never tuned to them).

    Speed targets apply to this machine's default kernel path; a forced path is checked
    against sentence-transformers fp32 and for quality only (it is there to be compared).
    """
    from packcache.kernels import cpu_kernels

    default = cpu_kernels().default_path
    checks: list[tuple[str, float, bool]] = []
    for r in results:
        if r["workload"].startswith("inference"):
            for row in r["rows"]:
                name = row["method"]
                if not name.startswith("packcache"):
                    continue
                scheme, path = name.split()[1], name.split()[2].strip("[]")
                forced = path != default and scheme != "fp32"
                label = f"{name}{' (forced)' if forced else ''}"
                for batch in ("b1", "b64"):
                    ratio = row[batch]["speedup_vs_st_fp32"]
                    checks.append((f"{label} {batch}: speed / ST fp32 >= 1", ratio, ratio >= 1))
                    if scheme in ("int8", "int4") and not forced:
                        ratio = row[batch]["speedup_vs_st_bf16"]
                        checks.append((f"{label} {batch}: speed / ST bf16 >= 1", ratio, ratio >= 1))
                if scheme in thresholds:
                    value = row["min_cosine"]
                    checks.append((f"{label}: min cosine >= {thresholds[scheme]}", value, value >= thresholds[scheme]))
        elif r["workload"].startswith("model load"):
            q = r["ratios"]
            name = r["workload"].split(",")[1].strip().split(" (")[0]
            value = q["warm_over_safetensors"]
            checks.append((f"{name}: minilm.load warm / safetensors source <= 3", value, value <= 3))
            value = q["repack_over_warm"]
            checks.append((f"{name}: repack (own packers) / minilm.load warm >= 50", value, value >= 50))
    return checks


MIN_COSINE = {"bf16": 0.999, "int8": 0.995, "int4": 0.95}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads for every method (default: torch's, one per core); with another job holding "
        "a core, 1 keeps every parallel region from stalling on a descheduled thread",
    )
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the fresh processes of the first-embedding runs
    print(__doc__.split("Usage:")[0].strip())
    print(f"\ncpu: {cpu_report()}, torch threads: {__import__('torch').get_num_threads()}")
    with tempfile.TemporaryDirectory(prefix="packcache-infer-") as d:
        results = run(d, args.quick)
    print_results(results)
    print("\ntargets")
    for what, value, ok in targets(results, MIN_COSINE):
        print(f"  {'met   ' if ok else 'MISSED'}  {what:<70} measured {value:.4g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_report(), "threads": args.threads, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
