"""Content identity: what naming a safetensors source by its sha256 costs a launch.

Method (printed first when run):

* Launches: one fresh Python subprocess per launch (``python -c CHILD SPEC``), 2 torch threads
  (``torch.set_num_threads`` and ``OMP_NUM_THREADS``). Not timed: interpreter start, the imports of
  torch and packcache (from the tree under test, put first on ``sys.path``; the child reports
  ``packcache.__file__`` and stops if it is not under that tree), and for the Llama ``packcache.hf``,
  transformers and the model class named by ``config.json``. Timed (``time.perf_counter``) is only
  the load call, scheme int8, with an explicit cache file: ``minilm.load("int8", cache=FILE,
  model_path=DIR)`` or ``hf.from_pretrained(DIR, "int8", cache=FILE, auto_class="AutoModelForCausalLM")``.
  In the new tree the child wraps ``packcache.identity._hash`` (files hashed and their bytes) and
  ``packcache.safetensors.file_digest`` (time spent finding digests, and how each was found) before
  loading. Each child reports the cache's state, stores, hits and heap bytes, and exits non-zero
  unless the launch reached the state its scenario must reach (``mapped``: heap bytes 0) and, in the
  new tree, hashed exactly the files it must (each shard once, or none): the run stops. The child's
  CPU time of the load (``time.process_time``, all threads) is reported beside the wall time.
  ``PACKCACHE_*`` variables are removed from the children's environment; ``PACKCACHE_DIGEST_DIR``
  is set per launch. ``HF_HUB_OFFLINE=1``: nothing is downloaded. The parent calls ``os.sync()``
  right before every launch, so no writeback of earlier steps' files lands in a timed load.
* Models, made in a temp directory (removed at the end): a copy of the bundled all-MiniLM-L6-v2
  checkpoint (``copytree`` with ``copy2``: its own inodes; float32, one shard) and a random Llama
  (hidden 2048, intermediate 5632, ``--big-layers`` layers (default 6: float32 checkpoint >= 1.2 GB;
  ``--quick``: 2, below 1 GB), 16 heads, 4 KV heads, vocab 32000, untied head), seeded
  ``AutoModelForCausalLM.from_config`` and ``save_pretrained`` (float32 safetensors, one shard).
  Before any launch every checkpoint file's last change is older than ``identity.RACY_SECONDS`` +
  0.1 s, so digests can be recorded; the temp directory's filesystem must be one of
  ``identity.RELIABLE_FILESYSTEMS``.
* Scenarios, new tree, per model; before them one build launch (state ``stored``) writes the cache
  file, which is set aside as the pristine copy, and records the digests in a digest dir kept for
  ``warm``:
  - ``repack``: no cache file, a fresh empty digest dir: hash + pack + store (state ``stored``).
    So that every launch follows the same disk writes, the pristine file is copied (and fsynced) to
    a decoy path before it, removed after it.
  - ``first launch``: the pristine cache file copied into place (and fsynced) before the launch, a
    fresh empty digest dir: every shard hashed, then mapped (state ``mapped``). What a machine pays
    the first time it opens a cache that was shipped to it or built from another copy.
  - ``warm``: the pristine cache file copied in alike, the digest dir of the build: ``mapped``,
    0 files hashed.
  Page cache: "warm" = the parent reads every shard right before the launch; "cold" = each shard
  ``fsync``ed and dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` right before the launch (the
  resident bytes left are checked with ``fincore`` when it is installed). ``repack`` and ``first
  launch`` run both ways, ``warm`` page cache warm only. Only the checkpoint is dropped: the cache
  file (just copied) and the libraries stay in the page cache. Right before each scenario launch
  the parent calls ``os.sync()`` and then stays idle 5 s (``REST_S``), so every launch finds the
  disk alike (without it, on a virtual disk, a cold read's speed depended on what the launch
  before had done). Each round runs every scenario once, the order rotated per round; figures are
  medians with quartiles over the rounds; ratios are of medians: first launch / repack (what a
  shipped cache saves when every digest must be computed) and warm / first launch.
* sha256 throughput: the parent hashes the checkpoint with ``hashlib.sha256`` in 1 MiB ``preadv``s,
  page cache warm, median of 3 (and, for reference, page cache cold after 5 s idle, median of 3).
* Before/after (warm launch: goal new <= old + 1 ms): the tree before this change
  (``--baseline-tree``) and this tree, each with its own cache file built by its own cold launch
  (the new tree's digests recorded by it), then warm launches alternating old/new (the order
  swapped every round), page cache warm, ``--rounds`` x 3 launches each; medians with quartiles,
  and new - old.

Absolute times drift on a shared machine (another job may be running): ratios are of medians
measured in the same run, and the 1-minute load average is recorded at the start and end of
every step. "Page cache cold" means this kernel's page cache: on a virtual disk the reads may still
be served from the host's cache, or slowed by its rate limiter; those figures are of this machine's disk.

Usage: python benchmarks/identity.py [--rounds N] [--quick] [--json FILE] [--baseline-tree PATH]
       [--big-layers N]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from typing import Any

# Nothing may come from a hub: every model is a local directory (set before anything imports huggingface_hub).
os.environ["HF_HUB_OFFLINE"] = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
NEW_TREE = os.path.join(os.path.dirname(HERE), "src")
DEFAULT_BASELINE = "/tmp/base/src"
sys.path.insert(0, HERE)
sys.path.insert(1, NEW_TREE)  # the parent reads RACY_SECONDS etc. from this tree, whatever is installed
import core  # noqa: E402  (benchmarks/core.py: quartiles, cpu_model)

THREADS = 2
SCHEME = "int8"
CAUSAL = "AutoModelForCausalLM"
WARM_GOAL_MS = 1.0  # new warm launch <= old warm launch + this
CHUNK = 1 << 20
REST_S = 5.0  # idle before each scenario launch (and cold sha256 read): every one finds the disk alike
LLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 4,
         "vocab_size": 32000}  # fmt: skip
# (scenario, page cache) in the order of round 0; later rounds rotate it.
SCENARIOS = (("repack", "warm"), ("repack", "cold"), ("first launch", "warm"), ("first launch", "cold"),
             ("warm", "warm"))  # fmt: skip
EXPECT = {"repack": "stored", "first launch": "mapped", "warm": "mapped"}

# The measuring child: ``python -c CHILD SPEC_JSON``; its last stdout line is its JSON result.
CHILD = r"""
import json, os, sys, time

spec = json.loads(sys.argv[1])
tree = os.path.realpath(spec["tree"])
sys.path.insert(0, tree)
import torch

torch.set_num_threads(spec["threads"])
import packcache

where = os.path.realpath(packcache.__file__)
if not where.startswith(tree + os.sep):
    sys.exit(f"packcache was imported from {where}, not from {tree}")
hashed, digest_s, hows = [], [0.0], []
if spec["count_hashes"]:
    from packcache import identity, safetensors as st_module

    inner_hash, inner_digest = identity._hash, st_module.file_digest

    def counting_hash(fd, path, st):
        hashed.append([os.path.realpath(path), st.st_size])
        return inner_hash(fd, path, st)

    def timed_digest(*args, **kwargs):
        started = time.perf_counter()
        try:
            found = inner_digest(*args, **kwargs)
        finally:
            digest_s[0] += time.perf_counter() - started
        hows.append(found.how)
        return found

    identity._hash, st_module.file_digest = counting_hash, timed_digest
if spec["model"] == "minilm":
    from packcache.models import minilm

    def load():
        return minilm.load(spec["scheme"], cache=spec["cache"], model_path=spec["path"])

    def cache_of(model):
        return model.cache
else:
    import transformers
    from packcache import hf

    with open(os.path.join(spec["path"], "config.json")) as f:
        getattr(transformers, json.load(f)["architectures"][0])  # the modeling module's import: not timed

    def load():
        return hf.from_pretrained(spec["path"], spec["scheme"], cache=spec["cache"], auto_class=spec["auto"])

    def cache_of(model):
        return model.packcache
started, cpu_started = time.perf_counter(), time.process_time()
model = load()
load_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
stats = cache_of(model).stats()
out = {"load_ms": load_s * 1e3, "cpu_ms": cpu_s * 1e3, "state": stats.state, "stored": stats.stored, "hits": stats.hits,
       "heap_bytes": stats.heap_bytes, "mapped_bytes": stats.mapped_bytes, "packcache_file": where,
       "threads": torch.get_num_threads()}
if spec["count_hashes"]:
    out.update(hashed_files=len(hashed), hashed_bytes=sum(size for _, size in hashed), hashed=hashed,
               digest_ms=digest_s[0] * 1e3, digest_how=hows)
print(json.dumps(out), flush=True)
problems = []
if stats.state != spec["expect"]:
    problems.append(f"state {stats.state!r}, expected {spec['expect']!r}")
if spec["expect"] == "mapped" and stats.heap_bytes != 0:
    problems.append(f"heap_bytes {stats.heap_bytes} on a mapped launch")
if spec["expect_hashed"] is not None and sorted(p for p, _ in hashed) != sorted(spec["expect_hashed"]):
    problems.append(f"hashed {hashed}, expected exactly {spec['expect_hashed']}")
if problems:
    sys.exit(f"{spec['label']}: " + "; ".join(problems) + f"\nstats: {stats}")
"""

# Writes the random Llama (a child, so the parent never holds a 1.6 GB model).
GENERATE = r"""
import json, os, sys, time

spec = json.loads(sys.argv[1])
import torch
import transformers

torch.set_num_threads(spec["threads"])
started = time.perf_counter()
config = transformers.LlamaConfig(**spec["config"], bos_token_id=1, eos_token_id=2, max_position_embeddings=2048,
                                  tie_word_embeddings=False)
torch.manual_seed(spec["seed"])
model = transformers.AutoModelForCausalLM.from_config(config)
params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
model.save_pretrained(spec["path"], max_shard_size="16GB")
print(json.dumps({"params": params, "class": type(model).__name__, "dtype": str(next(model.parameters()).dtype),
                  "seconds": time.perf_counter() - started}), flush=True)
"""


def summary(samples: list[float]) -> dict[str, float]:
    q1, med, q3 = core.quartiles(samples) if len(samples) > 1 else (samples[0],) * 3
    return {"median": med, "q1": q1, "q3": q3, "n": len(samples)}


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def fmt_ms(s: dict[str, float]) -> str:
    return f"{s['median']:.1f} ms ({s['q1']:.1f}-{s['q3']:.1f})"


# ---------------------------------------------------------------- files and the page cache


def shards(directory: str) -> list[str]:
    found = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors file in {directory}")
    return [os.path.realpath(p) for p in found]


def settle(directories: list[str]) -> float:
    """Wait until every file under ``directories`` last changed more than ``RACY_SECONDS`` + 0.1 s ago
    (younger files are hashed and not recorded); returns the seconds waited."""
    from packcache import identity

    began = time.monotonic()
    while True:
        newest = max(max(st.st_mtime_ns, st.st_ctime_ns) for d in directories for st in map(os.stat, _files(d)))
        wait = (identity.RACY_SECONDS + 0.1) - (time.time_ns() - newest) / 1e9
        if wait <= 0:
            return time.monotonic() - began
        time.sleep(wait + 0.01)


def _files(directory: str) -> list[str]:
    return [os.path.join(r, n) for r, _, names in os.walk(directory) for n in names]


def read_pages(paths: list[str]) -> None:
    """Bring every page of ``paths`` into the page cache (read through, discarded)."""
    buffer = bytearray(CHUNK)
    with memoryview(buffer) as view:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                offset = 0
                while got := os.preadv(fd, [view], offset):
                    offset += got
            finally:
                os.close(fd)


def resident_bytes(paths: list[str]) -> int | None:
    """Bytes of ``paths`` in the page cache (``fincore``), or None when it cannot be asked."""
    if shutil.which("fincore") is None:
        return None
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *paths], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        return sum(int(line.strip()) for line in out.splitlines() if line.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def copy_synced(source: str, target: str) -> None:
    """Copy a cache file into place and make it durable, so no writeback of it lands in a timed launch."""
    shutil.copy2(source, target)
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(os.path.dirname(target), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def empty(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def sha256_seconds(paths: list[str]) -> float:
    """Wall time of ``hashlib.sha256`` over ``paths`` in 1 MiB ``preadv``s (as ``identity._hash`` reads)."""
    buffer = bytearray(CHUNK)
    started = time.perf_counter()
    with memoryview(buffer) as view:
        for path in paths:
            digest = hashlib.sha256()
            fd = os.open(path, os.O_RDONLY)
            try:
                offset = 0
                while got := os.preadv(fd, [view], offset):
                    digest.update(view[:got])
                    offset += got
            finally:
                os.close(fd)
            digest.hexdigest()
    return time.perf_counter() - started


def bench_sha256(paths: list[str], repeat: int = 3) -> dict[str, Any]:
    size = sum(os.path.getsize(p) for p in paths)
    read_pages(paths)
    warm = [sha256_seconds(paths) for _ in range(repeat)]
    cold = []
    for _ in range(repeat):
        core.drop_pages(paths)
        os.sync()
        time.sleep(REST_S)
        cold.append(sha256_seconds(paths))
    read_pages(paths)
    return {"bytes": size, "warm_s": warm, "cold_s": cold, "warm_gb_per_s": size / core.quartiles(warm)[1] / 1e9,
            "cold_gb_per_s": size / core.quartiles(cold)[1] / 1e9}  # fmt: skip


# ---------------------------------------------------------------- launches


def child_env(tree: str, digests: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACKCACHE_")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(THREADS), PYTHONWARNINGS="ignore", PYTHONPATH=tree,
               TOKENIZERS_PARALLELISM="false", PACKCACHE_DIGEST_DIR=digests)  # fmt: skip
    return env


def launch(
    model: dict[str, Any],
    tree: str,
    cache: str,
    digests: str,
    expect: str,
    label: str,
    hashes: bool = True,
    rest: float = 0.0,
) -> dict[str, Any]:
    """One measured launch, which must reach state ``expect``; in the new tree the files hashed must be
    exactly the shards (``hashes``) or none. ``label`` names the launch in a failure. ``rest``: seconds
    idle between the ``os.sync()`` and the launch."""
    new = tree == NEW_TREE
    expect_hashed = (model["shards"] if hashes else []) if new else None
    spec = {"tree": tree, "threads": THREADS, "model": model["kind"], "path": model["path"], "cache": cache,
            "scheme": SCHEME, "auto": CAUSAL, "expect": expect, "expect_hashed": expect_hashed, "count_hashes": new,
            "label": f"{model['label']} {label}"}  # fmt: skip
    argv = [sys.executable, "-c", CHILD, json.dumps(spec)]
    os.sync()  # no writeback of earlier steps' files may land in the timed load
    time.sleep(rest)
    load_1min = loadavg()
    proc = subprocess.run(argv, capture_output=True, text=True, env=child_env(tree, digests), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"identity.py: launch {spec['label']} failed (exit {proc.returncode}); the run stops.\n"
                           f"spec: {spec}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-4000:]}")  # fmt: skip
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load_average_1min"] = load_1min
    return result


def generate(path: str, layers: int) -> dict[str, Any]:
    spec = {"config": {**LLAMA, "num_hidden_layers": layers}, "path": path, "seed": 0, "threads": THREADS}
    proc = subprocess.run([sys.executable, "-c", GENERATE, json.dumps(spec)], capture_output=True, text=True,
                          env=child_env(NEW_TREE, os.devnull), check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"identity.py: generating the Llama failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    made: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return made


def models(directory: str, big_layers: int, quick: bool) -> list[dict[str, Any]]:
    from packcache.models import minilm

    bundled = str(minilm.default_model_path())
    copy = os.path.join(directory, "minilm")
    shutil.copytree(bundled, copy, copy_function=shutil.copy2)
    out: list[dict[str, Any]] = [{"label": "minilm", "kind": "minilm", "path": copy,
                                  "what": f"all-MiniLM-L6-v2, a copy2 copy of {bundled}"}]  # fmt: skip
    llama = os.path.join(directory, "llama")
    made = generate(llama, big_layers)
    shape = (f"hidden {LLAMA['hidden_size']}, intermediate {LLAMA['intermediate_size']}, {big_layers} layers, "
             f"{LLAMA['num_attention_heads']} heads, {LLAMA['num_key_value_heads']} KV heads, "
             f"vocab {LLAMA['vocab_size']}, untied head")  # fmt: skip
    out.append({"label": "llama", "kind": "hf", "path": llama, "params": made["params"],
                "what": f"random Llama ({shape}), {made['class']}, {made['params'] / 1e6:.1f} M params, "
                        f"{made['dtype']}", "generate_s": made["seconds"]})  # fmt: skip
    for m in out:
        m["shards"] = shards(m["path"])
        m["checkpoint_bytes"] = sum(os.path.getsize(p) for p in m["shards"])
    os.sync()  # the checkpoints are on disk before anything is measured
    big = out[-1]["checkpoint_bytes"]
    if not quick and big < 1 << 30:
        print(f"NOTE: the big checkpoint is {big / 1e9:.2f} GB, below 1 GiB (--big-layers {big_layers})", flush=True)
    return out


# ---------------------------------------------------------------- the measurements


def bench_scenarios(model: dict[str, Any], directory: str, rounds: int) -> dict[str, Any]:
    """The build launch, then ``rounds`` rounds of every scenario (order rotated), new tree."""
    before, began = loadavg(), time.perf_counter()
    base = os.path.join(directory, f"scenarios-{model['label']}")
    cache_dir = os.path.join(base, "cache")
    os.makedirs(cache_dir, mode=0o700)
    cache = os.path.join(cache_dir, f"{model['label']}-{SCHEME}.pcache")
    pristine, decoy = os.path.join(base, "pristine.pcache"), os.path.join(base, "decoy.pcache")
    warm_digests = tempfile.mkdtemp(prefix="digests-warm-", dir=base)
    read_pages(model["shards"])
    build = launch(model, NEW_TREE, cache, warm_digests, "stored", "build")
    left = sorted(os.listdir(cache_dir))
    os.replace(cache, pristine)
    records = sorted(n for n in os.listdir(warm_digests) if n.endswith(".json"))
    sha = bench_sha256(model["shards"])
    runs: dict[str, list[dict[str, Any]]] = {f"{s}|{p}": [] for s, p in SCENARIOS}
    for round_ in range(rounds):
        k = round_ % len(SCENARIOS)
        for scenario, pages in SCENARIOS[k:] + SCENARIOS[:k]:
            empty(cache_dir)
            # Every launch follows the same disk writes: repack's copy goes to a decoy, removed after the
            # launch (on a rate-limited virtual disk, reads right after a write are slower).
            copy_synced(pristine, decoy if scenario == "repack" else cache)
            digests = warm_digests if scenario == "warm" else tempfile.mkdtemp(prefix="digests-", dir=base)
            resident = None
            if pages == "cold":
                core.drop_pages(model["shards"])
                resident = resident_bytes(model["shards"])
            else:
                read_pages(model["shards"])
            label = f"{scenario}, page cache {pages}"
            found = launch(model, NEW_TREE, cache, digests, EXPECT[scenario], label, scenario != "warm", REST_S)
            found.update(round=round_, resident_before=resident)
            runs[f"{scenario}|{pages}"].append(found)
            if digests != warm_digests:
                shutil.rmtree(digests)
            if scenario == "repack":
                os.unlink(decoy)
    empty(cache_dir)
    figures = {key: summary([r["load_ms"] for r in found]) for key, found in runs.items()}

    def med(key: str) -> float:
        return figures[key]["median"]

    ratios = {
        "first launch / repack, page cache warm": med("first launch|warm") / med("repack|warm"),
        "first launch / repack, page cache cold": med("first launch|cold") / med("repack|cold"),
        "warm / first launch, page cache warm": med("warm|warm") / med("first launch|warm"),
    }
    cold_resident = [r["resident_before"] for found in runs.values() for r in found if r["resident_before"] is not None]
    return {
        "model": model["label"],
        "what": model["what"],
        "checkpoint_bytes": model["checkpoint_bytes"],
        "shards": [os.path.basename(p) for p in model["shards"]],
        "cache_bytes": os.path.getsize(pristine),
        "build": build,
        "cache_dir_after_build": left,
        "digest_records_after_build": records,
        "sha256": sha,
        "rounds": rounds,
        "load_ms": figures,
        "digest_ms": {key: summary([r["digest_ms"] for r in found]) for key, found in runs.items()},
        "cpu_ms": {key: summary([r["cpu_ms"] for r in found]) for key, found in runs.items()},
        "hashed_files": {key: sorted({r["hashed_files"] for r in found}) for key, found in runs.items()},
        "hashed_bytes": {key: sorted({r["hashed_bytes"] for r in found}) for key, found in runs.items()},
        "digest_how": {key: sorted({h for r in found for h in r["digest_how"]}) for key, found in runs.items()},
        "states": {key: sorted({r["state"] for r in found}) for key, found in runs.items()},
        "ratios": ratios,
        "first_minus_warm_ms": med("first launch|warm") - med("warm|warm"),
        "hash_ms_predicted": model["checkpoint_bytes"] / (sha["warm_gb_per_s"] * 1e9) * 1e3,
        "cold_resident_max_bytes": max(cold_resident) if cold_resident else None,
        "runs": runs,
        "seconds": time.perf_counter() - began,
        "load_average_1min": [before, loadavg()],
    }


def bench_before_after(model: dict[str, Any], directory: str, baseline: str, launches: int) -> dict[str, Any]:
    """Warm launches of the old tree and the new tree, alternating, each on its own cache file."""
    before, began = loadavg(), time.perf_counter()
    base = os.path.join(directory, f"before-after-{model['label']}")
    os.makedirs(base, mode=0o700)
    trees = {"old": baseline, "new": NEW_TREE}
    caches = {side: os.path.join(base, side, f"{model['label']}-{SCHEME}.pcache") for side in trees}
    digests = {side: tempfile.mkdtemp(prefix=f"digests-{side}-", dir=base) for side in trees}
    cold = {}
    for side, tree in trees.items():
        os.makedirs(os.path.dirname(caches[side]), mode=0o700)
        read_pages(model["shards"])
        cold[side] = launch(model, tree, caches[side], digests[side], "stored", f"{side} tree, cold")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in trees}
    for i in range(launches):
        for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
            read_pages(model["shards"])
            found = launch(model, trees[side], caches[side], digests[side], "mapped", f"warm, {side} tree", False)
            runs[side].append(found)
    figures = {side: summary([r["load_ms"] for r in found]) for side, found in runs.items()}
    diff = figures["new"]["median"] - figures["old"]["median"]
    return {
        "model": model["label"],
        "trees": trees,
        "packcache_files": {side: sorted({r["packcache_file"] for r in found}) for side, found in runs.items()},
        "cold_ms": {side: cold[side]["load_ms"] for side in trees},
        "load_ms": figures,
        "new_digest_ms": summary([r["digest_ms"] for r in runs["new"]]),
        "new_digest_how": sorted({h for r in runs["new"] for h in r["digest_how"]}),
        "new_hashed_files": sorted({r["hashed_files"] for r in runs["new"]}),
        "new_minus_old_ms": diff,
        "within_goal": diff <= WARM_GOAL_MS,
        "launches_each": launches,
        "runs": runs,
        "seconds": time.perf_counter() - began,
        "load_average_1min": [before, loadavg()],
    }


# ---------------------------------------------------------------- report


def machine(directory: str) -> dict[str, Any]:
    import torch

    from packcache import identity
    from packcache.kernels import cpu_kernels

    flags: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fs = identity._statfs_type(fd)
    finally:
        os.close(fd)
    kernels = cpu_kernels()
    return {
        "cpu": core.cpu_model(),
        "cpu_count": os.cpu_count(),
        "sha_ni": "sha_ni" in flags,
        "openssl": ssl.OPENSSL_VERSION,
        "kernels": kernels.flags(),
        "default_kernel_path": kernels.default_path,
        "torch_threads": THREADS,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "linux": platform.release(),
        "temp_dir": directory,
        "temp_fs": f"0x{fs:x} {identity.RELIABLE_FILESYSTEMS.get(fs, 'NOT RELIABLE')}" if fs is not None else "?",
        "racy_seconds": identity.RACY_SECONDS,
    }


def print_scenarios(r: dict[str, Any], quick: bool) -> None:
    gb = r["checkpoint_bytes"] / 1e9
    note = " (--quick: below 1 GB)" if quick and r["model"] != "minilm" else ""
    print(f"\n{r['model']}: {r['what']}")
    print(f"  checkpoint: {r['checkpoint_bytes']:,} bytes = {gb:.3f} GB{note} in {len(r['shards'])} shard(s) "
          f"{r['shards']}; int8 cache file {r['cache_bytes']:,} bytes")  # fmt: skip
    b = r["build"]
    print(f"  build launch: {b['load_ms']:.0f} ms, state {b['state']}, stored {b['stored']}, hashed "
          f"{b['hashed_files']} file(s); digest records written: {len(r['digest_records_after_build'])}; "
          f"cache dir after build: {r['cache_dir_after_build']}")  # fmt: skip
    s = r["sha256"]
    print(f"  raw sha256 (hashlib, 1 MiB preads): page cache warm {s['warm_gb_per_s']:.2f} GB/s (median of "
          f"{len(s['warm_s'])}); page cache cold {s['cold_gb_per_s']:.2f} GB/s")  # fmt: skip
    print(f"  {r['rounds']} rounds, load average before/after {r['load_average_1min']}, {r['seconds']:.0f} s")
    print("  | scenario | page cache | load, median (q1-q3) | of which finding digests | CPU time of the load "
          "| files hashed | bytes hashed | how digests were found | state |")  # fmt: skip
    print("  |" + "---|" * 9)
    for scenario, pages in SCENARIOS:
        key = f"{scenario}|{pages}"
        print(f"  | {scenario} | {pages} | {fmt_ms(r['load_ms'][key])} | {fmt_ms(r['digest_ms'][key])} | "
              f"{fmt_ms(r['cpu_ms'][key])} | {r['hashed_files'][key]} | {r['hashed_bytes'][key]} | "
              f"{', '.join(r['digest_how'][key])} | {', '.join(r['states'][key])} |")  # fmt: skip
    for what, value in r["ratios"].items():
        print(f"  ratio {what}: {value:.3f}")
    print(f"  first launch - warm (page cache warm): {r['first_minus_warm_ms']:.1f} ms; the checkpoint at the raw "
          f"sha256 rate: {r['hash_ms_predicted']:.1f} ms")  # fmt: skip
    resident = r["cold_resident_max_bytes"]
    if resident is None:
        print("  page cache drop: not checked (no fincore)")
    else:
        print(f"  page cache drop: at most {resident:,} bytes ({100 * resident / r['checkpoint_bytes']:.2f} %) of the "
              "checkpoint resident before a 'cold' launch (fincore)")  # fmt: skip


def print_before_after(results: list[dict[str, Any]]) -> None:
    print(f"\nbefore/after: warm launch, old tree vs new tree; goal new - old <= {WARM_GOAL_MS:g} ms")
    print("| model | old, median (q1-q3) | new, median (q1-q3) | new - old | goal | new: finding digests | new: how "
          "| launches each | load average |")  # fmt: skip
    print("|" + "---|" * 9)
    for r in results:
        verdict = "met" if r["within_goal"] else "MISSED"
        print(f"| {r['model']} | {fmt_ms(r['load_ms']['old'])} | {fmt_ms(r['load_ms']['new'])} | "
              f"{r['new_minus_old_ms']:+.2f} ms | {verdict} | {fmt_ms(r['new_digest_ms'])} | "
              f"{', '.join(r['new_digest_how'])} | {r['launches_each']} | {r['load_average_1min']} |")  # fmt: skip
    for r in results:
        print(f"  {r['model']}: packcache imported from {r['packcache_files']}; cold builds {r['cold_ms']['old']:.0f} "
              f"ms (old), {r['cold_ms']['new']:.0f} ms (new)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, help="rounds of the scenarios (default 5, --quick 3); the "
                        "before/after runs 3x as many launches of each tree")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a 2-layer Llama (below 1 GB), 3 rounds")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--baseline-tree", default=DEFAULT_BASELINE if os.path.isdir(DEFAULT_BASELINE) else None,
                        help=f"the src directory of the tree before the change (default {DEFAULT_BASELINE} if it "
                        "exists); without one the before/after section is skipped")  # fmt: skip
    parser.add_argument("--big-layers", type=int, help="layers of the random Llama (default 6, --quick 2)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    layers = args.big_layers or (2 if args.quick else 6)
    baseline = os.path.realpath(args.baseline_tree) if args.baseline_tree else None
    skipped = None
    if baseline is None:
        skipped = f"no baseline tree ({DEFAULT_BASELINE} does not exist and --baseline-tree was not given)"
    elif not os.path.isfile(os.path.join(baseline, "packcache", "__init__.py")):
        skipped = f"the baseline tree {baseline} has no packcache/__init__.py"
    began, load_start = time.perf_counter(), os.getloadavg()
    print(__doc__.split("Usage:")[0].strip())
    if skipped:
        print(f"\n{'!' * 100}\n!!! BEFORE/AFTER SECTION SKIPPED: {skipped}\n{'!' * 100}", flush=True)
    with tempfile.TemporaryDirectory(prefix="packcache-identity-") as d:
        info = machine(d)
        print(f"\nmachine: {info}\nnew tree: {NEW_TREE}; baseline tree: {baseline or 'NONE'}")
        print(f"1/5/15-min load average at start: {load_start}", flush=True)
        found = models(d, layers, args.quick)
        waited = settle([m["path"] for m in found])
        for m in found:
            extra = f", generated in {m['generate_s']:.0f} s" if "generate_s" in m else ""
            print(f"model {m['label']}: {m['what']}; checkpoint {m['checkpoint_bytes']:,} bytes "
                  f"({m['checkpoint_bytes'] / 1e9:.3f} GB){extra}", flush=True)  # fmt: skip
        print(f"waited {waited:.1f} s for every checkpoint file to be older than RACY_SECONDS + 0.1 s", flush=True)
        scenarios = []
        for m in found:
            scenarios.append(bench_scenarios(m, d, rounds))
            print_scenarios(scenarios[-1], args.quick)
            sys.stdout.flush()
        before_after = []
        if baseline is not None and not skipped:
            for m in found:
                before_after.append(bench_before_after(m, d, baseline, rounds * 3))
            print_before_after(before_after)
    if skipped:
        print(f"\n{'!' * 100}\n!!! BEFORE/AFTER SECTION SKIPPED: {skipped}\n{'!' * 100}")
    load_end, elapsed = os.getloadavg(), time.perf_counter() - began
    print(f"\n1/5/15-min load average at end: {load_end}; total {elapsed:.1f} s")
    if args.json:
        info.update(load_average_start=list(load_start), load_average_end=list(load_end))
        with open(args.json, "w") as f:
            json.dump({"quick": args.quick, "rounds": rounds, "big_layers": layers, "machine": info,
                       "baseline_tree": baseline, "before_after_skipped": skipped, "elapsed_s": elapsed,
                       "scenarios": scenarios, "before_after": before_after}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
