"""HTTP/1.1 framing in ``packcache serve``'s worker (``packcache.server.worker``), now read by h11: chunk
extensions, trailers, pipelined requests cut at every byte, a request line cut across reads, and every
framing h11 would take that the worker refused before h11 (smuggling shapes), still refused.

One server for the module: the worker around an application that echoes what it was handed (method,
path, query, the body's bytes and ``CONTENT_LENGTH``), 1000-byte bodies, 2 s deadlines. Real sockets on
127.0.0.1; every client has a deadline, so nothing here hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness.serve import SRC

#: The worker around an echo application; prints its port when ready.
_ECHO_SERVER = """
import json
from gunicorn.app.base import BaseApplication
from packcache.server import Limits
from packcache.server.worker import worker_class

def app(environ, start_response):
    body = environ["wsgi.input"].read()
    answer = {"method": environ["REQUEST_METHOD"], "path": environ["PATH_INFO"], "query": environ["QUERY_STRING"],
              "body": body.decode("latin-1"), "content_length": environ.get("CONTENT_LENGTH", ""),
              "trailer": environ.get("HTTP_X_TRAILER"), "protocol": environ["SERVER_PROTOCOL"]}
    start_response("200 OK", [("Content-Type", "application/json")])
    return [json.dumps(answer).encode()]

def ready(server):
    print("port", server.LISTENERS[0].sock.getsockname()[1], flush=True)

class Server(BaseApplication):
    def load_config(self):
        limits = Limits(max_body_bytes=1000, header_timeout=2.0, body_timeout=2.0, send_timeout=2.0)
        for key, value in {"bind": ["127.0.0.1:0"], "workers": 1, "worker_class": worker_class(limits),
                           "when_ready": ready, "timeout": 30, "control_socket_disable": True,
                           "graceful_timeout": 1}.items():
            self.cfg.set(key, value)
    def load(self):
        return app

Server().run()
"""


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    log = tmp_path_factory.mktemp("echo") / "echo.log"
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _ECHO_SERVER], stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        found = None
        for _ in range(300):
            found = re.search(r"^port (\d+)$", log.read_text(), re.M)
            if found:
                break
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert found, log.read_text()
        yield int(found.group(1))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_answers(sock: socket.socket, count: int, timeout: float = 10.0) -> list[tuple[int, dict[str, str], Any]]:
    """``count`` answers read off ``sock``: (status, headers, JSON body) each."""
    data, answers = b"", []
    deadline = time.monotonic() + timeout
    while len(answers) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].decode("latin-1").split("\r\n")
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
            end = head_end + 4 + int(headers["content-length"])
            if len(data) >= end:
                answers.append((int(head[0].split()[1]), headers, json.loads(data[head_end + 4 : end])))
                data = data[end:]
                continue
        assert time.monotonic() < deadline, (answers, data)
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        assert chunk, ("closed after", answers, data)
        data += chunk
    return answers


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], Any, bytes]:
    """Send ``raw``, read one answer and what follows it until the server closes: (status, headers, body, rest)."""
    with contextlib.closing(connect(port)) as sock:
        sock.sendall(raw)
        ((status, headers, body),) = read_answers(sock, 1)
        rest = b""
        with contextlib.suppress(OSError):
            sock.settimeout(3)
            while chunk := sock.recv(65536):
                rest += chunk
        return status, headers, body, rest


POST = b"POST /echo HTTP/1.1\r\nHost: t\r\n"
CHUNKED = POST + b"Transfer-Encoding: chunked\r\n"


def test_chunk_extensions_and_trailers_are_read_and_the_body_is_whole(port: int) -> None:
    """Chunk extensions (a token, a quoted string, several, with a tab) and trailer fields are read and dropped;
    the application gets the body whole, with its length, and no trailer among its headers."""
    body = b'{"texts": ["chunked ; with extensions"]}'
    pieces = [body[:5], body[5:6], body[6:30], body[30:]]
    exts = [b";a=1", b';name="quoted ; value"', b";a;b=2;c", b";x=\t1"]
    raw = b"".join(b"%x%s\r\n%s\r\n" % (len(p), e, p) for p, e in zip(pieces, exts, strict=True))
    raw += b"0;last=yes\r\nX-Trailer: 1\r\nX-Other: two words\r\n\r\n"
    status, headers, echo, rest = exchange(port, CHUNKED + b"Connection: close\r\n\r\n" + raw)
    assert status == 200 and echo["body"] == body.decode() and echo["content_length"] == str(len(body)), echo
    assert echo["trailer"] is None and headers["connection"] == "close" and rest == b"", (echo, rest)
    # Upper-case hex sizes and no trailer at all.
    status, _, echo, _ = exchange(port, CHUNKED + b"Connection: close\r\n\r\n1A\r\n" + b"y" * 26 + b"\r\n0\r\n\r\n")
    assert status == 200 and echo["body"] == "y" * 26, echo


#: Three pipelined requests: a Content-Length body, a chunked body with an extension and a trailer, a GET.
PIPELINE = (
    POST + b"Content-Length: 11\r\n\r\nhello world"
    + CHUNKED + b"\r\n4;e=1\r\nabcd\r\n2\r\nef\r\n0\r\nX-T: 1\r\n\r\n"
    + b"GET /last?q=1 HTTP/1.1\r\nHost: t\r\n\r\n"
)  # fmt: skip


def test_pipelined_requests_cut_across_two_reads_at_every_byte_are_each_answered_in_order(port: int) -> None:
    """The same three pipelined requests, sent in two writes cut at every byte boundary (the server reads
    them apart: a 5 ms pause between), on one kept-alive connection each: three answers, in order, each with
    its whole body, whatever the cut."""
    expected = [("POST", "/echo", "", "hello world"), ("POST", "/echo", "", "abcdef"), ("GET", "/last", "q=1", "")]
    for cut in range(1, len(PIPELINE)):
        with contextlib.closing(connect(port)) as sock:
            sock.sendall(PIPELINE[:cut])
            time.sleep(0.005)
            sock.sendall(PIPELINE[cut:])
            answers = read_answers(sock, 3)
        got = [(e["method"], e["path"], e["query"], e["body"]) for _, _, e in answers]
        assert [s for s, _, _ in answers] == [200] * 3 and got == expected, (cut, answers)
        assert all(h["connection"] == "keep-alive" for _, h, _ in answers), (cut, answers)


def test_a_request_sent_one_byte_per_read_is_served(port: int) -> None:
    """A request line, headers, and a chunked body each arriving one byte per read (a 2 ms pause between):
    the same answer as in one write, then an HTTP/1.0 request on a fresh connection."""
    raw = b"\r\n" + CHUNKED + b"Connection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n"  # an empty line first: ignored
    with contextlib.closing(connect(port)) as sock:
        for i in range(len(raw)):
            sock.sendall(raw[i : i + 1])
            time.sleep(0.002)
        ((status, headers, echo),) = read_answers(sock, 1)
    assert status == 200 and echo["body"] == "abc" and headers["connection"] == "close", echo
    status, headers, echo, _ = exchange(port, b"POST /old HTTP/1.0\r\nContent-Length: 2\r\n\r\nok")
    assert status == 200 and echo["protocol"] == "HTTP/1.0" and echo["body"] == "ok", echo
    assert headers["connection"] == "close"


def test_an_absolute_form_target_reaches_the_application_as_its_path(port: int) -> None:
    status, _, echo, _ = exchange(port, b"GET http://example.org/v1/models?x=2 HTTP/1.1\r\nHost: example.org\r\n"
                                        b"Connection: close\r\n\r\n")  # fmt: skip
    assert status == 200 and (echo["path"], echo["query"]) == ("/v1/models", "x=2"), echo


def test_a_head_request_gets_its_answers_headers_and_no_body(port: int) -> None:
    """A HEAD request's answer is the head a GET would get (its Content-Length included) and no body: the
    next pipelined request's answer follows the blank line at once."""
    with contextlib.closing(connect(port)) as sock:
        sock.sendall(b"HEAD /h HTTP/1.1\r\nHost: t\r\n\r\nGET /after HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        data = b""
        sock.settimeout(10)
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"\r\nContent-Length: " in head, data
    assert rest.startswith(b"HTTP/1.1 200 "), data  # no body between the two answers
    second, _, body = rest.partition(b"\r\n\r\n")  # the last answer: its body runs to the close
    echo = json.loads(body)
    assert (echo["method"], echo["path"]) == ("GET", "/after"), (second, echo)


#: Chunks of 99, 500 and 500 bytes: the third one's size line takes the body past the 1000 bytes served.
PAST_THE_LIMIT = b"".join(b"%x\r\n%s\r\n" % (n, b"z" * n) for n in (99, 500, 500))

#: name -> (what the client sends, the status it must get). Each is framing h11 0.16 reads one way and
#: some other HTTP reader (a proxy in front) another way, or a limit h11 does not keep; the worker refused
#: each before h11 (but a bare LF inside a trailer line, which it let through) and still does.
H11_WOULD_TAKE = {
    "trailers ended by a bare LF": (CHUNKED + b"\r\n1\r\na\r\n0\r\n\nGET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    "a trailer line ended by a bare LF": (CHUNKED + b"\r\n1\r\na\r\n0\r\nX-T: 1\n\r\n", 400),
    "a folded trailer line": (CHUNKED + b"\r\n1\r\na\r\n0\r\nX-T: 1\r\n 2\r\n\r\n", 400),
    "a bare CR in a chunk extension": (CHUNKED + b"\r\n1;a\rb\r\na\r\n0\r\n\r\n", 400),
    "NUL in a chunk extension": (CHUNKED + b"\r\n1;a\x00\r\na\r\n0\r\n\r\n", 400),
    "a chunk line over 1 KiB": (CHUNKED + b"\r\n1;" + b"e" * 2000 + b"\r\na\r\n0\r\n\r\n", 400),
    "a chunk line over 1 KiB, unfinished": (CHUNKED + b"\r\n1;" + b"e" * 2000, 400),
    "trailers over 8 KiB": (CHUNKED + b"\r\n1\r\na\r\n0\r\n" + b"X-T: 1234567890\r\n" * 600, 400),
    "a chunk longer than its size": (CHUNKED + b"\r\n1\r\nab\r\n0\r\n\r\n", 400),
    "Content-Length: 2, 2": (POST + b"Content-Length: 2, 2\r\n\r\n{}", 400),
    "two equal Content-Length, apart": (POST + b"Content-Length: 2\r\nX-A: 1\r\ncontent-length: 2\r\n\r\n{}", 400),
    "Content-Length and chunked": (CHUNKED + b"Content-Length: 0\r\n\r\n0\r\n\r\n", 400),
    "chunked in HTTP/1.0": (b"POST /echo HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    "a control character in a header value": (POST + b"X-A: a\x01b\r\nContent-Length: 0\r\n\r\n", 400),
    "a bare CR ending a header line": (POST + b"X-A: a\rContent-Length: 0\r\n\r\n", 400),
    "a bare LF ending a header line": (POST + b"X-A: a\nContent-Length: 0\r\n\r\n", 400),
    "a folded header line": (POST + b"X-A: a\r\n\tContent-Length: 2\r\n\r\n{}", 400),
    "a method over 32 bytes": (b"P" * 40 + b" /echo HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    "a target over 8 KiB": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    "HTTP/1.2": (b"GET /echo HTTP/1.2\r\nHost: t\r\n\r\n", 505),
    "HTTP/0.9 line": (b"GET /echo HTTP/0.9\r\nHost: t\r\n\r\n", 505),
    "101 header fields": (b"GET /echo HTTP/1.1\r\nHost: t\r\n" + b"X-A: 1\r\n" * 100 + b"\r\n", 431),
    "a complete head over 32 KiB": (b"GET /echo HTTP/1.1\r\nHost: t\r\nX-A: " + b"a" * 33000 + b"\r\n\r\n", 431),
    "a chunk size over the body limit, no data yet": (CHUNKED + b"\r\n3e9\r\n", 413),
    "chunks past the body limit": (CHUNKED + b"\r\n" + PAST_THE_LIMIT, 413),
    "a transfer coding other than chunked": (POST + b"Transfer-Encoding: gzip\r\n\r\n", 501),
    "two Transfer-Encoding fields": (CHUNKED + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
}  # fmt: skip


@pytest.mark.parametrize("name", list(H11_WOULD_TAKE))
def test_framing_h11_would_take_is_refused_as_before(port: int, name: str) -> None:
    """Each shape is answered with its refusal, at once, in the worker's JSON error shape, and the connection
    closed: nothing after it (``/smuggled``) is ever read as a request."""
    raw, code = H11_WOULD_TAKE[name]
    began = time.monotonic()
    status, headers, body, rest = exchange(port, raw)
    assert status == code, (name, body)
    assert headers["connection"] == "close" and set(body) == {"error"} and rest == b"", (name, headers, rest)
    assert time.monotonic() - began < 1.5, name


def test_what_h11_refuses_beyond_the_worker_before_it(port: int) -> None:
    """Stricter than before h11, and so documented: an HTTP/1.1 request without ``Host`` (RFC 9112 3.2)."""
    status, headers, body, _ = exchange(port, b"GET /echo HTTP/1.1\r\n\r\n")
    assert status == 400 and headers["connection"] == "close" and "error" in body, body
