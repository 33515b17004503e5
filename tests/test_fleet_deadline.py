"""``packcache fetch``'s two bounds: a store that makes no progress ends the fetch
within the stall bound (``--timeout``, 10 s by default), whatever the overall ``--deadline``; a download
that keeps making progress runs past the stall bound, up to the deadline. Both count the time spent waiting
on the store, never the machine's own work: on a machine whose every core is busy, a directory store does not
time out, a store that stalls still does, and a manifest the store did answer is judged, never hidden behind a
timeout.

Real processes through the command line: FLEET.md's init-container recipe (no ``--timeout``) against a
loopback server that accepts connections and never answers, a fetch through a loopback proxy that
trickles moto's answers to a few hundred KiB/s, and fetches by name beside a busy loop on every core.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import packcache
from harness.checkpoints import tiny_bert
from harness.httpstore import faulty_store
from harness.keys import make_keys
from harness.packs import MIB, packed
from harness.s3server import S3Server
from harness.tcp import silent_server
from packcache._defaults import REMOTE_TIMEOUT
from packcache.errors import RemoteError
from packcache.fleet.fetch import fetch
from packcache.fleet.manifest import generate_key, public_path_for
from packcache.fleet.names import fetch_name
from packcache.fleet.publish import publish
from packcache.format import canonical_key
from packcache.loader import resolve

SRC = Path(__file__).resolve().parents[1] / "src"
PLATFORM = {"packers": [{"id": "test.f32", "version": 1}], "cpu": "test"}


def _cli(*args: str, env: dict[str, str], timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "packcache", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(SRC), **env}, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return done, time.monotonic() - began


@contextlib.contextmanager
def trickling_proxy(upstream: int, piece: int = 16 << 10, pause: float = 0.05) -> Iterator[int]:
    """A TCP proxy on 127.0.0.1 to ``upstream`` that passes the server's answers on ``piece`` bytes at a
    time, ``pause`` seconds apart: a slow, healthy link (never silent for longer than ``pause``)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    sockets: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket, slow: bool) -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                data = src.recv(piece)
                if not data:
                    break
                dst.sendall(data)
                if slow:
                    time.sleep(pause)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                client = listener.accept()[0]
            except OSError:
                continue
            server = socket.create_connection(("127.0.0.1", upstream))
            sockets.extend((client, server))
            for args in ((client, server, False), (server, client, True)):
                thread = threading.Thread(target=pump, args=args, daemon=True)
                thread.start()
                threads.append(thread)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        acceptor.join()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
        for thread in threads:
            thread.join(5)
        listener.close()


def test_the_init_recipe_ends_fast_against_a_silent_store(tmp_path: Path) -> None:
    """FLEET.md's recipe flags, no ``--timeout``: a store that accepts and never answers costs the stall
    bound (10 s), not the 600 s overall deadline."""
    checkpoint = tiny_bert(tmp_path / "ckpt", seed=1)
    (tmp_path / "keys").mkdir()
    generate_key(tmp_path / "keys" / "ci.pem")
    with silent_server() as port:
        env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "XDG_CACHE_HOME": str(tmp_path / "xdg")}  # fmt: skip
        done, elapsed = _cli(
            "fetch", "s3://models/caches", "--model", str(checkpoint), "--scheme", "int8", "--cache-dir",
            str(tmp_path / "cache"), "--trusted-key", public_path_for(tmp_path / "keys" / "ci.pem"),
            env=env, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1 and "remote_timeout" in done.stderr, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    # The process's own start (torch, hashing the checkpoint) plus the stall bound and its grace.
    assert elapsed < REMOTE_TIMEOUT + 25, elapsed


def test_a_slow_healthy_download_is_not_cut_by_the_stall_bound(
    tmp_path: Path, moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1.5 MiB blob trickled at ~300 KiB/s takes ~5 s: longer than the stall bound of 2 s, never silent
    for 2 s. (The command line's --timeout and --deadline are these two arguments.)"""
    built = tmp_path / "a" / "model-x.pcache"
    rng = np.random.default_rng(0)
    with packcache.WeightCache(built, platform=PLATFORM) as cache, cache.session() as s:
        for i in range(6):
            array = rng.standard_normal((256, 256)).astype(np.float32)
            s.get_or_pack(f"layer{i}", lambda a=array: a, {"packer": "test.f32", "version": 1})
    url = f"{moto_s3.url}/{uuid.uuid4().hex}"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name, value in moto_s3.env.items():
        monkeypatch.setenv(name, value)
    publish(built, url)  # unsigned: the test is about time, not trust
    upstream = int(moto_s3.endpoint.rsplit(":", 1)[1])
    local = tmp_path / "b" / "model-x.pcache"
    with trickling_proxy(upstream) as port:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        began = time.monotonic()
        report = fetch(url, local, platform=canonical_key(PLATFORM), allow_unsigned=True, timeout=2,
                       total_timeout=120)  # fmt: skip
        elapsed = time.monotonic() - began
    assert report.downloaded and local.read_bytes() == built.read_bytes()
    assert elapsed > 3, f"the download took {elapsed:.1f} s: the proxy did not slow it past the stall bound"


@pytest.mark.parametrize("flag", ["--timeout", "--deadline"])
def test_fetch_bounds_are_checked_seconds(tmp_path: Path, flag: str) -> None:
    done, _ = _cli("fetch", str(tmp_path), "--cache", str(tmp_path / "m.pcache"), flag, "inf", env={}, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- the store's time, not the machine's

NAME = "org/model-int8"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_keys(tmp_path_factory.mktemp("keys"), "ci", "other")


@contextlib.contextmanager
def busy_cores() -> Iterator[int]:
    """A busy loop on every CPU this process may run on: real processes, at this process's own priority (equal, the
    harder case). Yields how many."""
    count = len(os.sched_getaffinity(0))
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
             for _ in range(count)]  # fmt: skip
    try:
        time.sleep(0.3)  # each is spinning
        yield count
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait()


def _named_file(path: Path, megabytes: int, seed: int = 0) -> None:
    """A cache file of ``megabytes`` MiB (16 MiB packs) under int8's platform: the class a node looking for a name
    finds it under, with no checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with packcache.WeightCache(path, platform=resolve("int8").platform()) as cache, cache.session() as s:
        for i in range(megabytes // 16):
            s.get_or_pack(
                f"layer{i}", lambda i=i: packed(seed * 100 + i, 16 * MIB), {"packer": "test.f32", "version": 1}
            )


def _fetch_by_name(
    store: str, node: Path, public: Path, seconds: float
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``packcache fetch STORE --name NAME`` with both bounds at ``seconds``, as a new process: it imports torch to
    know this machine's classes, then hashes and verifies what it downloads (seconds of local work on a busy
    machine; only ``run``/``serve --model NAME --remote``'s model load comes after)."""
    return _cli(
        "fetch", store, "--name", NAME, "--timeout", str(seconds), "--deadline", str(seconds), "--cache-dir",
        str(node), "--trusted-key", str(public), "--json", env={"XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"]},
        timeout=300,
    )  # fmt: skip


@pytest.mark.serial
def test_a_busy_machine_does_not_make_a_directory_store_time_out(
    tmp_path: Path, keys: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every core busy, a directory store that answers each call at once, a 1 s budget: the fetch by name imports
    torch to find the classes, hashes and verifies 64 MiB, seconds of this machine's work, and succeeds. The budget
    used to be wall-clock time from the fetch's start: this fetch "ran out of its 1 s" before asking the store
    anything, and a node with an older accepted file served that one, saying "store not reached"."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    built = tmp_path / "ci" / "m.pcache"
    _named_file(built, 64)
    store = tmp_path / "store"
    store.mkdir()
    publish(built, str(store), name=NAME, private_key=str(keys["ci"]))
    with busy_cores():
        done, elapsed = _fetch_by_name(str(store), tmp_path / "node", keys["ci.pub"], 1.0)
    assert done.returncode == 0, (elapsed, done.stderr[-2000:])
    report = json.loads(done.stdout)
    assert (report["downloaded"], report["reached"], report["generation"]) == (True, True, 1), report
    assert Path(report["path"]).read_bytes() == built.read_bytes()


@pytest.mark.serial
def test_a_slow_step_never_hides_an_untrusted_manifest_behind_a_timeout(
    tmp_path: Path, keys: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's current manifest is signed by a key this node does not trust (a store written by someone else),
    and the node holds the file it accepted before. On a busy machine the fetch's own work used to spend the budget
    before the manifest was judged: the timeout counted as "store not reached", the older file was served with exit
    0, and the untrusted manifest went unseen. The store answered: its answer is ``remote_untrusted``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    store, node = tmp_path / "store", tmp_path / "node"
    store.mkdir()
    first = tmp_path / "ci" / "m1.pcache"
    _named_file(first, 16)
    publish(first, str(store), name=NAME, private_key=str(keys["ci"]))
    accepted = fetch_name(str(store), NAME, cache_dir=node, trusted_keys=[keys["ci.pub"]], scheme="int8")
    second = tmp_path / "other" / "m2.pcache"
    _named_file(second, 16, seed=1)
    publish(second, str(store), name=NAME, private_key=str(keys["other"]))
    with busy_cores():
        done, _ = _fetch_by_name(str(store), node, keys["ci.pub"], 0.5)
    assert done.returncode == 1 and "remote_untrusted" in done.stderr, (done.stdout, done.stderr[-2000:])
    assert "not reached" not in done.stdout + done.stderr
    assert Path(accepted.path).read_bytes() == first.read_bytes()  # kept as it was


@pytest.mark.serial
def test_a_store_that_stalls_still_times_out_on_a_busy_machine(tmp_path: Path, keys: dict[str, Path]) -> None:
    """What the clock does not count is the machine's work; a store that stops sending half way through the blob is
    the store's, and the stall bound (1 s) ends the fetch, far inside its 120 s budget, every core busy."""
    built = tmp_path / "a" / "model-x.pcache"
    _named_file(built, 16)
    store = tmp_path / "store"
    store.mkdir()
    publish(built, str(store), private_key=str(keys["ci"]))
    local = tmp_path / "b" / "model-x.pcache"
    platform = canonical_key(resolve("int8").platform())
    with busy_cores(), faulty_store(store, "stall") as (url, sending):
        began = time.monotonic()
        with pytest.raises(RemoteError) as caught:
            fetch(url, local, platform=platform, trusted_keys=[keys["ci.pub"].read_bytes()], timeout=1,
                  total_timeout=120)  # fmt: skip
        elapsed = time.monotonic() - began
    assert sending.is_set(), "the store never began the blob: it did not stall where the test says"
    assert caught.value.reason == "remote_timeout", caught.value
    assert elapsed < 1 + 1 + 10, elapsed  # the stall bound, its grace, a busy machine's slack
    assert not local.exists()
