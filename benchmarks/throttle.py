"""A bandwidth-capped TCP proxy on 127.0.0.1 for the cold-start benchmark (``benchmarks/coldstart.py``).

Written by hand: no package on PyPI does this. ``toxiproxy-python`` is only a client of Toxiproxy's Go
server (not on PyPI), the asyncio "throttle" packages limit call rates, not bytes on a socket, and
``tc``/netem on the loopback device would slow every other process on a shared machine and needs
``CAP_NET_ADMIN``. This is ~100 lines of threads and one token bucket per direction.

The cap is a link's: one bucket for the bytes towards the client (downloads) and one for the bytes
towards the server, each shared by every connection through the proxy, so eight concurrent range reads
share 1 Gbit/s as they would on one NIC. A bucket lends at most ``burst`` bytes ahead (50 ms of the
rate); a sender that overdraws sleeps off its debt, so the long-run rate is the cap. ``rate=None`` only
counts. Counts: :attr:`ThrottleProxy.bytes_down` (server to client) and :attr:`ThrottleProxy.bytes_up`.

Usage::

    with ThrottleProxy(("127.0.0.1", 8333), rate=125_000_000) as proxy:  # 1 Gbit/s
        endpoint = f"http://127.0.0.1:{proxy.port}"
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from typing import Any

__all__ = ["GBIT", "ThrottleProxy", "TokenBucket", "parse_rate"]

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
GBIT = 1_000_000_000 // 8  # bytes per second in one Gbit/s
CHUNK = 256 * 1024  # one recv; at 1 Gbit/s this is 2 ms of the link


def parse_rate(text: str) -> int | None:
    """``unlimited`` -> None, ``1g`` -> 125 000 000 bytes/s, ``500m`` -> 62 500 000 (bits per second, SI).

    Raises:
        ValueError: the text is neither ``unlimited`` nor a number with ``k``/``m``/``g``.
    """
    text = text.strip().lower()
    if text in ("unlimited", "none", "inf"):
        return None
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    if not text or text[-1] not in units or not text[:-1].replace(".", "", 1).isdigit():
        raise ValueError(f"bandwidth {text!r}: give 'unlimited' or bits per second such as 1g, 10g, 500m")
    return int(float(text[:-1]) * units[text[-1]] / 8)


class TokenBucket:
    """``rate`` bytes per second with at most ``burst`` bytes lent ahead; thread-safe."""

    def __init__(self, rate: int, burst: int | None = None) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else max(CHUNK, rate // 20)
        self._tokens = float(self.burst)
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Spend ``n`` bytes, sleeping until the bucket's debt is paid."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            debt = -self._tokens
        if debt > 0:
            time.sleep(debt / self.rate)


class ThrottleProxy:
    """Listens on 127.0.0.1 (``port``), forwards every connection to ``upstream``, capped at ``rate`` B/s."""

    def __init__(self, upstream: tuple[str, int], rate: int | None) -> None:
        self.upstream = upstream
        self.rate = rate
        self._down = TokenBucket(rate) if rate else None
        self._up = TokenBucket(rate) if rate else None
        self._count_lock = threading.Lock()
        self.bytes_down = 0
        self.bytes_up = 0
        self.connections = 0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="throttle-accept", daemon=True)

    def __enter__(self) -> ThrottleProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def reset_counts(self) -> None:
        """Zero the byte and connection counts (between benchmark rows)."""
        with self._count_lock:
            self.bytes_down = self.bytes_up = self.connections = 0

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        for s in list(self._sockets):
            with contextlib.suppress(OSError):
                s.close()
        if self._thread.is_alive():
            self._thread.join(5)

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            client.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, server]
            with self._count_lock:
                self.connections += 1
            state = {"open": 2}
            for src, dst, bucket, down in ((server, client, self._down, True), (client, server, self._up, False)):
                threading.Thread(target=self._pump, args=(src, dst, bucket, down, state), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: TokenBucket | None, down: bool,
              state: dict[str, int]) -> None:  # fmt: skip
        # splice(2) through a pipe: the bytes never enter Python, so the proxy itself is not the cap.
        rd, wr = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(wr, F_SETPIPE_SZ, CHUNK)
        try:
            while True:
                n = os.splice(src.fileno(), wr, CHUNK)
                if n == 0:
                    break
                if bucket is not None:
                    bucket.take(n)
                left = n
                while left:
                    left -= os.splice(rd, dst.fileno(), left)
                with self._count_lock:
                    if down:
                        self.bytes_down += n
                    else:
                        self.bytes_up += n
        except OSError:
            pass
        finally:
            os.close(rd)
            os.close(wr)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            with self._count_lock:
                state["open"] -= 1
                last = state["open"] == 0
            if last:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.close()
                    with contextlib.suppress(ValueError):
                        self._sockets.remove(s)
