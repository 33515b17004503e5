"""Warm launches against their limits, each in a fresh process.

Method (printed first when run). Every figure is timed in a fresh ``python`` process, after its
imports and a ``gc.collect()`` (so a collection owed by the imports does not land in the timed call),
with ``time.perf_counter`` around the call alone; the methods of a comparison alternate launch by
launch, and each figure is the median of ``--repeat`` launches with its interquartile range. Ratios
are of medians from the same run. Page cache warm throughout: every file is read once before.

* Core: a cache file of 1,000 packs of 16 KiB (int8, one key for all). *packcache*: a new
  ``WeightCache``, one session, 1,000 hits, then ``close()`` -- once with ``get_or_pack`` and the key
  as a mapping, once with ``Session.get_many`` and one ``PackKey`` (where the code has them).
  *Limit*: ``open`` + ``mmap`` + one ``numpy.frombuffer`` per pack at the same offsets, nothing checked.
* A hit inside a session: in one process, with a session open on a new cache, the time per pack of
  1,000 first hits (``get_many``, and ``get_or_pack``), against one ``numpy.frombuffer`` on an ``mmap``
  at the same offsets; medians of 15 rounds.
* MiniLM: ``minilm.load(scheme, cache, tokenizer=...)`` from a warm cache (the tokenizer is loaded
  before, outside the timed call, as for the baseline), against safetensors' zero-copy open of the
  same source: ``safe_open(path, framework="pt")`` and ``get_tensor`` of every tensor. In the same
  launches: the first ``embed`` of one sentence after the load (what a service's first request pays;
  the kernel self-check and first kernel calls land there), and ``smaps_rollup()["Anonymous"]`` after
  the load minus before it (``gc.collect()`` and ``malloc_trim`` before each reading), as a share of
  the mapped bytes. Schemes fp32, bf16, int8, int4 on this machine's default kernel path.
* Fingerprints: the first ``fingerprint()`` in a process of each quantising packer (int8, int4 with
  its activation-aware search), after ``import torch`` and the packers module.

``--src DIR`` runs every child with ``PYTHONPATH=DIR`` (e.g. a worktree of an older commit's ``src``):
the same measurements of another version of packcache, for before/after figures.

Usage: python benchmarks/warm.py [--repeat N] [--src DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import core  # noqa: E402  (benchmarks/core.py: quartiles, cpu_model)

CORE_PACKS, CORE_PACK_BYTES = 1000, 16 << 10
SCHEMES = ("fp32", "bf16", "int8", "int4")
SENTENCE = "A warm launch maps its weights."


# ------------------------------------------------------------------ children (one measurement each)


def _collect() -> None:
    import gc

    gc.collect()


def child_core(spec: dict[str, Any]) -> dict[str, Any]:
    import mmap

    import numpy as np

    import packcache

    path, method = spec["path"], spec["method"]
    names = [f"layers.{i}.weight" for i in range(CORE_PACKS)]
    layout = spec["layout"]
    mapping = {"packer": "copy", "version": 1}

    def never() -> Any:
        raise AssertionError("a warm load must not pack")

    _collect()
    started = time.perf_counter()
    if method == "limit":
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        views = [np.frombuffer(mm, dtype=np.int8, count=n, offset=o) for o, n in layout]
    elif method == "get_or_pack":
        cache = packcache.WeightCache(path)
        with cache.session() as s:
            views = [s.get_or_pack(name, never, mapping) for name in names]
        cache.close()
    else:
        key = packcache.PackKey(mapping)
        cache = packcache.WeightCache(path)
        with cache.session() as s:
            views = s.get_many([(name, never, key) for name in names])
        cache.close()
    seconds = time.perf_counter() - started
    assert len(views) == CORE_PACKS
    return {"seconds": seconds}


def child_hit(spec: dict[str, Any]) -> dict[str, Any]:
    import mmap

    import numpy as np

    import packcache

    path, layout, rounds = spec["path"], spec["layout"], spec["rounds"]
    names = [f"layers.{i}.weight" for i in range(CORE_PACKS)]
    mapping = {"packer": "copy", "version": 1}
    many = hasattr(packcache, "PackKey")

    def never() -> Any:
        raise AssertionError("a warm load must not pack")

    out: dict[str, list[float]] = {"frombuffer": [], "get_or_pack": [], "get_many": []}
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    for _ in range(rounds):
        _collect()
        started = time.perf_counter()
        for o, n in layout:
            np.frombuffer(mm, dtype=np.int8, count=n, offset=o)
        out["frombuffer"].append((time.perf_counter() - started) / CORE_PACKS)
        for method in ("get_or_pack", "get_many") if many else ("get_or_pack",):
            cache = packcache.WeightCache(path)
            with cache.session() as s:
                _collect()
                if method == "get_many":
                    requests = [(name, never, packcache.PackKey(mapping)) for name in names]
                    started = time.perf_counter()
                    s.get_many(requests)
                else:
                    started = time.perf_counter()
                    for name in names:
                        s.get_or_pack(name, never, mapping)
                out[method].append((time.perf_counter() - started) / CORE_PACKS)
            assert cache.stats().hits == CORE_PACKS
            cache.close()
    return {k: statistics.median(v) for k, v in out.items() if v}


def child_minilm(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from packcache.memory import release_free_heap, smaps_rollup
    from packcache.models import minilm

    torch.set_num_threads(2)
    tokenizer = minilm.load_tokenizer()
    if spec["method"] == "safetensors":
        from safetensors import safe_open

        source = str(minilm.default_model_path() / "model.safetensors")
        _collect()
        started = time.perf_counter()
        with safe_open(source, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        seconds = time.perf_counter() - started
        assert tensors
        return {"seconds": seconds}
    _collect()
    release_free_heap()
    before = smaps_rollup()["Anonymous"]
    started = time.perf_counter()
    model = minilm.load(spec["scheme"], cache=spec["path"], tokenizer=tokenizer)
    seconds = time.perf_counter() - started
    _collect()
    release_free_heap()
    growth = smaps_rollup()["Anonymous"] - before
    stats = model.cache.stats()
    assert (stats.state, stats.heap_bytes) == ("mapped", 0), stats
    started = time.perf_counter()
    model.embed([SENTENCE])
    first = time.perf_counter() - started
    return {
        "seconds": seconds, "first_embed_s": first, "anon_growth": growth, "mapped_bytes": stats.mapped_bytes,
        "kernel_path": model.kernel_path,
    }  # fmt: skip


def child_fingerprint(spec: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: F401  (imported before the timed call, as a load imports it)

    from packcache import packers_torch

    packer = {"int8": packers_torch.Int8WeightOnly, "int4": packers_torch.Int4WeightOnly}[spec["scheme"]]()
    _collect()
    started = time.perf_counter()
    packer.fingerprint()
    return {"seconds": time.perf_counter() - started}


CHILDREN = {"core": child_core, "hit": child_hit, "minilm": child_minilm, "fingerprint": child_fingerprint}


def launch(kind: str, spec: dict[str, Any], src: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(spec)], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ------------------------------------------------------------------ the parent


def summary(samples: list[float]) -> dict[str, float]:
    q1, median, q3 = core.quartiles(samples) if len(samples) > 1 else (samples[0],) * 3
    return {"median_s": median, "q1_s": q1, "q3_s": q3}


def prepare(directory: str, src: str | None) -> dict[str, Any]:
    """Build every cache file once (cold launches, not timed) and read every file once (page cache warm)."""
    code = f"""
import sys, os
sys.path.insert(0, {HERE!r})
import core, packcache
from packcache.models import minilm
packs = core.make_packs({CORE_PACKS}, {CORE_PACKS * CORE_PACK_BYTES})
path = os.path.join({directory!r}, "core.pcache")
core.build(path, packs)
tokenizer = minilm.load_tokenizer()
for scheme in {SCHEMES!r}:
    minilm.load(scheme, cache=os.path.join({directory!r}, scheme + ".pcache"), tokenizer=tokenizer).close()
print(__import__("json").dumps(core.committed_layout(path)))
"""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    layout = json.loads(done.stdout.strip().splitlines()[-1])
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            while f.read(1 << 24):
                pass
    return {"core": os.path.join(directory, "core.pcache"), "layout": layout}


def interleaved(methods: dict[str, tuple[str, dict[str, Any]]], repeat: int, src: str | None) -> dict[str, list[Any]]:
    runs: dict[str, list[Any]] = {name: [] for name in methods}
    names = list(methods)
    for round_ in range(repeat):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            kind, spec = methods[name]
            runs[name].append(launch(kind, spec, src))
    return runs


def run(directory: str, repeat: int, src: str | None) -> dict[str, Any]:
    files = prepare(directory, src)
    has_many = "get_many" in subprocess.run(
        [sys.executable, "-c", "import packcache; print('get_many' if hasattr(packcache, 'PackKey') else '')"],
        capture_output=True, text=True, env={**os.environ, **({"PYTHONPATH": src} if src else {})}, check=True,
    ).stdout  # fmt: skip
    results: dict[str, Any] = {}
    core_spec = {"path": files["core"], "layout": files["layout"]}
    methods = {"limit": ("core", {**core_spec, "method": "limit"}),
               "get_or_pack": ("core", {**core_spec, "method": "get_or_pack"})}  # fmt: skip
    if has_many:
        methods["get_many"] = ("core", {**core_spec, "method": "get_many"})
    runs = interleaved(methods, repeat, src)
    limit = statistics.median(r["seconds"] for r in runs["limit"])
    results["core"] = {
        name: {**summary([r["seconds"] for r in found]), "ratio_to_limit": statistics.median(
            r["seconds"] for r in found) / limit}
        for name, found in runs.items()
    }  # fmt: skip
    hit = launch("hit", {**core_spec, "rounds": 15}, src)
    results["hit"] = {
        **hit,
        **{f"{k}_over_frombuffer": v / hit["frombuffer"] for k, v in hit.items() if k != "frombuffer"},
    }
    minilm_methods: dict[str, tuple[str, dict[str, Any]]] = {"safetensors": ("minilm", {"method": "safetensors"})}
    for scheme in SCHEMES:
        minilm_methods[scheme] = ("minilm", {"method": "packcache", "scheme": scheme,
                                             "path": os.path.join(directory, f"{scheme}.pcache")})  # fmt: skip
    runs = interleaved(minilm_methods, repeat, src)
    base = statistics.median(r["seconds"] for r in runs["safetensors"])
    results["minilm"] = {"safetensors": summary([r["seconds"] for r in runs["safetensors"]])}
    for scheme in SCHEMES:
        found = runs[scheme]
        load = statistics.median(r["seconds"] for r in found)
        growth = [r["anon_growth"] for r in found]
        results["minilm"][scheme] = {
            **summary([r["seconds"] for r in found]),
            "ratio_to_safetensors": load / base,
            "first_embed_median_s": statistics.median(r["first_embed_s"] for r in found),
            "load_plus_first_median_s": statistics.median(r["seconds"] + r["first_embed_s"] for r in found),
            "anon_growth_median": statistics.median(growth),
            "anon_growth_max": max(growth),
            "anon_pct_of_mapped_max": 100 * max(growth) / found[0]["mapped_bytes"],
            "mapped_bytes": found[0]["mapped_bytes"],
            "kernel_path": found[0]["kernel_path"],
        }
    fp = interleaved({s: ("fingerprint", {"scheme": s}) for s in ("int8", "int4")}, repeat, src)
    results["fingerprint"] = {s: summary([r["seconds"] for r in found]) for s, found in fp.items()}
    return results


def print_results(results: dict[str, Any]) -> None:
    def ms(s: dict[str, float]) -> str:
        return f"{s['median_s'] * 1e3:.2f} ms ({s['q1_s'] * 1e3:.2f}-{s['q3_s'] * 1e3:.2f})"

    print(f"\ncore: new cache + session + {CORE_PACKS} hits of {CORE_PACK_BYTES >> 10} KiB, fresh process")
    for name, row in results["core"].items():
        print(f"  {name:12s} {ms(row)}  {row['ratio_to_limit']:.2f}x the limit")
    hit = results["hit"]
    print(f"hit inside a session: frombuffer {hit['frombuffer'] * 1e6:.2f} us; " + ", ".join(
        f"{k} {hit[k] * 1e6:.2f} us ({hit[k + '_over_frombuffer']:.2f}x)" for k in ("get_or_pack", "get_many")
        if k in hit))  # fmt: skip
    print("minilm.load warm vs safetensors zero-copy open, fresh process")
    print(f"  safetensors  {ms(results['minilm']['safetensors'])}")
    for scheme in SCHEMES:
        row = results["minilm"][scheme]
        print(f"  {scheme:12s} {ms(row)}  {row['ratio_to_safetensors']:.2f}x; first embed "
              f"{row['first_embed_median_s'] * 1e3:.1f} ms; Anonymous +{row['anon_growth_median'] / 1024:.0f} KiB "
              f"(max {row['anon_pct_of_mapped_max']:.2f} % of {row['mapped_bytes'] / 2**20:.1f} MiB mapped); "
              f"path {row['kernel_path']}")  # fmt: skip
    for scheme, row in results["fingerprint"].items():
        print(f"first {scheme} fingerprint: {ms(row)}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--src", help="run the children with PYTHONPATH=SRC (another version of packcache)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    print(__doc__.split("Usage:")[0])
    machine = {"cpu": core.cpu_model(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
               "src": args.src or "this checkout", "loadavg_start": os.getloadavg()[0]}  # fmt: skip
    print(json.dumps(machine))
    with tempfile.TemporaryDirectory(prefix="packcache-warm-") as directory:
        results = run(directory, args.repeat, args.src)
    machine["loadavg_end"] = os.getloadavg()[0]
    print_results(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
