"""What the background check of a served cache file costs serving, and how long it takes (``server.filecheck``).

Method (printed first when run). One ``packcache serve`` of the bundled all-MiniLM-L6-v2 int8 from a warm cache
file (``--workers W --torch-threads 1``), its own background check finished before the first window. ``--clients C``
clients each send ``POST /embed`` of 8 texts back to back on a kept-alive connection. Windows of ``--seconds S``
alternate, round by round, between three conditions:

* ``idle``: nothing else runs;
* ``checker``: the server's own checker (``filecheck.start_check``: a fresh interpreter at nice 19 reading at most
  64 MiB/s) checks the served file again and again for the whole window: the cost while a check runs (a server
  runs it once, after its load);
* ``unmanaged``: ``packcache.verify(FILE)`` in a fresh interpreter, again and again, at normal priority and
  unpaced: what the check would cost without its priority and pace.

Each figure is the median over ``--rounds`` windows: requests/s, and p50/p99 of the request latency. Then the
check's own duration on the file: from ``start_check`` to the checker's exit (interpreter start included), the
reading alone (the verdict's ``finished - started``) and the checker's CPU seconds, medians of 5 runs (the server
still running, idle).

Usage: python benchmarks/filecheck.py [--workers W] [--clients C] [--seconds S] [--rounds R] [--json FILE]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))
TEXTS = [f"sentence number {i} about the river, the city and the light" for i in range(8)]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _serve(directory: Path, workers: int) -> tuple[subprocess.Popen[bytes], int, Path]:
    log = directory / "serve.log"
    argv = [
        sys.executable, "-m", "packcache", "serve", "--port", "0", "--workers", str(workers), "--torch-threads", "1",
        "--cache-dir", str(directory / "cache"), "--scheme", "int8",
    ]  # fmt: skip
    with open(log, "wb") as out:
        # In this process's session: the checkers this benchmark starts then share the server's scheduling group
        # (autogroup), as a worker's checker does, and nice 19 ranks them below the workers as it does there.
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env())
    deadline = time.monotonic() + 300
    port = 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text())
        if found and not port:
            port = int(found.group(1))
        if port and log.read_text().count("passed its checksum check") >= 1:
            status, body = _get(port, "/healthz")
            if status == 200 and json.loads(body).get("file_check") == "passed":
                return proc, port, log
        time.sleep(0.2)
    raise RuntimeError(f"the server did not get ready: {log.read_text()[-2000:]}")


def _clients(port: int, count: int, seconds: float) -> tuple[float, float, float]:
    """Requests/s, p50 and p99 (ms) of ``count`` clients over ``seconds``."""
    body = json.dumps({"texts": TEXTS}).encode()
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine = []
        while time.perf_counter() < stop:
            started = time.perf_counter()
            conn.request("POST", "/embed", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            assert response.status == 200, response.status
            mine.append(time.perf_counter() - started)
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(count)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    latencies.sort()
    return len(latencies) / wall, latencies[len(latencies) // 2] * 1000, latencies[int(len(latencies) * 0.99)] * 1000


class _Background:
    """Runs one kind of check again and again in a thread until stopped; counts the runs."""

    def __init__(self, kind: str, file: str, directory: int) -> None:
        self.kind, self.file, self.directory = kind, file, directory
        self.runs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Background:
        if self.kind != "idle":
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        from packcache.server.filecheck import clear_checks, start_check

        while not self._stop.is_set():
            if self.kind == "checker":
                clear_checks(self.directory)
                process = start_check(self.file, self.directory).process
                assert process is not None
                process.wait()
            else:
                subprocess.run(
                    [sys.executable, "-c", "import sys, packcache; assert packcache.verify(sys.argv[1]).ok", self.file],
                    check=True, env=_env(),
                )  # fmt: skip
            self.runs += 1


def _check_duration(file: str, directory: int, runs: int = 5) -> tuple[float, float, float]:
    """Median seconds from ``start_check`` to the checker's exit, of the reading alone, and the checker's CPU
    seconds (user + system, its interpreter start included)."""
    import resource

    from packcache.server.filecheck import clear_checks, start_check

    whole, reading, cpu = [], [], []
    for _ in range(runs):
        clear_checks(directory)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        checker = start_check(file, directory)
        assert checker.process is not None
        checker.process.wait()
        whole.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        time.sleep(0.3)  # past the worker view's re-read interval
        verdict = checker.current()
        assert verdict.state == "passed", verdict
        reading.append(verdict.finished - verdict.started)
    return statistics.median(whole), statistics.median(reading), statistics.median(cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    print(__doc__.split("Usage:")[0].strip(), end="\n\n")
    with tempfile.TemporaryDirectory(prefix="packcache-filecheck-bench-") as tmp:
        directory = Path(tmp)
        (directory / "cache").mkdir(mode=0o700)
        built = subprocess.run(
            [sys.executable, "-m", "packcache", "run", "--cache-dir", str(directory / "cache"), "--scheme", "int8",
             "--json"], capture_output=True, text=True, check=True, env=_env(),
        )  # fmt: skip
        file = json.loads(built.stdout)["cache_file"]
        status_dir = directory / "status"
        status_dir.mkdir(mode=0o700)
        status_fd = os.open(status_dir, os.O_RDONLY | os.O_DIRECTORY)
        proc, port, log = _serve(directory, args.workers)
        results: dict[str, list[tuple[float, float, float]]] = {"idle": [], "checker": [], "unmanaged": []}
        runs: dict[str, int] = dict.fromkeys(results, 0)
        try:
            _clients(port, args.clients, 2.0)  # warm-up
            for _ in range(args.rounds):
                for kind in results:
                    with _Background(kind, file, status_fd) as background:
                        results[kind].append(_clients(port, args.clients, args.seconds))
                    runs[kind] += background.runs
            whole, reading, cpu = _check_duration(file, status_fd)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            os.close(status_fd)
        size = os.path.getsize(file)
        summary: dict[str, Any] = {
            "file_bytes": size, "check_seconds": whole, "check_reading_seconds": reading, "check_cpu_seconds": cpu,
        }  # fmt: skip
        print(f"file: {size / 1e6:.1f} MB; {args.workers} workers, {args.clients} clients, "
              f"{args.rounds} rounds of {args.seconds:g} s windows")  # fmt: skip
        base = statistics.median(r[0] for r in results["idle"])
        for kind, figures in results.items():
            rps = statistics.median(r[0] for r in figures)
            p50 = statistics.median(r[1] for r in figures)
            p99 = statistics.median(r[2] for r in figures)
            summary[kind] = {"requests_per_second": rps, "p50_ms": p50, "p99_ms": p99, "checks_run": runs[kind]}
            print(f"{kind:>9}: {rps:6.1f} req/s ({rps / base:5.1%} of idle), p50 {p50:6.1f} ms, p99 {p99:6.1f} ms, "
                  f"{runs[kind]} checks run")  # fmt: skip
        print(f"the check of the file: {whole:.2f} s from start_check to the checker's exit, {reading:.2f} s reading, "
              f"{cpu:.2f} CPU s")  # fmt: skip
        print(f"the server's own check: {[line for line in log.read_text().splitlines() if 'checksum check' in line]}")
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
