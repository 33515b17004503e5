"""``packcache serve`` run the way it is deployed: real gunicorn workers on 127.0.0.1, real HTTP,
real Prometheus scrapes, real SIGKILL, a real tmpfs for a full disk, a real read-only bind mount.

Every server is a ``python -m packcache serve --port 0`` child in its own session, with a hard
deadline (a watchdog kills its process group) and stopped in ``finally`` (SIGTERM, then SIGKILL
to the group). Workers run one torch thread each (``--torch-threads 1``): several workers on a
2-core machine would otherwise oversubscribe it, and one thread everywhere makes the embeddings
of every worker and of the in-process reference the same computation.

Self-contained on purpose: it does not import ``tests/_helpers.py``.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import read_only_bind, require_root, tmpfs
from harness.checkpoints import tiny_bert
from packcache.memory import MappingUsage, file_mapping_usage, smaps_rollup

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

    def debug() -> str:
        s = scrape(srv)
        return f"scraped {sorted(s.workers)}, live {srv.workers()}, log {srv.log()[-1500:]}"

    result: Scrape = wait_for(f"{count} loaded workers", check, timeout, debug)
    return result


def embed_from_every_worker(srv: Server, pids: set[int], texts: list[str], timeout: float = 30.0) -> dict[int, Any]:
    """Send the same request from 2 threads per worker until every pid in ``pids`` answered once."""
    seen: dict[int, Any] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + timeout

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                if pids <= set(seen):
                    return
            pid, embeddings = embed(srv, texts)
            with lock:
                seen.setdefault(pid, []).append(embeddings)

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


# ---------------------------------------------------------------- the reference


@pytest.fixture(scope="module")
def reference() -> np.ndarray[Any, Any]:
    """TEXTS embedded in this process by ``minilm.load("int8", cache=None)``, one torch thread."""
    import torch

    from packcache.models import minilm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with minilm.load("int8", cache=None) as model:
            result: np.ndarray[Any, Any] = model.embed(TEXTS)
    finally:
        torch.set_num_threads(threads)
    return result


def assert_embeddings(embeddings: list[list[float]], reference: np.ndarray[Any, Any]) -> None:
    got = np.asarray(embeddings, dtype=np.float64)
    assert got.shape == reference.shape
    np.testing.assert_allclose(got, reference, rtol=0, atol=2e-5)


def assert_no_heap(w: Worker) -> None:
    assert sorted(w.heap_bytes) == sorted(REASONS), "every heap reason is exported, 0 included"
    assert all(v == 0 for v in w.heap_bytes.values()), w.heap_bytes
    assert w.current_reason == "none" and w.values["errno"] == 0


# ---------------------------------------------------------------- the tests


def test_four_workers_cold_start_one_builds_the_others_map_and_all_serve_identical_embeddings(
    tmp_path: Path, reference: np.ndarray[Any, Any]
) -> None:
    from packcache.models import minilm

    cache_dir = tmp_path / "cache"
    assert not cache_dir.exists()
    with server(tmp_path, "--cache-dir", str(cache_dir), workers=4) as srv:
        s = loaded_workers(srv, 4)
        states = sorted(w.current_state for w in s.workers.values())
        assert states == ["mapped", "mapped", "mapped", "stored"], states
        (builder,) = [w for w in s.workers.values() if w.current_state == "stored"]
        path = Path(builder.info["cache_file"])
        assert path == minilm.default_cache_path("int8", cache_dir=cache_dir)  # named as `packcache run` names it
        for w in s.workers.values():
            assert w.info == {"engine": "packcache", "scheme": "int8", "kernel_path": w.info["kernel_path"],
                              "cache_file": str(path)}  # fmt: skip
            assert sorted(w.state) == sorted(STATES) and sum(w.state.values()) == 1
            assert_no_heap(w)
            assert w.values["mapped_bytes"] > 50 << 20 and w.values["file_bytes"] == path.stat().st_size
            assert w.values["reclaimable_bytes"] == 0  # exported per worker; one build, nothing superseded
            assert w.values["load_seconds"] > 0
            if w is builder:
                assert w.values["written_bytes"] > 0 and w.packs["stored"] > 0 and w.packs["hit"] == 0
            else:  # waited for the builder's lock, then found every pack in the file
                assert w.values["written_bytes"] == 0 and w.packs["stored"] == 0
                assert w.packs["hit"] == builder.packs["stored"]
        seen = embed_from_every_worker(srv, set(s.workers), TEXTS)
        first = next(iter(seen.values()))[0]
        for answers in seen.values():
            for embeddings in answers:
                assert embeddings == first, "every worker serves bit-identical embeddings"
        assert_embeddings(first, reference)
        after = scrape(srv)
        for pid, answers in seen.items():
            assert after.requests[("/embed", "200", pid)] >= len(answers)
            assert after.latency_counts[("/embed", pid)] == after.requests[("/embed", "200", pid)]
        report = packcache.verify(path)
        assert report.ok, report


def test_per_worker_pss_of_the_mapping_is_a_quarter_of_the_file_against_heap_workers(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    figures: dict[str, dict[int, tuple[dict[str, int], MappingUsage]]] = {}
    for mode, args in (("cache", ["--cache-dir", str(cache_dir)]), ("heap", ["--no-cache"])):
        with server(tmp_path, *args, "--prefault", workers=4, name=mode) as srv:
            s = loaded_workers(srv, 4)
            if mode == "cache":
                path = Path(next(iter(s.workers.values())).info["cache_file"])
                file_size = path.stat().st_size
                mapped = {w.values["mapped_bytes"] for w in s.workers.values()}
                assert len(mapped) == 1, mapped
                packed = int(mapped.pop())
            else:
                for w in s.workers.values():
                    assert (
                        w.current_state == "off" and w.heap_bytes["disabled"] == packed and w.info["cache_file"] == ""
                    )
            time.sleep(0.5)  # the scrape's own allocations settle
            figures[mode] = {pid: (smaps_rollup(pid), file_mapping_usage(path, pid)) for pid in s.workers}
    quarter = file_size / 4
    for pid, (_, m) in figures["cache"].items():
        # Every worker touched every page of every pack (--prefault), so each data page is mapped by
        # the 4 workers and the kernel charges each a quarter of it: PSS = resident / 4. The file's
        # header, index and alignment padding (0.1 % of it for MiniLM) and smaps' kB rounding are far
        # inside 5 %; unshared pages would put a worker near 4x, one worker holding fewer pages lower.
        assert m.rss >= 0.98 * packed, (pid, m.rss, packed)
        assert 0.95 * quarter <= m.pss <= 1.05 * quarter, (pid, m.pss, quarter)
        assert m.anonymous == 0 and m.deleted == 0
    for _, m in figures["heap"].values():
        assert m.mappings == 0, "caching off maps no cache file"
    median = {mode: {k: float(np.median([r[k] for r, _ in figures[mode].values()])) for k in ("Anonymous", "Pss")}
              for mode in figures}  # fmt: skip
    # A heap worker holds the packed weights as its own anonymous memory; a cache worker does not.
    anonymous_saved = median["heap"]["Anonymous"] - median["cache"]["Anonymous"]
    assert 0.85 * packed <= anonymous_saved <= 1.15 * packed, (anonymous_saved, packed)
    # Its PSS saves the packed bytes less the quarter each cache worker is charged for the mapping.
    pss_saved = median["heap"]["Pss"] - median["cache"]["Pss"]
    assert 0.85 * (packed - packed / 4) <= pss_saved <= 1.15 * (packed - packed / 4), (pss_saved, packed)


def test_a_worker_killed_mid_request_is_replaced_and_maps_again(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    long_texts = long(128, 2000)
    with server(tmp_path, "--cache-dir", str(cache_dir), workers=2) as srv:
        s = loaded_workers(srv, 2)
        path = Path(next(iter(s.workers.values())).info["cache_file"])
        _, expected = embed(srv, TEXTS)
        before = path.stat()
        port = int(srv.url.rsplit(":", 1)[1])

        # Clients keep asking while a worker dies: none may see a wrong embedding.
        stop = threading.Event()
        answers: list[Any] = []

        def client() -> None:
            while not stop.is_set():
                try:
                    answers.append(embed(srv, TEXTS)[1])
                except Exception as exc:  # collected, judged below
                    answers.append(exc)

        clients = [threading.Thread(target=client, daemon=True) for _ in range(2)]
        for t in clients:
            t.start()

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        client_port = conn.sock.getsockname()[1]
        outcome: list[Any] = []

        def big_request() -> None:
            try:
                conn.request("POST", "/embed", json.dumps({"texts": long_texts}), {"Content-Type": "application/json"})
                outcome.append(conn.getresponse().status)
            except Exception as exc:
                outcome.append(exc)

        sender = threading.Thread(target=big_request, daemon=True)
        sender.start()
        victim = wait_for(
            "the worker serving the big request", lambda: connection_owner(port, client_port, srv.workers())
        )
        time.sleep(0.3)
        assert sender.is_alive() and not outcome, "the big request must still be in flight when its worker dies"
        os.kill(victim, signal.SIGKILL)
        sender.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], (ConnectionError, http.client.HTTPException)), outcome

        after = loaded_workers(srv, 2, exclude={victim})
        stop.set()
        for t in clients:
            t.join(30)
        assert victim not in after.workers, "the dead worker's gauges are gone (child_exit marked it dead)"
        replacement = set(after.workers) - set(s.workers)
        assert len(replacement) == 1, (sorted(s.workers), sorted(after.workers))
        new = after.workers[replacement.pop()]
        assert new.current_state == "mapped" and new.values["written_bytes"] == 0 and new.packs["stored"] == 0
        assert_no_heap(new)
        good = [a for a in answers if not isinstance(a, Exception)]
        assert good and all(a == expected for a in good), "no client saw a wrong embedding"
        # A client request the victim had accepted while it was still receiving the big body waited behind it and
        # dies with the worker: a connection error, at most one per client, never a wrong answer or an HTTP error.
        failed = [a for a in answers if isinstance(a, Exception)]
        assert len(failed) <= len(clients) and all(_lost_connection(a) for a in failed), failed
        seen = embed_from_every_worker(srv, set(after.workers), TEXTS)
        assert all(a == expected for answers_ in seen.values() for a in answers_)
    now = path.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    report = packcache.verify(path)
    assert report.ok, report


def _lost_connection(exc: BaseException) -> bool:
    """A request whose connection the server dropped (urllib wraps some of these in URLError)."""
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason
    return isinstance(exc, (ConnectionError, http.client.HTTPException))


def _new_model_version(model: Path) -> None:
    """Replace ``model.safetensors`` by another version of the model (temp + rename): the
    embedding LayerNorm's weight scaled by 1.5, every other byte the same."""
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (size,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + size])
    name = next(n for n in header if n.endswith("embeddings.LayerNorm.weight"))
    assert header[name]["dtype"] == "F32"
    start, end = (8 + size + o for o in header[name]["data_offsets"])
    values = np.frombuffer(bytes(data[start:end]), dtype="<f4") * np.float32(1.5)
    data[start:end] = values.astype("<f4").tobytes()
    temp = model / ".model.safetensors.new"
    temp.write_bytes(bytes(data))
    os.replace(temp, weights)


def test_a_model_updated_in_place_while_serving_old_workers_keep_theirs_restarted_ones_map_the_new(
    tmp_path: Path,
) -> None:
    """Cache files are named by content, and each worker names its own when it loads: the next model
    version copied over the model directory, its cache built beside and renamed into place, is
    what replaced and restarted workers open, while the old workers keep serving the old file."""
    from packcache.models import minilm

    model = tmp_path / "model"
    shutil.copytree(minilm.default_model_path(), model)
    args = ("--cache-dir", str(tmp_path / "cache"), "--model", str(model))
    with server(tmp_path, *args, workers=2) as srv:
        old = loaded_workers(srv, 2)
        path = Path(next(iter(old.workers.values())).info["cache_file"])
        first = embed_from_every_worker(srv, set(old.workers), TEXTS)
        e1 = next(iter(first.values()))[0]
        old_bytes = path.read_bytes()

        # The next model version, its cache built elsewhere and renamed into the cache directory.
        _new_model_version(model)
        new_path = minilm.default_cache_path("int8", model_path=model, cache_dir=tmp_path / "cache")
        assert new_path != path, "another model, another file"
        staging = tmp_path / "staging" / new_path.name
        code = (
            "import json, sys, torch\n"
            "torch.set_num_threads(1)\n"
            "from packcache.models import minilm\n"
            "m = minilm.load('int8', cache=sys.argv[1], model_path=sys.argv[2])\n"
            "assert m.cache.stats().state == 'stored', m.cache.stats()\n"
            "print(json.dumps(m.embed(json.loads(sys.argv[3])).tolist()))\n"
        )
        env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(
            [sys.executable, "-c", code, str(staging), str(model), json.dumps(TEXTS)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        e2 = np.asarray(json.loads(done.stdout))
        assert np.abs(e2 - np.asarray(e1)).max() > 1e-3, "the new version embeds differently"
        os.rename(staging, new_path)

        # The old workers keep serving the old model from the old file.
        again = embed_from_every_worker(srv, set(old.workers), TEXTS)
        assert all(a == e1 for answers in again.values() for a in answers)
        for pid in old.workers:
            assert file_mapping_usage(path, pid).mappings > 0

        # One worker replaced (SIGTERM: gunicorn starts another): old and new serve side by side.
        stopped, kept = sorted(old.workers)
        os.kill(stopped, signal.SIGTERM)
        mixed = loaded_workers(srv, 2, exclude={stopped})
        (fresh,) = set(mixed.workers) - {kept}
        seen = embed_from_every_worker(srv, {kept, fresh}, TEXTS)
        assert all(a == e1 for a in seen[kept])
        for a in seen[fresh]:
            np.testing.assert_allclose(a, e2, rtol=0, atol=2e-5)
        assert mixed.workers[fresh].current_state == "mapped" and mixed.workers[fresh].values["written_bytes"] == 0
        assert mixed.workers[fresh].info["cache_file"] == str(new_path)
        assert file_mapping_usage(new_path, fresh).mappings > 0 and file_mapping_usage(path, fresh).mappings == 0

        # A rolling restart (SIGHUP) replaces the rest: every worker maps the new file.
        os.kill(srv.pid, signal.SIGHUP)
        new = loaded_workers(srv, 2, exclude={kept, fresh, stopped})
        for w in new.workers.values():
            assert w.current_state == "mapped" and w.values["written_bytes"] == 0, w
            assert_no_heap(w)
            assert file_mapping_usage(new_path, w.pid).mappings > 0
        final = embed_from_every_worker(srv, set(new.workers), TEXTS)
        for answers in final.values():
            for a in answers:
                np.testing.assert_allclose(a, e2, rtol=0, atol=2e-5)
    assert path.read_bytes() == old_bytes  # nothing wrote to the old model's file
    for file in (path, new_path):
        report = packcache.verify(file)
        assert report.ok, report


@pytest.mark.root
def test_a_full_disk_still_starts_and_serves_and_the_scrape_says_degraded_no_space_enospc(
    tmp_path: Path, reference: np.ndarray[Any, Any]
) -> None:
    require_root()
    # 20 MiB for a ~56 MiB model: the disk fills up during the build.
    with tmpfs(tmp_path / "small", "20m") as small:
        with server(tmp_path, "--cache-dir", str(small / "cache"), workers=2) as srv:
            s = loaded_workers(srv, 2)
            for w in s.workers.values():
                assert w.current_state == "degraded", w
                assert w.current_reason == "no_space" and w.values["errno"] == errno.ENOSPC
                assert w.heap_bytes["no_space"] > 0 and w.values["mapped_bytes"] > 0
                assert sum(w.heap_bytes.values()) == w.heap_bytes["no_space"]
            assert call(srv, "GET", "/healthz")[0] == 200
            for answers in embed_from_every_worker(srv, set(s.workers), TEXTS).values():
                for a in answers:
                    assert_embeddings(a, reference)


@pytest.mark.root
def test_a_read_only_cache_directory_still_starts_and_serves_and_the_scrape_says_why(
    tmp_path: Path, reference: np.ndarray[Any, Any]
) -> None:
    require_root()
    # A cache directory shipped read-only with a partial file (built on a disk that filled up),
    # and one shipped empty.
    partial = tmp_path / "shipped"
    partial.mkdir(mode=0o700)
    with tmpfs(tmp_path / "small", "20m") as small:
        env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(
            [sys.executable, "-m", "packcache", "run", "--cache-dir", str(small), "--scheme", "int8", "--json"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["stats"]["state"] == "degraded"
        made = Path(json.loads(done.stdout)["cache_file"])
        shutil.copy2(made, partial / made.name)
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with read_only_bind(partial, tmp_path / "ro") as ro, read_only_bind(empty, tmp_path / "ro-empty") as ro_empty:
        with server(tmp_path, "--cache-dir", str(ro), workers=2, name="partial") as srv:
            s = loaded_workers(srv, 2)
            for w in s.workers.values():
                assert w.current_state == "degraded" and w.current_reason == "read_only", w
                assert w.values["errno"] == errno.EROFS and w.values["mapped_bytes"] > 0
                assert w.heap_bytes["read_only"] > 0 and sum(w.heap_bytes.values()) == w.heap_bytes["read_only"]
            for answers in embed_from_every_worker(srv, set(s.workers), TEXTS).values():
                for a in answers:
                    assert_embeddings(a, reference)
        with server(tmp_path, "--cache-dir", str(ro_empty), workers=1, name="empty") as srv:
            (w,) = loaded_workers(srv, 1).workers.values()
            # Nothing can be mapped: the state is `heap` (docs/ACCOUNTING.md), the reason and errno say why.
            # The file cannot be created: `open_failed` (docs/ROUTING.md row 5), the errno says why.
            assert w.current_state == "heap" and w.current_reason == "open_failed", w
            assert w.values["errno"] == errno.EROFS and w.values["mapped_bytes"] == 0
            assert w.heap_bytes["open_failed"] > 0 and sum(w.heap_bytes.values()) == w.heap_bytes["open_failed"]
            assert_embeddings(embed(srv, TEXTS)[1], reference)


def test_bad_requests_get_a_json_4xx_the_worker_survives_and_sigterm_stops_gracefully(tmp_path: Path) -> None:
    limits = ("--max-texts", "64", "--max-text-chars", "2000", "--max-body-bytes", "200000")
    with server(tmp_path, "--cache-dir", str(tmp_path / "cache"), *limits, workers=1) as srv:
        (pid,) = loaded_workers(srv, 1).workers

        def post(body: bytes) -> tuple[int, str]:
            status, (_, raw) = call(srv, "POST", "/embed", body)
            return status, json.loads(raw)["error"] if status != 200 else ""

        cases = {
            b"not json": 400,
            b'{"texts": "one string"}': 400,
            b'{"texts": [1, 2]}': 400,
            b'{"text": ["typo"]}': 400,
            b'{"texts": ["a"], "more": 1}': 400,
            b"[" * 1000 + b"]" * 1000: 400,
            b'{"texts": [' + b"1" * 100 + b"]}": 400,
            json.dumps({"texts": ["x"] * 65}).encode(): 400,
            json.dumps({"texts": ["y" * 2001]}).encode(): 400,
            b'{"texts": ["\\ud800"]}': 400,
            b"": 400,
            json.dumps({"texts": ["z" * 1999] * 120}).encode(): 413,
        }
        for body, expected in cases.items():
            status, message = post(body)
            assert status == expected and message, (body[:40], status, message)
        assert call(srv, "GET", "/embed")[0] == 405
        assert call(srv, "GET", "/embed")[1][0]["Allow"] == "POST"
        assert call(srv, "POST", "/metrics", b"{}")[0] == 405
        assert call(srv, "GET", "/nope")[0] == 404
        assert embed(srv, [])[1] == []
        served_by, embeddings = embed(srv, ["still here"])
        assert served_by == pid and len(embeddings) == 1 and len(embeddings[0]) == 384
        s = scrape(srv)
        assert set(s.workers) == {pid} and srv.workers() == [pid], "no worker died or was replaced"
        assert s.requests[("/embed", "400", pid)] == sum(1 for c in cases.values() if c == 400)
        assert s.requests[("/embed", "413", pid)] == 1 and s.requests[("/embed", "405", pid)] == 2
        assert s.requests[("other", "404", pid)] == 1 and s.requests[("/metrics", "405", pid)] == 1
        health = json.loads(call(srv, "GET", "/healthz")[1][1])
        assert health == {"status": "ok", "pid": pid, "engine": "packcache", "scheme": "int8", "state": "stored",
                          "heap_reason": "none"}  # fmt: skip
        private = list(srv.tmp.iterdir())
        assert len(private) == 1 and private[0].name.startswith("packcache-serve-metrics-")
        assert (private[0].stat().st_mode & 0o777) == 0o700

        # SIGTERM while a slow request is in flight: it completes, then the server exits 0 and cleans up.
        slow = long(48, 1990)
        port = int(srv.url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        client_port = conn.sock.getsockname()[1]
        result: list[Any] = []
        sent = threading.Event()

        def send() -> None:
            conn.request("POST", "/embed", json.dumps({"texts": slow}), {"Content-Type": "application/json"})
            sent.set()
            response = conn.getresponse()
            result.append((response.status, len(json.loads(response.read())["embeddings"])))

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        wait_for("the worker to take the slow request", lambda: connection_owner(port, client_port, [pid]))
        # Accepted is not enough: a connection that has sent nothing yet is idle, and SIGTERM closes idle
        # connections at once. Wait until the whole request is sent and the worker has had time to read it
        # (it reads ~95 KB at once; the batch itself takes over a second, checked just below).
        assert sent.wait(30)
        time.sleep(0.3)
        os.kill(srv.pid, signal.SIGTERM)
        assert sender.is_alive() and not result, "the slow request must still be in flight at SIGTERM"
        sender.join(60)
        assert result == [(200, len(slow))], result
        assert srv.proc.wait(30) == 0, srv.log()
        assert list(srv.tmp.iterdir()) == [], "the private metrics directory is removed at exit"


def test_the_server_package_imports_neither_gunicorn_nor_prometheus_client_nor_torch() -> None:
    """``packcache`` and ``packcache.server`` import without the serve extra's packages or the model's;
    ``packcache serve --help`` too. The master imports them only when it runs."""
    code = (
        "import sys\n"
        "import packcache, packcache.server, packcache.cli\n"
        "assert packcache.cli.main(['serve', '--help']) == 0\n"
        "heavy = {'gunicorn', 'prometheus_client', 'torch', 'tokenizers', 'sentence_transformers'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-500:]
    assert "--workers" in done.stdout and "--engine" in done.stdout


def test_a_metrics_directory_other_users_can_write_is_refused_before_anything_is_written() -> None:
    """prometheus_client opens ``<dir>/<kind>_<pid>.db`` by name and writes through it: in a directory
    another user can write, that user plants a symlink there and the server writes through it into a
    file of theirs choosing. ``serve`` refuses such a directory (as the cache refuses one for its
    files), before it starts gunicorn or deletes anything in it."""
    require_root()
    base = Path(tempfile.mkdtemp(prefix="packcache-metrics-"))  # pytest's tmp_path is 0700: nobody can't reach it
    try:
        _refuse_shared_metrics_dir(base)
    finally:
        shutil.rmtree(base)


def _refuse_shared_metrics_dir(base: Path) -> None:
    os.chmod(base, 0o755)
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, no sticky bit: anyone can plant or replace names
    victim = base / "victim"
    victim.write_bytes(b"keep")
    planted = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ln", "-s", str(victim), str(shared / "a.db")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert planted.returncode == 0, planted.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "packcache", "serve", "--port", "0", "--workers", "1", "--metrics-dir", str(shared)],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "other users can write" in done.stderr and "listening" not in done.stdout, done.stderr[-2000:]
    assert (shared / "a.db").is_symlink() and victim.read_bytes() == b"keep"


def test_the_sentence_transformers_engine_never_reaches_a_hub_whatever_hf_hub_offline_says() -> None:
    """The baseline engine promises a local directory, never a hub. It only defaulted
    ``HF_HUB_OFFLINE=1``, so an operator's ``HF_HUB_OFFLINE=0`` let ``--model org/name`` download.
    A real listener stands in for the hub (``HF_ENDPOINT``); the worker's load must fail without
    one connection to it."""
    hub = socket.socket()
    hub.bind(("127.0.0.1", 0))
    hub.listen(16)
    hub.settimeout(0.2)
    code = (
        "import json\n"
        "from packcache.server.engines import EngineSpec, load_engine\n"
        "try:\n"
        "    load_engine(EngineSpec(engine='sentence-transformers', model='someorg/some-model'))\n"
        "    print(json.dumps('loaded'))\n"
        "except Exception as e:\n"
        "    print(json.dumps(type(e).__name__))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
           "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}", "HF_HOME": tempfile.mkdtemp()}  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    connections = 0
    try:
        while child.poll() is None:
            with contextlib.suppress(TimeoutError):
                conn, _ = hub.accept()
                connections += 1
                conn.close()
        out, err = child.communicate(timeout=120)
    finally:
        hub.close()
        if child.poll() is None:
            child.kill()
        shutil.rmtree(env["HF_HOME"], ignore_errors=True)
    assert connections == 0, f"the engine asked the hub {connections} times"
    assert child.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) != "loaded", out


def _publish(tmp: Path, checkpoint: Path, store: Path, key: Path) -> dict[str, Any]:
    """Machine A's CI job: build the checkpoint's cache, publish it signed; the publish report."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore",
           "XDG_CACHE_HOME": str(tmp / "xdg"), "PACKCACHE_DIGEST_DIR": str(tmp / "digests")}  # fmt: skip
    cli = [sys.executable, "-m", "packcache"]
    built = subprocess.run(
        [*cli, "build", str(checkpoint), "--loader", "minilm", "--scheme", "int8", "--cache-dir", str(tmp / "cache"),
         "--json"], capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    published = subprocess.run(
        [*cli, "publish", json.loads(built.stdout)["cache_file"], str(store), "--sign", str(key), "--model",
         str(checkpoint), "--json"], capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert published.returncode == 0, published.stderr[-2000:]
    report: dict[str, Any] = json.loads(published.stdout)
    return report


def test_a_fresh_machine_serves_from_the_store_and_a_rolling_restart_picks_up_the_next_published_model(
    tmp_path: Path,
) -> None:
    """The two-machine scenario (issue 21): machine A builds and publishes; machine B (another directory,
    a copy of the checkpoint at another path with other mtimes, other variables) starts 4 workers with
    --remote: one download, nothing packed, every worker mapped. Then A publishes the next model version,
    B's model directory is updated in place and a rolling restart picks it up while requests go on."""
    from packcache.fleet.manifest import generate_key, public_path_for

    a, b = tmp_path / "a", tmp_path / "b"
    key = a / "ci.pem"
    a.mkdir()
    generate_key(key)
    store = tmp_path / "store"
    store.mkdir()
    v1 = _publish(a, tiny_bert(a / "v1", seed=1), store, key)
    model = b / "models" / "current"
    shutil.copytree(a / "v1", model)
    later = time.time() + 3600
    for path in model.iterdir():
        os.utime(path, (later, later))
    remote = ("--remote", str(store), "--trusted-key", public_path_for(key))
    args = ("--cache-dir", str(b / "cache"), "--model", str(model), *remote)
    with server(b, *args, workers=4) as srv:
        first = loaded_workers(srv, 4, timeout=120)
        for w in first.workers.values():
            assert w.current_state == "mapped" and w.values["written_bytes"] == 0 and w.packs["stored"] == 0, w
            assert w.info["cache_file"].endswith(f"{v1['model']}.pcache"), w
        # A worker that started after the file landed never asked the store (a clean local hit);
        # those that missed waited for the one download and found the file there.
        assert sum(w.values["remote_hits"] for w in first.workers.values()) >= 1
        downloads = [w.pid for w in first.workers.values() if w.values["remote_bytes"] >= v1["size"]]
        assert len(downloads) == 1, {w.pid: w.values["remote_bytes"] for w in first.workers.values()}
        e1 = embed_from_every_worker(srv, set(first.workers), TEXTS)

        # The next version: published by A; B's operator copies it over the model directory, then SIGHUP.
        v2 = _publish(a, tiny_bert(a / "v2", seed=2), store, key)
        assert v2["model"] != v1["model"]
        failures: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                try:
                    status, _ = call(srv, "POST", "/embed", json.dumps({"texts": TEXTS}).encode(), timeout=30)
                    if status != 200:
                        failures.append(str(status))
                except OSError as exc:
                    failures.append(repr(exc))

        client = threading.Thread(target=traffic)
        client.start()
        try:
            for name in os.listdir(a / "v2"):
                shutil.copy(a / "v2" / name, model / f".{name}.new")
                os.rename(model / f".{name}.new", model / name)
            os.kill(srv.pid, signal.SIGHUP)
            second = loaded_workers(srv, 4, exclude=set(first.workers), timeout=120)
        finally:
            stop.set()
            client.join(60)
        assert failures == [], failures[:5]
        for w in second.workers.values():
            assert w.current_state == "mapped" and w.values["written_bytes"] == 0 and w.packs["stored"] == 0, w
            assert w.info["cache_file"].endswith(f"{v2['model']}.pcache"), w
        e2 = embed_from_every_worker(srv, set(second.workers), TEXTS)
        assert np.abs(np.asarray(next(iter(e2.values()))[0]) - np.asarray(next(iter(e1.values()))[0])).max() > 1e-3
