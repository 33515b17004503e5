"""Reading one HTTP/1.1 request off a connection's bytes: h11's events, and what h11 lets through refused.

The worker (:mod:`.worker`) owns the sockets and calls :func:`parse_head` and :func:`parse_body` with the bytes
each connection has buffered; a :class:`Conn` holds a connection's state, a :class:`Request` a whole request
handed to a lane. A malformed or oversized request raises :class:`HttpRefusal`, which the worker answers itself.

HTTP/1.1 is read by h11 (pinned in the ``serve`` extra): the request line, headers,
``Content-Length`` and chunked bodies, keep-alive and pipelining. A new ``h11.Connection`` reads each
request; the loop writes the answers itself, and bytes that came after a request start the next
one's. h11 was chosen over httptools (llhttp, in C): it is pure Python and hands out one event at a
time, so a request is parsed only when its connection is ready for it (llhttp parses every pipelined
request in a buffer at once, with no pause from Python); it bounds the head (431) and answers 501 for
a transfer coding it cannot read. It costs about 50 us a request (a keep-alive GET took 239 against
185 us), nothing next to a forward.

Where h11 is more lenient than this worker, the worker checks what h11 parsed and refuses it:
a bare LF ending a line, a folded header line, a control character in a field or a chunk extension,
two ``Content-Length`` fields (h11 merges equal ones), both ``Content-Length`` and
``Transfer-Encoding`` (h11 lets the coding win), chunked framing in HTTP/1.0, an HTTP version other
than 1.0 and 1.1, trailers ended by a bare LF, and the line, field and trailer limits below. h11 is
stricter in two ways, kept: an HTTP/1.1 request needs exactly one ``Host`` (400), and the target is
visible ASCII. One of h11's internals is read (how many bytes it holds unparsed, to find the chunked
framing between data; see :func:`_parsed`), which the pin and the tests hold.

Refused before the application sees them, with a JSON ``{"error": ...}`` and the connection
closed: a body over ``max_body_bytes`` (``413``, from ``Content-Length`` at once, without
reading it; for a chunked body as soon as it grows past the limit), a malformed request
line, header or chunk, both ``Content-Length`` and ``Transfer-Encoding``, two
``Content-Length`` headers (``400``), a transfer coding other than ``chunked`` (``501``),
headers over 32 KiB or 100 fields (``431``), an HTTP version other than 1.0 and 1.1
(``505``), an ``Expect`` other than ``100-continue`` (``417``). A chunk line and a trailer line are
at most 1 KiB, the trailers (read and dropped) 8 KiB.

:func:`wsgi_environ` hands a whole request to the application; :func:`frame_stream` frames a streamed answer
(a generation's server-sent events) in HTTP/1.1's chunks.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote_to_bytes

import h11

from .wsgiapp import Limits

__all__ = [
    "MAX_HEAD_BYTES", "Body", "Conn", "HttpRefusal", "Request", "State", "frame_stream", "parse_body", "parse_head",
    "refusal_response", "wsgi_environ",
]  # fmt: skip

MAX_HEAD_BYTES = 32 << 10  # request line and headers
MAX_FIELDS = 100
MAX_METHOD = 32
MAX_TARGET = 8192
MAX_CHUNK_LINE = 1024  # a chunk-size line with its extensions, and one trailer line
MAX_TRAILER_BYTES = 8 << 10

# What h11 lets through and this worker refuses, checked on the bytes h11 parsed (see _parse_head, _chunk_framing).
# Once every CRLF is taken out: a bare CR or LF, NUL, or any other control character but HTAB.
_BARE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_FOLD = re.compile(rb"\r\n[ \t]")  # obs-fold: a line that continues the one before
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([^\r]*?)[ \t]*(?=\r\n)", re.IGNORECASE)


REASONS = {
    100: "Continue",
    400: "Bad Request",
    408: "Request Timeout",
    413: "Content Too Large",
    417: "Expectation Failed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class HttpRefusal(Exception):
    """A request answered by the worker itself: its status, a message, and extra headers."""

    def __init__(self, code: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.headers = headers


_PIECE = 65536  # a body is kept in pieces of this size


class Body:
    """A request body as it arrives: whole pieces of ``_PIECE`` bytes and a tail shorter than one.

    One ``bytearray`` grown to 4 MiB as its bytes come is reallocated again and again: with many
    such bodies growing at once the worker's resident memory grew by 1.27 to 1.51 times the bytes
    the budget counted. Pieces of one size are freed and reused whole: 1.06 to 1.11 times (pinned by
    tests/test_server_worker.py::
    test_clients_sending_real_bytes_past_the_body_budget_lose_the_biggest_bodies_and_memory_stays_bounded).
    """

    __slots__ = ("pieces", "size", "tail")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.tail = bytearray()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def add(self, data: bytes | bytearray) -> None:
        self.tail += data
        self.size += len(data)
        while len(self.tail) >= _PIECE:
            self.pieces.append(bytes(self.tail[:_PIECE]))
            del self.tail[:_PIECE]

    def join(self) -> bytes:
        return b"".join([*self.pieces, self.tail])


class State:
    """Where a connection is: reading a request's head or body, in the application, writing its answer (whole,
    or streamed as the engine makes it), or lingering after an error answer."""

    HEAD, BODY, APP, WRITE, LINGER = "head", "body", "app", "write", "linger"
    STREAM = "stream"
    EVICTABLE = (HEAD, BODY, LINGER)  # still sending a request, or done: never one the application works on


@dataclass(eq=False)
class Conn:
    sock: socket.socket
    peer: tuple[Any, ...]
    accepted: float
    state: str = State.HEAD
    deadline: float = 0.0
    buf: bytearray = field(default_factory=bytearray)
    events: int = 0
    began: float = 0.0  # when this request's first byte (or its head) came, for the 408's latency figure
    # the request being read
    method: str = ""
    target: str = ""
    version: tuple[int, int] = (1, 1)
    headers: list[tuple[str, str]] = field(default_factory=list)
    keep_alive: bool = True
    body: Body = field(default_factory=Body)
    charged: int = 0  # bytes of the body budget this request holds
    length: int | None = None  # Content-Length; None: chunked
    parser: h11.Connection | None = None  # this request's parser: a new one for each request
    fed: int = 0  # bytes of ``buf`` (the head so far) already given to the parser
    framing: bytearray = field(default_factory=bytearray)  # chunked: bytes given to the parser since the last data
    # the response being written
    out: memoryview | None = None
    closed: bool = False
    served: int = 0  # responses written on this connection
    # a streamed answer (State.STREAM): bytes not sent yet, chunked framing, whether its last bytes came
    pending: bytearray = field(default_factory=bytearray)
    chunked: bool = False
    ended: bool = False
    generating: Request | None = None  # the generation this connection's answer comes from, until it ends


class Counted(Protocol):
    """What a request's lane is to the loop: the count of its requests queued or running."""

    pending: int


@dataclass(eq=False)
class Request:
    conn: Conn
    environ: dict[str, Any]
    head_only: bool
    lane: Counted | None = None
    # a generation: the engine's id for it, and whether its client went away (either thread may see it first)
    generation: str | None = None
    cancelled: bool = False


def _next_event(conn: Conn) -> Any:
    """h11's next event for ``conn``'s request; h11's refusals as this worker's."""
    assert conn.parser is not None
    try:
        return conn.parser.next_event()
    except h11.RemoteProtocolError as exc:
        # h11's messages quote the client's bytes: the answer names the fault without them.
        if conn.state != State.HEAD:
            raise HttpRefusal(400, "a malformed chunked body") from None
        if exc.error_status_hint == 431:
            raise HttpRefusal(431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes") from None
        if exc.error_status_hint == 501:
            raise HttpRefusal(501, "the only transfer coding served is chunked") from None
        if "Host" in str(exc):  # RFC 9112 3.2: exactly one, in every HTTP/1.1 request
            raise HttpRefusal(400, "an HTTP/1.1 request needs exactly one Host header") from None
        raise HttpRefusal(400, "a malformed request line or header field") from None


def parse_head(conn: Conn, limits: Limits, *, alive: bool) -> bool:
    """Give the head's new bytes to h11; once it has the request line and headers, check what it let through."""
    assert conn.parser is not None
    if not conn.fed:
        while conn.buf[:2] == b"\r\n":  # RFC 9112 2.2: empty lines before a request line are ignored (h11 refuses)
            del conn.buf[:2]
        if not conn.buf or conn.buf == b"\r":  # a CRLF may be split between two reads
            return False
    conn.parser.receive_data(bytes(conn.buf[conn.fed :]))
    conn.fed = len(conn.buf)
    event = _next_event(conn)
    if event is h11.NEED_DATA:
        return False
    assert isinstance(event, h11.Request)
    early = conn.parser.trailing_data[0]  # bytes after the head: the body's first ones, or a pipelined request
    head = bytes(conn.buf[: len(conn.buf) - len(early)])
    conn.buf, conn.fed = bytearray(), 0
    if len(head) > MAX_HEAD_BYTES + 4:
        raise HttpRefusal(431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes")
    # h11 splits lines at a bare LF, joins folded lines, and lets control characters but NUL through; a
    # proxy that reads them otherwise frames another request (RFC 9112 2.2, 5.2: refuse). pinned by
    # tests/test_server_framing.py::test_framing_h11_would_take_is_refused_as_before
    if _BARE.search(head.replace(b"\r\n", b"")):
        raise HttpRefusal(400, "a bare CR, LF, NUL or another control character in the request head")
    if _FOLD.search(head):
        raise HttpRefusal(400, "a header field folded over two lines (obs-fold)")
    version = event.http_version.decode("ascii")
    if version not in ("1.0", "1.1"):
        raise HttpRefusal(505, "HTTP/1.0 and HTTP/1.1 are served")
    conn.version = (int(version[0]), int(version[2]))
    if len(event.method) > MAX_METHOD or len(event.target) > MAX_TARGET:
        raise HttpRefusal(400, "a malformed request line")
    conn.method, conn.target = event.method.decode("ascii"), event.target.decode("latin-1")
    if head.count(b"\r\n") - 2 > MAX_FIELDS:
        raise HttpRefusal(431, f"more than {MAX_FIELDS} header fields")
    # h11 merges equal Content-Length fields and "2, 2" into one: two of them are refused (RFC 9112 6.3).
    lengths = _CONTENT_LENGTH.findall(head)
    if len(lengths) > 1:
        raise HttpRefusal(400, "more than one Content-Length")
    if lengths and not (lengths[0].isdigit() and len(lengths[0]) <= 18):
        raise HttpRefusal(400, "Content-Length is not a byte count")
    conn.headers = [(name.decode("ascii"), value.decode("latin-1")) for name, value in event.headers]
    _framing(conn, limits, early=bool(early), alive=alive)
    if conn.length is None:
        conn.framing = bytearray(early)  # h11 has them: the first chunk's size line, perhaps its data
    return True


def _framing(conn: Conn, limits: Limits, *, early: bool, alive: bool) -> None:
    """How the body is delimited (RFC 9112 6.3), refused when ambiguous; 413 and 417 before any body.

    ``early``: bytes of the body came with the head (no ``100 Continue`` then)."""
    lengths = [v for n, v in conn.headers if n == "content-length"]
    codings = [v for n, v in conn.headers if n == "transfer-encoding"]
    tokens = {t.strip().lower() for n, v in conn.headers if n == "connection" for t in v.split(",")}
    conn.keep_alive = conn.version == (1, 1) and "close" not in tokens and alive
    limit = limits.max_body_bytes
    if codings:
        if lengths:  # h11 lets Transfer-Encoding win: a proxy that reads Content-Length frames another request
            raise HttpRefusal(400, "both Content-Length and Transfer-Encoding")
        if conn.version != (1, 1):
            raise HttpRefusal(400, "Transfer-Encoding in an HTTP/1.0 request")
        if [c.strip().lower() for c in ",".join(codings).split(",")] != ["chunked"]:
            raise HttpRefusal(501, "the only transfer coding served is chunked")
        conn.length = None
    elif lengths:
        if len(lengths) > 1:
            raise HttpRefusal(400, "more than one Content-Length")
        if not lengths[0].isdigit() or not lengths[0].isascii() or len(lengths[0]) > 18:
            raise HttpRefusal(400, "Content-Length is not a byte count")
        conn.length = int(lengths[0])
        if conn.length > limit:
            raise HttpRefusal(413, f"the body is {conn.length} bytes; at most {limit} are accepted")
    else:
        conn.length = 0
    expect = [v.strip().lower() for n, v in conn.headers if n == "expect"]
    if expect and expect != ["100-continue"]:
        raise HttpRefusal(417, "the only expectation served is 100-continue")
    conn.state, conn.deadline = State.BODY, time.monotonic() + limits.body_timeout
    if expect and conn.length != 0 and conn.version == (1, 1) and not early:
        # The client waits for this before it sends the body (curl does, for bodies over 1 KiB). It
        # reserves nothing: the body is charged as it comes, like any other.
        with contextlib.suppress(OSError):
            conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")


def parse_body(conn: Conn, limits: Limits, charge: Callable[[Conn, int], None]) -> bool:
    """Give the body's new bytes to h11 and keep its data, charged as it comes; True once the body is whole."""
    parser = conn.parser
    assert parser is not None
    chunked = conn.length is None
    if conn.buf:
        parser.receive_data(bytes(conn.buf))
        if chunked:
            conn.framing += conn.buf
        conn.buf = bytearray()
    while True:
        event = _next_event(conn)
        if event is h11.NEED_DATA:
            if chunked:
                _chunk_framing(conn, limits, _parsed(conn), waiting=True)
            return False
        if isinstance(event, h11.Data):
            if chunked:
                _chunk_framing(conn, limits, _parsed(conn) - len(event.data), waiting=False)
                del conn.framing[: len(event.data)]
            charge(conn, len(event.data))
            conn.body.add(event.data)
        elif isinstance(event, h11.EndOfMessage):
            if chunked:
                _chunk_framing(conn, limits, _parsed(conn), waiting=False, trailers=True)
            conn.buf = bytearray(parser.trailing_data[0])  # a pipelined request's first bytes
            conn.parser, conn.framing = None, bytearray()
            return True
        else:  # pragma: no cover - h11 gives a request's body as Data and EndOfMessage only
            raise HttpRefusal(400, "a malformed request body")


def _parsed(conn: Conn) -> int:
    """How many bytes of ``conn.framing`` h11 has parsed: the rest waits in its buffer.

    h11 0.16 keeps that buffer in ``_receive_buffer``: its public ``trailing_data`` copies it, which for a body
    of 1-byte chunks would copy up to 64 KiB per chunk. Another h11 without it gets the copy, never a failure."""
    assert conn.parser is not None
    held = getattr(conn.parser, "_receive_buffer", None)
    unparsed = len(held) if held is not None else len(conn.parser.trailing_data[0])
    return len(conn.framing) - unparsed


def _chunk_framing(conn: Conn, limits: Limits, parsed: int, *, waiting: bool, trailers: bool = False) -> None:
    """Check the chunked framing h11 parsed since the last data (``conn.framing[:parsed]``): a chunk's CRLF and
    the next size line, or the last chunk and the trailers; then drop it. 413 once a chunk's size passes the
    limit, before its data. ``waiting``: h11 needs more bytes (only whole lines are checked then).

    h11 takes any byte but LF in a chunk extension, ends the trailers at a bare LF, folds trailer lines, and
    bounds a line at 32 KiB only: each is refused here, as a proxy may frame it otherwise. pinned by
    tests/test_server_framing.py::test_framing_h11_would_take_is_refused_as_before
    """
    if waiting:
        pending = conn.framing[parsed:]  # a line (or the trailers) h11 has not parsed yet
        if len(pending) - pending.rfind(b"\n") > MAX_CHUNK_LINE + 2 or len(pending) > MAX_TRAILER_BYTES:
            raise HttpRefusal(400, "a chunk line is too long, or too many trailer fields")
        parsed = conn.framing.rfind(b"\r\n", 0, parsed) + 2  # a chunk's CRLF may be half parsed
        if parsed < 2:
            return
    framing = bytes(conn.framing[:parsed])
    if not framing:
        return
    lines = framing.split(b"\r\n")
    if _BARE.search(framing.replace(b"\r\n", b"")) or (trailers and _FOLD.search(framing)):
        raise HttpRefusal(400, "a bare CR, LF, NUL or another control character in the chunked framing")
    if max(map(len, lines)) > MAX_CHUNK_LINE or len(framing) > MAX_TRAILER_BYTES + MAX_CHUNK_LINE:
        raise HttpRefusal(400, "a chunk line is too long, or too many trailer fields")
    if not trailers:
        size_line = next((line for line in reversed(lines) if line), b"")
        declared = int(size_line.partition(b";")[0], 16) if size_line else 0
        limit = limits.max_body_bytes
        if len(conn.body) + declared > limit:
            raise HttpRefusal(413, f"the body is over {limit} bytes")
    del conn.framing[:parsed]


def refusal_response(refusal: HttpRefusal, body: bytes | None = None) -> bytes:
    """The whole response of an answer the worker gives itself, and the connection closed: ``body`` (the JSON error
    in the API shape of the request's route, which the application names), else ``{"error": ...}``."""
    if body is None:
        body = json.dumps({"error": str(refusal)}).encode()
    lines = [
        f"HTTP/1.1 {refusal.code} {REASONS[refusal.code]}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in refusal.headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def wsgi_environ(conn: Conn) -> dict[str, Any]:
    """The WSGI environ of ``conn``'s whole request (its body copied into ``wsgi.input``)."""
    target = conn.target
    if target.startswith(("http://", "https://")):  # absolute form (RFC 9112 3.2.2)
        slash = target.find("/", target.find("//") + 2)
        target = target[slash:] if slash >= 0 else "/"
    path, _, query = target.partition("?")
    host, port = conn.sock.getsockname()[:2] if conn.sock.family != socket.AF_UNIX else ("", 0)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": conn.method,
        "SCRIPT_NAME": "",
        "PATH_INFO": unquote_to_bytes(path).decode("latin-1"),
        "QUERY_STRING": query,
        "RAW_URI": conn.target,
        "SERVER_PROTOCOL": f"HTTP/{conn.version[0]}.{conn.version[1]}",
        "SERVER_NAME": str(host),
        "SERVER_PORT": str(port),
        "REMOTE_ADDR": str(conn.peer[0]),
        "REMOTE_PORT": str(conn.peer[1]) if len(conn.peer) > 1 else "",
        "CONTENT_LENGTH": str(len(conn.body)) if conn.body or conn.length is None else "",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(conn.body.join()),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    for name, value in conn.headers:
        if name in ("content-length", "transfer-encoding"):
            continue  # the body is whole: CONTENT_LENGTH above says how long
        key = "CONTENT_TYPE" if name == "content-type" else "HTTP_" + name.upper().replace("-", "_")
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def frame_stream(
    conn: Conn, request: Request, data: bytes, headers: list[tuple[str, str]], last: bool, *, alive: bool
) -> None:
    """Add a streamed answer's next bytes to ``conn.pending``: its head first, each piece as a chunk (HTTP/1.1), the
    last chunk once ``last``. ``alive``: whether the worker still keeps connections open."""
    if conn.state == State.APP:  # the answer's first bytes: its head
        conn.chunked = request.environ["SERVER_PROTOCOL"] == "HTTP/1.1"
        # HTTP/1.0 has no chunked framing: the end of the body is the connection's close.
        conn.keep_alive = conn.keep_alive and conn.chunked and alive
        names = {name.lower() for name, _ in headers}
        lines = ["HTTP/1.1 200 OK", *(f"{name}: {value}" for name, value in headers)]
        if conn.chunked and "transfer-encoding" not in names:
            lines.append("Transfer-Encoding: chunked")
        lines.append("Connection: " + ("keep-alive" if conn.keep_alive else "close"))
        conn.pending = bytearray(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        conn.state, conn.ended, conn.deadline = State.STREAM, False, 0.0
        if request.head_only:
            data, conn.chunked = b"", False
    if data:
        conn.pending += b"%x\r\n%b\r\n" % (len(data), data) if conn.chunked else data
    if last:
        conn.ended = True
        if conn.chunked:
            conn.pending += b"0\r\n\r\n"
        conn.keep_alive = conn.keep_alive and alive
