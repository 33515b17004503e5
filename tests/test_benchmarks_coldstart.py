"""benchmarks/throttle.py, the bandwidth cap of the cold-start benchmark: real sockets on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from throttle import ThrottleProxy, parse_rate

RATE = "40m"  # 5 MB/s: a few seconds of test, far below what loopback does here


def _serve(listener: socket.socket, payload: bytes, connections: int) -> None:
    """For each connection: read the client's upload up to EOF, answer its sha256 and then ``payload``."""

    def one(conn: socket.socket) -> None:
        digest = hashlib.sha256()
        while chunk := conn.recv(1 << 16):
            digest.update(chunk)
        conn.sendall(digest.digest() + payload)
        conn.close()

    for _ in range(connections):
        conn, _ = listener.accept()
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def _fetch(port: int, upload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(upload)
        conn.shutdown(socket.SHUT_WR)
        got = bytearray()
        while chunk := conn.recv(1 << 20):
            got += chunk
    return bytes(got)


@pytest.mark.serial
@pytest.mark.parametrize("connections", [1, 3])
def test_proxy_caps_the_link_and_forwards_bytes_intact(connections: int) -> None:
    rate = parse_rate(RATE)
    assert rate == 5_000_000
    payload = os.urandom(6_000_000 // connections)
    uploads = [os.urandom(200_000 + i) for i in range(connections)]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    threading.Thread(target=_serve, args=(listener, payload, connections), daemon=True).start()
    results: list[bytes] = [b""] * connections
    with ThrottleProxy(listener.getsockname(), rate) as proxy:
        started = time.perf_counter()
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, _fetch(proxy.port, uploads[i])))
            for i in range(connections)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        seconds = time.perf_counter() - started
        down, up = proxy.bytes_down, proxy.bytes_up
    listener.close()
    for i, got in enumerate(results):
        assert got[:32] == hashlib.sha256(uploads[i]).digest(), "the upload arrived changed"
        assert got[32:] == payload, "the download arrived changed"
    assert down == connections * (32 + len(payload))
    assert up == sum(map(len, uploads))
    # The downloads share one 5 MB/s link; the bucket lends 50 ms (250 kB) ahead at the start.
    expected = (down - rate // 20) / rate
    assert 0.8 * expected <= seconds <= 1.2 * expected, f"{down} bytes in {seconds:.2f} s at a {rate} B/s cap"


def test_unlimited_only_counts_and_rates_parse() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    payload = os.urandom(3_000_000)
    threading.Thread(target=_serve, args=(listener, payload, 1), daemon=True).start()
    with ThrottleProxy(listener.getsockname(), parse_rate("unlimited")) as proxy:
        got = _fetch(proxy.port, b"x")
        assert got[32:] == payload and proxy.bytes_down == len(got) and proxy.connections == 1
    listener.close()
    assert parse_rate("1g") == 125_000_000 and parse_rate("10g") == 1_250_000_000
    with pytest.raises(ValueError, match="bandwidth '1 gbit'"):
        parse_rate("1 gbit")
