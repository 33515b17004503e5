"""``packcache serve`` run the way it is deployed, for the tests: a real server in a child process, its
HTTP API, its Prometheus scrape, and the kernel's word on who holds a connection.

Every server is a ``python -m packcache serve --port 0`` child in its own session, with a hard
deadline (a watchdog kills its process group) and stopped in ``finally`` (SIGTERM, then SIGKILL
to the group). Workers run one torch thread each (``--torch-threads 1``): several workers on a
2-core machine would otherwise oversubscribe it, and one thread everywhere makes the embeddings
of every worker and of the in-process reference (the ``reference`` fixture of tests/conftest.py)
the same computation.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import packcache

SRC = Path(packcache.__file__).resolve().parents[1]
REASONS = [r.value for r in packcache.HeapReason]
STATES = [s.value for s in packcache.CacheState]
SERVER_DEADLINE = 120.0  # seconds a server may live before its watchdog kills it
TEXTS = [
    "packcache maps packed weights instead of packing them on every launch.",
    "A fallback to heap is reported in bytes, per reason, with the errno.",
    "The weather is nice today.",
    "Where is the nearest train station?",
    "She opened the window and looked outside.",
    "int main() { return 0; }",
    "",
    "Researchers measured the growth of plants under different light conditions over twelve weeks.",
]

WORDS = ("the", "river", "city", "light", "market", "engine", "forest", "paper", "story", "answer", "bridge", "garden")


def long(count: int, chars: int) -> list[str]:
    """``count`` different texts of ``chars`` characters (each well over the 256 tokens kept)."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(chars // 4))[:chars] for i in range(count)]


# ---------------------------------------------------------------- a server in a child process


@dataclass
class Server:
    """One ``packcache serve`` child: its master pid, its address, its logs."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    tmp: Path
    url: str = ""
    watchdog: threading.Timer | None = None
    killed_by_watchdog: list[bool] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.out.read_text().splitlines():
                if line.startswith("packcache serve: listening on "):
                    self.url = line.rsplit(" ", 1)[1]
                    return
            assert self.proc.poll() is None, f"the server exited {self.proc.returncode}: {self.log()}"
            time.sleep(0.05)
        raise AssertionError(f"the server did not listen within {timeout} s: {self.log()}")

    def log(self) -> str:
        return self.err.read_text()[-4000:]

    def workers(self) -> list[int]:
        """The master's live children, from /proc (not from the server's own word)."""
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
            return sorted(int(p) for p in text.split())
        return []

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the master, then SIGKILL the whole group if it lingers; the master's exit code."""
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # the workers too, whatever the master did
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return self.proc.returncode


@contextlib.contextmanager
def server(
    tmp: Path, *args: str, workers: int, name: str = "server", wrapper: tuple[str, ...] = ()
) -> Iterator[Server]:
    """Start ``packcache serve --port 0 --workers N ARGS`` and stop it on exit, whatever happened.

    ``wrapper`` is put before the command (``("prlimit", "--nofile=160", "--")``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    (tmp / f"{name}-tmp").mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "TMPDIR": str(tmp / f"{name}-tmp"),  # the private metrics directory goes here
        "PYTHONWARNINGS": "ignore",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [sys.executable, "-m", "packcache", "serve", "--port", "0", "--workers", str(workers)]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [*wrapper, *argv, "--torch-threads", "1", "--scheme", "int8", *args],  # ARGS may override (the last wins)
            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
    srv = Server(proc, out, err, tmp / f"{name}-tmp")

    def kill() -> None:
        srv.killed_by_watchdog.append(True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    srv.watchdog = threading.Timer(SERVER_DEADLINE, kill)
    srv.watchdog.daemon = True
    srv.watchdog.start()
    try:
        srv.wait_listening()
        yield srv
    finally:
        srv.stop()
        assert not srv.killed_by_watchdog, f"the server outlived its {SERVER_DEADLINE} s deadline"


# ---------------------------------------------------------------- HTTP and scrapes


def call(srv: Server, method: str, path: str, body: bytes | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    """(status, headers and body) of one request; never raises for an HTTP error status."""
    request = urllib.request.Request(srv.url + path, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, (dict(response.headers), response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, (dict(exc.headers), exc.read())


def embed(srv: Server, texts: list[str], timeout: float = 60.0) -> tuple[int, list[list[float]]]:
    """(worker pid, embeddings) of one ``POST /embed``; fails the test on any other status."""
    status, (headers, body) = call(srv, "POST", "/embed", json.dumps({"texts": texts}).encode(), timeout)
    assert status == 200, (status, body[:300])
    embeddings: list[list[float]] = json.loads(body)["embeddings"]
    return int(headers["X-Packcache-Worker"]), embeddings


@dataclass
class Worker:
    """One worker's packcache figures, as the scrape shows them."""

    pid: int
    info: dict[str, str] = field(default_factory=dict)
    state: dict[str, float] = field(default_factory=dict)
    heap_reason: dict[str, float] = field(default_factory=dict)
    heap_bytes: dict[str, float] = field(default_factory=dict)
    packs: dict[str, float] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)

    @property
    def current_state(self) -> str:
        (on,) = [s for s, v in self.state.items() if v == 1]
        return on

    @property
    def current_reason(self) -> str:
        (on,) = [r for r, v in self.heap_reason.items() if v == 1]
        return on


@dataclass
class Scrape:
    workers: dict[int, Worker]
    requests: dict[tuple[str, str, int], float]  # (route, code, pid) -> count
    latency_counts: dict[tuple[str, int], float]  # (route, pid) -> observations
    text: str


def scrape(srv: Server) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    status, (headers, body) = call(srv, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), (status, headers)
    text = body.decode()
    workers: dict[int, Worker] = {}
    requests: dict[tuple[str, str, int], float] = {}
    latency: dict[tuple[str, int], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels, value = sample.labels, sample.value
            if sample.name == "packcache_http_requests_total":
                requests[(labels["route"], labels["code"], int(labels["pid"]))] = value
                continue
            if sample.name == "packcache_http_request_duration_seconds_count":
                latency[(labels["route"], int(labels["pid"]))] = value
                continue
            if family.type != "gauge" or not sample.name.startswith("packcache_"):
                continue  # the request families keep a dead worker's totals; its gauges go with it
            w = workers.setdefault(int(labels["pid"]), Worker(int(labels["pid"])))
            name = sample.name.removeprefix("packcache_")
            if name == "worker_info":
                w.info = {k: v for k, v in labels.items() if k != "pid"}
            elif name == "state":
                w.state[labels["state"]] = value
            elif name == "heap_reason":
                w.heap_reason[labels["reason"]] = value
            elif name == "heap_bytes":
                w.heap_bytes[labels["reason"]] = value
            elif name == "packs":
                w.packs[labels["outcome"]] = value
            else:
                w.values[name] = value
    return Scrape(workers, requests, latency, text)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0, debug: Callable[[], str] | None = None) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, http.client.HTTPException):
            last = check()
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r} {debug() if debug else ''}")


def loaded_workers(
    srv: Server, count: int, exclude: frozenset[int] | set[int] = frozenset(), timeout: float = 60.0
) -> Scrape:
    """Scrape until exactly ``count`` workers, none of ``exclude``, report their loaded model."""

    def check() -> Scrape | None:
        s = scrape(srv)
        pids = set(s.workers)
        live = set(srv.workers())
        if len(pids) == count and not pids & exclude and pids == live and all(w.info for w in s.workers.values()):
            return s
        return None

    def debug() -> str:  # never raises: a server that stopped listening must still show its log
        try:
            scraped: Any = sorted(scrape(srv).workers)
        except (OSError, http.client.HTTPException) as exc:
            scraped = f"nothing ({exc})"
        return f"scraped {scraped}, live {srv.workers()}, master {srv.proc.poll()=}, log {srv.log()[-3000:]}"

    result: Scrape = wait_for(f"{count} loaded workers", check, timeout, debug)
    return result


def embed_from_every_worker(srv: Server, pids: set[int], texts: list[str], timeout: float = 30.0) -> dict[int, Any]:
    """Send the same request from 2 threads per worker until every pid in ``pids`` answered once in a forward of
    its own: the answers of those (a worker may merge concurrent requests into one forward, and a row's last bits
    can depend on the texts it shares a forward with)."""
    seen: dict[int, Any] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + timeout

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                if pids <= set(seen):
                    return
            status, (headers, body) = call(srv, "POST", "/embed", json.dumps({"texts": texts}).encode(), 60.0)
            assert status == 200, (status, body[:300])
            if headers.get("X-Packcache-Forward-Texts", str(len(texts))) != str(len(texts)):
                continue  # merged with another request
            with lock:
                seen.setdefault(int(headers["X-Packcache-Worker"]), []).append(json.loads(body)["embeddings"])

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2 * len(pids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    assert pids <= set(seen), f"workers {sorted(pids - set(seen))} never answered within {timeout} s"
    return seen


# ---------------------------------------------------------------- the kernel's figures


def connection_owner(server_port: int, client_port: int, candidates: list[int]) -> int | None:
    """The pid among ``candidates`` holding the accepted socket of the connection from ``client_port``."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, remote = fields[1], fields[2]
                if int(local.rsplit(":", 1)[1], 16) == server_port and int(remote.rsplit(":", 1)[1], 16) == client_port:
                    inode = fields[9]
    if not inode or inode == "0":
        return None  # still in the listen queue: nobody accepted it yet
    for pid in candidates:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                        return pid
    return None


# ---------------------------------------------------------------- what every worker must answer


def assert_embeddings(embeddings: list[list[float]], reference: np.ndarray[Any, Any]) -> None:
    got = np.asarray(embeddings, dtype=np.float64)
    assert got.shape == reference.shape
    np.testing.assert_allclose(got, reference, rtol=0, atol=2e-5)


def assert_no_heap(w: Worker) -> None:
    assert sorted(w.heap_bytes) == sorted(REASONS), "every heap reason is exported, 0 included"
    assert all(v == 0 for v in w.heap_bytes.values()), w.heap_bytes
    assert w.current_reason == "none" and w.values["errno"] == 0
