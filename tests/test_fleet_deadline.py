"""``packcache fetch``'s two bounds: a store that makes no progress ends the fetch
within the stall bound (``--timeout``, 10 s by default), whatever the overall ``--deadline``; a download
that keeps making progress runs past the stall bound, up to the deadline.

Real processes through the command line: FLEET.md's init-container recipe (no ``--timeout``) against a
loopback server that accepts connections and never answers, and a fetch through a loopback proxy that
trickles moto's answers to a few hundred KiB/s.
"""

from __future__ import annotations

import contextlib
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
from harness.s3server import S3Server
from harness.tcp import silent_server
from packcache._defaults import REMOTE_TIMEOUT
from packcache.fleet.fetch import fetch
from packcache.fleet.manifest import generate_key, public_path_for
from packcache.fleet.publish import publish
from packcache.format import canonical_key

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
