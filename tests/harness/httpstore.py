"""A directory store served over HTTP on 127.0.0.1 whose blob part reads misbehave on purpose: short, another
range, shifted bytes, or a stall (the fetch tests of tests/test_fleet_download.py and tests/test_fleet_trust.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from packcache import format as fmt


class Faulty(BaseHTTPRequestHandler):
    """A directory store's files over HTTP; a blob's part reads (not its header read) misbehave as ``mode`` says:
    ``short`` (fewer bytes, the headers agreeing), ``other-range`` (Content-Range of another range), ``shifted``
    (the right headers, bytes from one offset later), ``stall`` (half the part, then nothing until released;
    ``sending`` is set once it is half-way)."""

    root: Path
    mode: str
    release: threading.Event
    sending: threading.Event

    def log_message(self, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, *, body: bool) -> None:
        path = self.root / self.path.lstrip("/").split("?")[0]
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        wanted = self.headers.get("Range")
        part = wanted is not None and path.name.endswith(".pcache")
        start, end = 0, len(data)
        if wanted:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
            part = part and end - start > fmt.HEADER_READ_SIZE
        sent, claimed = data[start:end], (start, end)
        if part and self.mode == "short":
            sent, claimed = sent[: len(sent) // 2], (start, start + len(sent) // 2)
        elif part and self.mode == "other-range":
            claimed = (start + 1, end)
            sent = data[start + 1 : end]
        elif part and self.mode == "shifted":
            sent = data[start + 1 : end + 1].ljust(end - start, b"\0")
        self.send_response(206 if wanted else 200)
        if wanted:
            self.send_header("Content-Range", f"bytes {claimed[0]}-{claimed[1] - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start if part and self.mode == "stall" else len(sent)))
        self.send_header("Last-Modified", "Wed, 02 Dec 2026 00:00:00 GMT")
        self.send_header("ETag", f'"{len(data)}"')
        self.end_headers()
        if not body:
            return
        if part and self.mode == "stall":
            self.wfile.write(sent[: len(sent) // 2])
            self.wfile.flush()
            self.sending.set()
            self.release.wait(60)
            return
        self.wfile.write(sent)


@contextlib.contextmanager
def faulty_store(root: Path, mode: str) -> Iterator[tuple[str, threading.Event]]:
    """:class:`Faulty` serving directory store ``root`` on 127.0.0.1 in ``mode``; yields its URL and the event set
    when a stalled part is half sent. Every stalled answer is released, and the server stopped, on exit."""
    release, sending = threading.Event(), threading.Event()
    handler = type("Handler", (Faulty,), {"root": root, "mode": mode, "release": release, "sending": sending})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", sending
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join()
