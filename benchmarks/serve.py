"""Multi-worker server: ``packcache serve`` with batching, without it (as before), and sentence-transformers.

Method (printed first when run):

* Servers: ``python -m packcache serve`` (gunicorn, ``preload_app`` off, serve's own worker: an
  event loop reads each whole request before the application runs) with 2 workers (``--workers``),
  for three configurations in the same server shape: ``packcache`` (MiniLM, scheme int8, this
  machine's default kernel path, weights mapped from a cache file; concurrent requests in a worker
  merged into one forward, serve's defaults ``--max-batch-tokens 16384 --batch-wait 0.001``),
  ``packcache-unbatched`` (the same with ``--max-batch-tokens 0``: one forward per request and a
  worker accepting only while idle, the server as it was before batching) and
  ``sentence-transformers`` (``--engine sentence-transformers``: ``SentenceTransformer(<the same model
  dir>)``, float32, every weight on each worker's heap, batching as ``packcache``).
  ``packcache-sync`` (gunicorn's ``sync`` worker: a slow client holds it) can be added with
  ``--engines``. Torch threads per worker: serve's default, the CPUs divided among the workers (at
  least 1). Each packcache server has its own copy of one cache file built beforehand by
  ``packcache run`` (a prebuilt cache, as docs/DEPLOY.md deploys it), so every worker starts warm.
  All servers are started first, then measured in rounds, the order of the configurations
  rotating each round, so drift hits all alike.
* Load: a closed loop of 1, 8 and 32 client threads (``--clients``) in this process, each on its own
  kept-alive connection (as the openai client and TEI clients keep theirs), sending ``POST /embed``
  with 8 texts (``{"texts": [...]}``) and waiting for the whole response before sending the next;
  a connection the server closed is opened again. The texts are ``benchmarks/inference.py``'s 64
  deterministic sentences of 6 to 48 words, taken 8 at a time in order. Before the first round every
  server answers 4 requests per client at each client count (warm-up: first forwards, page faults,
  connections). A measurement window is a fixed number of requests per client count (``--requests``;
  default 100, 300, 600; ``--quick`` 60, 120, 240): requests/s = requests / wall time of the window,
  texts/s = 8 x requests/s; latency = client-side time from sending a request to the last byte of its
  response, p50 and p99 over the window. Figures are the median over the rounds (3; ``--quick`` 2),
  with min-max. Ratios: ``packcache`` over ``packcache-unbatched`` ("vs unbatched") and every
  configuration over ``sentence-transformers`` ("vs ST"), at the same client count. Each server's
  ``/metrics`` gives the texts per forward during the rounds (``packcache_forward_texts``).
* Stalled clients (``--stalled``, 50; 0 skips it), after the rounds, for ``packcache`` and
  ``packcache-unbatched``: that many clients each send the headers and 13 bytes of a 1000-byte body and
  stall, then 8 closed-loop clients send 40 requests with a 5 s client timeout; answered requests,
  failures, p50 and p99 of the answered. The stalled clients are closed afterwards.
* The client runs on the same machine as the server and takes CPU from it (it reads each response but
  does not parse it during the window); 2 workers on 2 cores leave the client none of its own.
* Quality: the 64 texts in the same 8-text requests, packcache int8 against sentence-transformers
  fp32: cosine per text, min and mean.
* Memory, after the warm-up: per worker, ``Pss`` and ``Anonymous`` of ``/proc/<pid>/smaps_rollup``
  (median over the workers of a server), and for packcache the PSS of the cache file's mapping.
  Startup: from spawning the server to every worker reporting its model loaded on ``/metrics``,
  and the workers' own ``packcache_load_seconds`` (median).

Usage: python benchmarks/serve.py [--quick] [--json FILE] [--plot FILE] [--clients 1,8,32] [--workers N]
       [--engines A,B] [--stalled N] [--requests N]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import inference  # noqa: E402  (benchmarks/inference.py: bench_texts, cpu_report)

SRC = str(Path(HERE).parent / "src")
ENGINES = ("sentence-transformers", "packcache-unbatched", "packcache", "packcache-sync")
DEFAULT_ENGINES = ("sentence-transformers", "packcache-unbatched", "packcache")
#: packcache-sync: serve with gunicorn's sync worker (a benchmark baseline only:
#: serve itself has no switch for it, since a slow client can hold a sync worker until it is killed).
_SYNC = (
    "import sys; import packcache.server.worker as w; w.worker_class = lambda limits, batching=None: 'sync'; "
    "from packcache.cli import main; sys.exit(main(sys.argv[1:]))"
)
CLIENTS = (1, 8, 32)
#: Requests per measurement window by client count (full, quick).
REQUESTS = {1: (100, 60), 8: (300, 120), 32: (600, 240)}
BATCH = 8
GOAL_THROUGHPUT = 2.0  # packcache over packcache-unbatched at the most clients


@dataclass
class Server:
    engine: str
    workers: int
    proc: subprocess.Popen[bytes]
    log: Path
    port: int = 0
    started: float = 0.0
    ready_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.engine} x{self.workers}"

    def pids(self) -> list[int]:
        text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        return sorted(int(p) for p in text.split())


def start(engine: str, workers: int, directory: Path, cache_file: Path) -> Server:
    args = ["--engine", "packcache" if engine.startswith("packcache") else engine]
    if engine.startswith("packcache"):
        cache_dir = directory / f"cache-{engine}-{workers}"
        cache_dir.mkdir(mode=0o700)
        shutil.copy2(cache_file, cache_dir / cache_file.name)
        args += ["--cache-dir", str(cache_dir), "--scheme", "int8"]
    if engine == "packcache-unbatched":
        args += ["--max-batch-tokens", "0"]
    log = directory / f"{engine}-{workers}.log"
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with open(log, "wb") as out:
        launcher = ["-c", _SYNC] if engine == "packcache-sync" else ["-m", "packcache"]
        proc = subprocess.Popen(
            [sys.executable, *launcher, "serve", "--port", "0", "--workers", str(workers), *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
    return Server(engine, workers, proc, log, started=time.perf_counter())


def wait_ready(server: Server, timeout: float = 180.0) -> None:
    """Until the server listens and every worker's model is loaded (its gauges are on /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.label} exited: {server.log.read_text()[-2000:]}")
        if not server.port:
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", server.log.read_text())
            server.port = int(found.group(1)) if found else 0
        if server.port:
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, body = request(server.port, "GET", "/metrics")
                text = body.decode()
                pids = set(re.findall(r'^packcache_worker_info\{[^}]*pid="(\d+)"', text, re.M))
                if status == 200 and len(pids) == server.workers:
                    server.ready_s = time.perf_counter() - server.started
                    loads = [float(v) for v in re.findall(r"^packcache_load_seconds\{[^}]*\} (\S+)", text, re.M)]
                    states = re.findall(r'^packcache_state\{[^}]*state="(\w+)"[^}]*\} 1\.0', text, re.M)
                    server.info = {"load_seconds_median": float(np.median(loads)), "states": sorted(states)}
                    return
        time.sleep(0.1)
    raise RuntimeError(f"{server.label} not ready within {timeout} s: {server.log.read_text()[-2000:]}")


def stop(server: Server) -> None:
    with contextlib.suppress(ProcessLookupError):
        server.proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)


def request(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 300) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def bodies(texts: list[str]) -> list[bytes]:
    return [json.dumps({"texts": texts[i : i + BATCH]}).encode() for i in range(0, len(texts), BATCH)]


def load(
    port: int, payloads: list[bytes], requests: int, clients: int, timeout: float = 300, tolerate: bool = False
) -> dict[str, Any]:
    """A closed loop: ``clients`` threads, each on a kept-alive connection, send ``requests`` requests in all.

    ``tolerate``: count failed requests (``failed``) instead of raising."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    sent = [0]

    def client() -> None:
        conn: http.client.HTTPConnection | None = None
        try:
            while True:
                with lock:
                    index = sent[0]
                    if index >= requests:
                        return
                    sent[0] += 1
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
                began = time.perf_counter()
                try:
                    conn.request(
                        "POST", "/embed", payloads[index % len(payloads)], {"Content-Type": "application/json"}
                    )
                    response = conn.getresponse()
                    response.read()
                    status = response.status
                    if response.will_close:
                        conn.close()
                        conn = None
                except (OSError, http.client.HTTPException) as exc:
                    status = 0
                    if conn is not None:
                        conn.close()
                    conn = None
                    failure = repr(exc)
                elapsed = time.perf_counter() - began
                with lock:
                    if status == 200:
                        latencies.append(elapsed)
                    else:
                        failures.append(str(status) if status else failure)
        finally:
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    if failures and not tolerate:
        raise RuntimeError(f"{len(failures)} requests failed: {failures[:5]}")
    ordered = sorted(latencies) or [float("nan")]
    return {
        "requests": requests,
        "answered": len(latencies),
        "failed": len(failures),
        "wall_s": wall,
        "requests_per_s": requests / wall,
        "texts_per_s": requests * BATCH / wall,
        "p50_s": float(np.percentile(ordered, 50)),
        "p99_s": float(np.percentile(ordered, 99)),
    }


def forwards(server: Server) -> tuple[float, float]:
    """(forwards, texts) the server's workers ran so far, from ``/metrics`` (zeros without the batching metrics)."""
    text = request(server.port, "GET", "/metrics")[1].decode()
    count = sum(float(v) for v in re.findall(r"^packcache_forward_texts_count\{[^}]*\} (\S+)", text, re.M))
    total = sum(float(v) for v in re.findall(r"^packcache_forward_texts_sum\{[^}]*\} (\S+)", text, re.M))
    return count, total


def stalled_phase(server: Server, payloads: list[bytes], stalled: int, clients: int) -> dict[str, Any]:
    """The closed loop while ``stalled`` clients hold a half-sent body each (closed afterwards)."""
    head = b"POST /embed HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    held = []
    try:
        for _ in range(stalled):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(head + b'{"texts": ["a')
            held.append(sock)
        time.sleep(0.5)
        return load(server.port, payloads, 40, clients, timeout=5, tolerate=True) | {"stalled": stalled}
    finally:
        for sock in held:
            sock.close()


def memory(server: Server, cache_dir: Path | None) -> dict[str, float]:
    from packcache.memory import file_mapping_usage, smaps_rollup

    rows = []
    for pid in server.pids():
        roll = smaps_rollup(pid)
        mapping = 0
        if cache_dir is not None:
            for f in cache_dir.glob("*.pcache"):
                mapping += file_mapping_usage(f, pid).pss
        rows.append((roll["Pss"], roll["Anonymous"], mapping))
    mib = float(1 << 20)
    return {
        "pss_mib": float(np.median([r[0] for r in rows])) / mib,
        "anonymous_mib": float(np.median([r[1] for r in rows])) / mib,
        "cache_mapping_pss_mib": float(np.median([r[2] for r in rows])) / mib,
    }


def quality(packcache: Server, baseline: Server, payloads: list[bytes]) -> dict[str, float]:
    cosines: list[float] = []
    for body in payloads:
        a = np.asarray(json.loads(request(packcache.port, "POST", "/embed", body)[1])["embeddings"], np.float64)
        b = np.asarray(json.loads(request(baseline.port, "POST", "/embed", body)[1])["embeddings"], np.float64)
        cosines += list((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))
    return {"min_cosine": float(min(cosines)), "mean_cosine": float(np.mean(cosines)), "texts": len(cosines)}


def run(
    directory: str,
    quick: bool,
    clients: tuple[int, ...] = CLIENTS,
    requests: int | None = None,
    engines: tuple[str, ...] = DEFAULT_ENGINES,
    stalled: int = 50,
    workers: int = 2,
) -> list[dict[str, Any]]:
    """Every measurement of this file, in ``directory``: one result dict, a row per configuration and client count."""
    from packcache.server import worker_threads

    rounds = 2 if quick else 3

    def window(count: int) -> int:
        return requests or REQUESTS.get(count, (max(100, 20 * count), max(60, 8 * count)))[1 if quick else 0]

    work = Path(directory) / "serve-bench"
    work.mkdir()
    texts = inference.bench_texts()
    payloads = bodies(texts)
    load_before = os.getloadavg()
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONWARNINGS": "ignore"}
    built = subprocess.run(
        [sys.executable, "-m", "packcache", "run", "--cache-dir", str(work / "prebuilt"), "--scheme", "int8", "--json"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    cache_file = Path(json.loads(built.stdout)["cache_file"])
    servers: dict[str, Server] = {}
    try:
        for engine in engines:
            servers[engine] = start(engine, workers, work, cache_file)
        for server in servers.values():
            wait_ready(server)
            print(f"  {server.label}: ready in {server.ready_s:.2f} s {server.info}", flush=True)
        for server in servers.values():  # warm-up: every worker runs its first forwards
            for count in clients:
                load(server.port, payloads, 4 * count, count)
        mem = {
            engine: memory(s, work / f"cache-{engine}-{workers}" if engine.startswith("packcache") else None)
            for engine, s in servers.items()
        }
        samples: dict[tuple[str, int], list[dict[str, Any]]] = {(e, c): [] for e in servers for c in clients}
        order = list(servers)
        for round_ in range(rounds):
            rotated = order[round_ % len(order) :] + order[: round_ % len(order)]
            for count in clients:
                for engine in rotated:
                    before = forwards(servers[engine])
                    r = load(servers[engine].port, payloads, window(count), count)
                    after = forwards(servers[engine])
                    r["texts_per_forward"] = (after[1] - before[1]) / max(1.0, after[0] - before[0])
                    samples[(engine, count)].append(r)
                    print(
                        f"  round {round_ + 1}/{rounds} {engine}, {count} clients: {r['requests_per_s']:.1f} req/s, "
                        f"p50 {r['p50_s'] * 1e3:.1f} ms, p99 {r['p99_s'] * 1e3:.1f} ms, "
                        f"{r['texts_per_forward']:.1f} texts/forward",
                        flush=True,
                    )
        under_stall = {}
        for engine in ("packcache", "packcache-unbatched"):
            if stalled and engine in servers:
                r = under_stall[engine] = stalled_phase(servers[engine], payloads, stalled, 8)
                print(f"  {stalled} stalled clients, {engine}: {r['answered']}/{r['requests']} answered, "
                      f"p50 {r['p50_s'] * 1e3:.1f} ms, p99 {r['p99_s'] * 1e3:.1f} ms", flush=True)  # fmt: skip
        q = {}
        if "packcache" in servers and "sentence-transformers" in servers:
            q = quality(servers["packcache"], servers["sentence-transformers"], payloads)
        infos = {engine: s.info | {"ready_s": s.ready_s} for engine, s in servers.items()}
    finally:
        for server in servers.values():
            stop(server)
    rows = []
    for (engine, count), found in samples.items():
        rps = [s["requests_per_s"] for s in found]
        p50 = [s["p50_s"] for s in found]
        p99 = [s["p99_s"] for s in found]
        rows.append({
            "engine": engine, "clients": count, "workers": workers, "torch_threads": worker_threads(workers),
            "requests_per_s": float(np.median(rps)), "requests_per_s_min": min(rps), "requests_per_s_max": max(rps),
            "texts_per_s": float(np.median(rps)) * BATCH,
            "p50_ms": float(np.median(p50)) * 1e3, "p50_ms_min": min(p50) * 1e3, "p50_ms_max": max(p50) * 1e3,
            "p99_ms": float(np.median(p99)) * 1e3, "p99_ms_min": min(p99) * 1e3, "p99_ms_max": max(p99) * 1e3,
            "texts_per_forward": float(np.median([s["texts_per_forward"] for s in found])),
            **mem[engine], **infos[engine], "rounds": found,
        })  # fmt: skip
    for row in rows:
        for key, engine in (("st", "sentence-transformers"), ("unbatched", "packcache-unbatched")):
            base = next((r for r in rows if r["engine"] == engine and r["clients"] == row["clients"]), None)
            if base is None or base is row or (key == "unbatched" and row["engine"] != "packcache"):
                continue
            row[f"throughput_vs_{key}"] = row["requests_per_s"] / base["requests_per_s"]
            row[f"p50_vs_{key}"] = row["p50_ms"] / base["p50_ms"]
            row[f"p99_vs_{key}"] = row["p99_ms"] / base["p99_ms"]
    from packcache.kernels import cpu_kernels

    goals = {}
    by = {(r["engine"], r["clients"]): r for r in rows}
    if ("packcache", max(clients)) in by and ("packcache-unbatched", max(clients)) in by:
        most, least = by[("packcache", max(clients))], by[("packcache", min(clients))]
        goals = {
            f"throughput_x{GOAL_THROUGHPUT:g}_at_{max(clients)}_clients": most["throughput_vs_unbatched"]
            >= GOAL_THROUGHPUT,
            f"p99_no_worse_at_{min(clients)}_client": least["p99_vs_unbatched"] <= 1.0,
        }
    return [
        {
            "workload": f"multi-worker server, {workers} workers: {BATCH} texts per request, closed-loop clients on "
            f"kept-alive connections, {rounds} rounds",
            "clients": list(clients),
            "workers": workers,
            "requests_per_window": {c: window(c) for c in clients},
            "rounds": rounds,
            "kernel_path": cpu_kernels().default_path,
            "cpus": len(os.sched_getaffinity(0)),
            "rows": sorted(rows, key=lambda r: (r["clients"], engines.index(r["engine"]))),
            "quality": q,
            "stalled": under_stall,
            "goals": goals,
            "load_average": [list(load_before), list(os.getloadavg())],
        }
    ]


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def print_results(results: list[dict[str, Any]]) -> None:
    for r in results:
        print(f"\n{r['workload']} (kernel path {r['kernel_path']}, {r['cpus']} CPUs)")
        print("| clients | engine | requests/s (min-max) | texts/s | vs unbatched | vs ST | p50 ms (min-max) "
              "| vs unbatched | p99 ms (min-max) | vs unbatched | vs ST | texts/forward |")  # fmt: skip
        print("|" + "---|" * 12)
        for row in r["rows"]:
            print(
                f"| {row['clients']} | {row['engine']} "
                f"| {row['requests_per_s']:.1f} ({row['requests_per_s_min']:.1f}-{row['requests_per_s_max']:.1f}) "
                f"| {row['texts_per_s']:.0f} | {_ratio(row, 'throughput_vs_unbatched')} "
                f"| {_ratio(row, 'throughput_vs_st')} "
                f"| {row['p50_ms']:.1f} ({row['p50_ms_min']:.1f}-{row['p50_ms_max']:.1f}) "
                f"| {_ratio(row, 'p50_vs_unbatched')} "
                f"| {row['p99_ms']:.1f} ({row['p99_ms_min']:.1f}-{row['p99_ms_max']:.1f}) "
                f"| {_ratio(row, 'p99_vs_unbatched')} | {_ratio(row, 'p99_vs_st')} | {row['texts_per_forward']:.1f} |"
            )
        print("\n| engine | torch threads | PSS/worker MiB | Anonymous/worker MiB | ready s |")
        print("|---|---|---|---|---|")
        seen = set()
        for row in r["rows"]:
            if row["engine"] not in seen:
                seen.add(row["engine"])
                print(f"| {row['engine']} | {row['torch_threads']} | {row['pss_mib']:.1f} | {row['anonymous_mib']:.1f} "
                      f"| {row['ready_s']:.2f} |")  # fmt: skip
        for engine, s in r["stalled"].items():
            print(f"{s['stalled']} stalled clients, {engine} with {r['workers']} workers: {s['answered']} of "
                  f"{s['requests']} requests answered ({s['failed']} failed, 5 s client timeout), "
                  f"p50 {s['p50_s'] * 1e3:.1f} ms, p99 {s['p99_s'] * 1e3:.1f} ms")  # fmt: skip
        q = r["quality"]
        if q:
            print(f"quality: packcache int8 vs sentence-transformers fp32 on {q['texts']} texts: "
                  f"min cosine {q['min_cosine']:.5f}, mean {q['mean_cosine']:.5f}")  # fmt: skip
        for goal, met in r["goals"].items():
            print(f"goal {goal}: {'met' if met else 'NOT met'}")
        print(f"load average before {r['load_average'][0]}, after {r['load_average'][1]}")


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (r,) = results
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = {
        "packcache": "packcache int8, batching",
        "packcache-unbatched": "packcache int8, one forward per request",
        "packcache-sync": "packcache int8, sync worker",
        "sentence-transformers": "sentence-transformers fp32, batching",
    }
    styles = {"packcache": ("C0", "o"), "packcache-unbatched": ("C2", "^"), "packcache-sync": ("C3", "v"),
              "sentence-transformers": ("C1", "s")}  # fmt: skip
    for engine, (color, marker) in styles.items():
        rows = [row for row in r["rows"] if row["engine"] == engine]
        if not rows:
            continue
        clients = [row["clients"] for row in rows]
        label = labels[engine]
        left.errorbar(
            clients, [row["texts_per_s"] for row in rows], color=color, marker=marker, capsize=3, label=label,
            yerr=[[BATCH * (row["requests_per_s"] - row["requests_per_s_min"]) for row in rows],
                  [BATCH * (row["requests_per_s_max"] - row["requests_per_s"]) for row in rows]],
        )  # fmt: skip
        right.plot(clients, [row["p50_ms"] for row in rows], color=color, marker=marker, label=f"{label}, p50")
        right.plot(clients, [row["p99_ms"] for row in rows], color=color, marker=marker, ls="--", label=f"{label}, p99")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(r["clients"], [str(c) for c in r["clients"]])
        axis.set_ylim(bottom=0)
    left.set(xlabel="concurrent clients", ylabel="texts/s (8 per request)", title="throughput (median, min-max)")
    right.set(xlabel="concurrent clients", ylabel="latency, ms", title="latency")
    right.set_yscale("log")
    left.legend(fontsize=7)
    right.legend(fontsize=6)
    fig.suptitle(f"packcache serve, {r['workers']} workers on {r['cpus']} CPUs ({inference.core.cpu_model()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter windows (60, 120, 240 requests), 2 rounds")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--plot", default=os.path.join(HERE, "..", "docs", "serve_throughput.png"), help="the plot")
    parser.add_argument("--clients", default="1,8,32", help="comma-separated client counts (default 1,8,32)")
    parser.add_argument("--workers", type=int, default=2, help="workers per server (default 2)")
    parser.add_argument("--requests", type=int, help="requests per measurement window, at every client count")
    parser.add_argument(
        "--engines", default=",".join(DEFAULT_ENGINES),
        help=f"comma-separated, of {', '.join(ENGINES)} (default: {','.join(DEFAULT_ENGINES)})",
    )  # fmt: skip
    parser.add_argument(
        "--stalled", type=int, default=50, help="stalled clients in the last phase (default 50; 0: none)"
    )
    args = parser.parse_args()
    engines = tuple(e for e in ENGINES if e in args.engines.split(","))
    if not engines or set(args.engines.split(",")) - set(ENGINES):
        parser.error(f"--engines: choose from {', '.join(ENGINES)}")
    try:
        clients = tuple(sorted({int(c) for c in args.clients.split(",")}))
    except ValueError:
        parser.error("--clients: comma-separated positive integers")
    if not clients or min(clients) < 1:
        parser.error("--clients: comma-separated positive integers")
    # SIGTERM unwinds like Ctrl-C, so run()'s finally stops the servers (each in its own session).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    began = time.perf_counter()
    print(__doc__.split("Usage:")[0].strip())
    print(f"\ncpu: {inference.cpu_report()}")
    with tempfile.TemporaryDirectory(prefix="packcache-serve-bench-") as d:
        results = run(d, args.quick, clients, args.requests, engines, args.stalled, args.workers)
    print_results(results)
    elapsed = time.perf_counter() - began
    if args.json:  # before the plot: a missing matplotlib must not lose the figures
        with open(args.json, "w") as f:
            json.dump({"cpu": inference.cpu_report(), "elapsed_s": elapsed, "results": results}, f, indent=2)
    try:
        plot(results, args.plot)
        shown = os.path.abspath(args.plot)
    except ModuleNotFoundError as exc:
        shown = f"not drawn ({exc.name} is missing: bash scripts/bench.sh installs the bench extra)"
    print(f"\ntotal {elapsed:.1f} s; plot {shown}")


if __name__ == "__main__":
    main()
