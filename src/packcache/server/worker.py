"""The gunicorn worker of ``packcache serve``: whole requests are read before the application sees one.

A ``sync`` worker reads a request from inside the application, so a client that sends the
headers and part of the body, then stalls, holds the worker until the master kills it for its
``timeout``; a handful of such clients stop every worker. Here an event loop
(:mod:`selectors`, in a thread of its own) owns every socket: it accepts, reads the request
line, headers and body without blocking, and hands a request to the application only once
the whole body is in memory. The application runs in one of two threads (*lanes*): ``main``
(the worker's main thread, see :meth:`BufferingWorker.run`) for the embedding routes and everything
else, ``express`` for the application's ``express_routes`` (``GET /healthz``, ``/metrics``, ...), so
neither a batch nor a slow client delays a probe or a scrape. The loop writes the response
without blocking too. A stalled client costs a buffer and a descriptor, never a thread.

Batching (:class:`~packcache.server.app.Batching`): the ``main`` lane takes every request queued for it
and runs their texts in one forward (the application's ``prepare`` and ``complete``), up to
``max_batch_tokens`` tokens; a request that would pass the budget waits for the next forward (one over
the budget alone runs alone). Requests that come while a forward runs are queued and make the next one:
under load batches form without waiting. Before a forward with room left the lane waits up to
``batch_wait`` for more, only while another connection of the worker could still send one (it is sending
a request, or it got an answer within the last second): a lone client never waits. ``max_batch_tokens=0``
turns batching off: one request per forward, as before.

Deadlines (:class:`~packcache.server.app.Limits`), each checked by the loop, so a client that
trickles one byte at a time meets them as one that sends nothing:

* ``header_timeout``: the request line and headers, from the moment the connection is ready
  for a request (accepted, or its previous response sent). Past it: ``408`` if any byte of
  the request came, else the connection is closed (an idle kept-alive connection).
* ``body_timeout``: the whole body, from the end of the headers. Past it: ``408``.
* ``send_timeout``: the whole response, from when it is ready. Past it the connection is
  closed (a client that does not read its answer).

HTTP/1.1 is read by h11 (pinned in the ``serve`` extra): the request line, headers,
``Content-Length`` and chunked bodies, keep-alive and pipelining. A new ``h11.Connection`` reads each
request; the loop writes the answers itself, and bytes that came after a request start the next
one's. h11 was chosen over httptools (llhttp, in C): it is pure Python and hands out one event at a
time, so a request is parsed only when its connection is ready for it (llhttp parses every pipelined
request in a buffer at once, with no pause from Python); it bounds the head (431) and answers 501 for
a transfer coding it cannot read. It costs about 50 us a request (a keep-alive GET took 239 against
185 us), nothing next to a forward.

Where h11 is more lenient than this worker, the worker checks what h11 parsed and refuses as before:
a bare LF ending a line, a folded header line, a control character in a field or a chunk extension,
two ``Content-Length`` fields (h11 merges equal ones), both ``Content-Length`` and
``Transfer-Encoding`` (h11 lets the coding win), chunked framing in HTTP/1.0, an HTTP version other
than 1.0 and 1.1, trailers ended by a bare LF, and the line, field and trailer limits below. h11 is
stricter in two ways, kept: an HTTP/1.1 request needs exactly one ``Host`` (400), and the target is
visible ASCII. One of h11's internals is read (how many bytes it holds unparsed, to find the chunked
framing between data; see :meth:`BufferingWorker._parsed`), which the pin and the tests hold.

Refused before the application sees them, with a JSON ``{"error": ...}`` and the connection
closed: a body over ``max_body_bytes`` (``413``, from ``Content-Length`` at once, without
reading it; for a chunked body as soon as it grows past the limit), a malformed request
line, header or chunk, both ``Content-Length`` and ``Transfer-Encoding``, two
``Content-Length`` headers (``400``), a transfer coding other than ``chunked`` (``501``),
headers over 32 KiB or 100 fields (``431``), an HTTP version other than 1.0 and 1.1
(``505``), an ``Expect`` other than ``100-continue`` (``417``). A chunk line and a trailer line are
at most 1 KiB, the trailers (read and dropped) 8 KiB.

Request bodies in memory are bounded per worker by a *body budget* (16 times ``max_body_bytes``),
charged with the bytes as they are received, never with a declared size (a ``Content-Length``,
a chunk's size line, ``Expect: 100-continue`` reserve nothing), and freed when the request is
answered, refused or its connection closes. When a body's next bytes would pass the budget, the
biggest body still arriving (the oldest of equals) is refused with ``503`` and
``Retry-After: 1``, the one whose bytes came if it is the biggest: clients that never finish
their bodies lose them before a small request is refused. Bodies the application holds are never
taken back; when they hold the budget, the body that needs room is refused.

The master's ``timeout`` still bounds the application: the loop tells the master it is
alive only while no request has been in the application longer than ``timeout``, so a model
that hangs gets its worker replaced, as before. Slow clients never get it killed.

A worker accepts a new connection only while fewer than :data:`ACCEPT_WAITING` (8) requests wait for its
``main`` lane (a forward may be running: a request accepted then joins the next forward), so the kernel
hands connections to the workers with room; with batching off, only while the lane is idle (as a ``sync``
worker does). It keeps at most
``max_connections`` open; past it, the oldest connection still sending its request is
closed for the new one. HTTP/1.1 connections are kept alive (one request at a time, an
idle connection closed after ``header_timeout``); ``Connection: close`` and HTTP/1.0 close.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import queue
import re
import resource
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

import h11
from gunicorn.workers.base import Worker  # type: ignore[import-untyped]

from .app import Batching, Limits

__all__ = ["BufferingWorker", "worker_class"]

MAX_HEAD_BYTES = 32 << 10  # request line and headers
MAX_FIELDS = 100
MAX_METHOD = 32
MAX_TARGET = 8192
MAX_CHUNK_LINE = 1024  # a chunk-size line with its extensions, and one trailer line
MAX_TRAILER_BYTES = 8 << 10
#: With batching, a worker accepts new connections while fewer requests than this wait for its model. One
#: accepted at a time (accept, read the request, stop: it waits) took 32 kept-alive clients a connection per
#: forward, and the last ones waited seconds in the kernel's queue (benchmarks/serve.py, p99 13.9 s at 32 clients);
#: no bound lets one worker take a whole burst another worker could serve.
ACCEPT_WAITING = 8
LINGER_SECONDS = 2.0  # after an error answer: read and drop what the client still sends, so it gets the answer
_READ = 65536

# What h11 lets through and this worker refuses, checked on the bytes h11 parsed (see _parse_head, _chunk_framing).
# Once every CRLF is taken out: a bare CR or LF, NUL, or any other control character but HTAB.
_BARE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_FOLD = re.compile(rb"\r\n[ \t]")  # obs-fold: a line that continues the one before
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([^\r]*?)[ \t]*(?=\r\n)", re.IGNORECASE)

_RETRY = (("Retry-After", "1"),)
_BIGGEST = "the worker's memory for request bodies is full and this is the biggest body still arriving; retry"
_SERVED = "the worker's memory for request bodies is held by requests being served; retry"
_REASONS = {
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


class _Refusal(Exception):
    """A request answered by the worker itself: its status, a message, and extra headers."""

    def __init__(self, code: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.headers = headers


# ---------------------------------------------------------------- one connection


_PIECE = 65536  # a body is kept in pieces of this size


class _Body:
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


_HEAD, _BODY, _APP, _WRITE, _LINGER = "head", "body", "app", "write", "linger"
_STREAM = "stream"  # a generation's answer, sent as the engine makes it
_EVICTABLE = (_HEAD, _BODY, _LINGER)  # still sending a request, or done: never one the application works on


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: tuple[Any, ...]
    accepted: float
    state: str = _HEAD
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
    body: _Body = field(default_factory=_Body)
    charged: int = 0  # bytes of the body budget this request holds
    length: int | None = None  # Content-Length; None: chunked
    parser: h11.Connection | None = None  # this request's parser: a new one for each request
    fed: int = 0  # bytes of ``buf`` (the head so far) already given to the parser
    framing: bytearray = field(default_factory=bytearray)  # chunked: bytes given to the parser since the last data
    # the response being written
    out: memoryview | None = None
    closed: bool = False
    served: int = 0  # responses written on this connection
    # a streamed answer (_STREAM): bytes not sent yet, chunked framing, whether its last bytes came
    pending: bytearray = field(default_factory=bytearray)
    chunked: bool = False
    ended: bool = False
    generating: _Request | None = None  # the generation this connection's answer comes from, until it ends


@dataclass(eq=False)
class _Request:
    conn: _Conn
    environ: dict[str, Any]
    head_only: bool
    lane: _Lane | None = None
    # a generation: the engine's id for it, and whether its client went away (either thread may see it first)
    generation: str | None = None
    cancelled: bool = False


class _Lane:
    """One application thread and its queue; ``started`` says since when its current request runs.

    ``own_thread=False``: the lane makes no thread; whoever calls :meth:`serve` runs it (the
    worker's main thread runs the ``main`` lane, see :meth:`BufferingWorker.run`).
    """

    def __init__(self, name: str, run: Callable[[_Request], None], *, own_thread: bool = True) -> None:
        self.queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self.pending = 0  # queued or running; the loop's thread alone changes it
        self.started: float | None = None
        self._run = run
        # The main thread must come back to the interpreter now and then: a signal the kernel gave
        # another thread (the loop's) interrupts no wait of the main thread, yet only the main thread
        # runs Python's signal handlers (gunicorn's SIGTERM handler among them).
        self._poll = None if own_thread else 0.05
        if own_thread:
            threading.Thread(target=self.serve, name=f"packcache-{name}", daemon=True).start()

    running = 0  # requests the lane has taken from its queue and not answered yet (its thread alone changes it)

    def submit(self, request: _Request) -> None:
        request.lane = self
        self.pending += 1
        self.queue.put(request)

    def serve(self) -> None:
        """Run the lane's requests until :meth:`stop`."""
        while True:
            request: _Request | None = None
            if not self._has_held():
                try:
                    request = self.queue.get(timeout=self._poll)
                except queue.Empty:
                    continue
                if request is None:
                    return
            self.started = time.monotonic()
            try:
                stopped = self._step(request)
            finally:
                self.started = None
                self.running = 0
            if stopped:
                return

    def _has_held(self) -> bool:
        """Whether work taken from the queue earlier waits to run (then :meth:`serve` steps without a request)."""
        return False

    def _step(self, request: _Request | None) -> bool:
        """Run one request; True when the lane was told to stop meanwhile."""
        assert request is not None
        self._run(request)
        return False

    def stop(self) -> None:
        self.queue.put(None)


class _BatchLane(_Lane):
    """The ``main`` lane with batching: every queued request up to the token budget, in one forward.

    ``prepare`` turns a request into a job (or answers it: a bad request never waits for a forward);
    ``complete`` runs a list of jobs and answers each. A job that does not fit the budget is held for
    the next forward, ahead of the queue, so requests are answered in the order they came.
    """

    def __init__(
        self,
        prepare: Callable[[_Request], Any],
        complete: Callable[[list[tuple[_Request, Any]]], None],
        batching: Batching,
        could_send: Callable[[], bool],
    ) -> None:
        super().__init__("main", lambda request: None, own_thread=False)
        self._prepare, self._complete, self._could_send = prepare, complete, could_send
        self._budget, self._wait = batching.max_batch_tokens, batching.batch_wait
        self._held: list[tuple[_Request, Any]] = []

    def _has_held(self) -> bool:
        return bool(self._held)

    def _step(self, first: _Request | None) -> bool:
        """One forward: gather jobs from ``first``, the held ones and the queue, then run them; True when told to
        stop."""
        jobs, self._held = self._held, []
        tokens = sum(job.tokens for _, job in jobs)
        incoming = [first] if first is not None else []
        self.running = len(jobs) + len(incoming)
        until = time.monotonic() + self._wait
        stopped = False
        request: _Request | None
        while True:
            for request in incoming:
                job = self._prepare(request)
                if job is None:
                    continue  # answered already
                if self._held or (jobs and tokens + job.tokens > self._budget):
                    self._held.append((request, job))
                else:
                    jobs.append((request, job))
                    tokens += job.tokens
            if self._held or tokens >= self._budget:
                break
            try:
                request = self.queue.get_nowait()
            except queue.Empty:
                left = until - time.monotonic()
                if left <= 0 or not jobs or not self._could_send():
                    break
                try:
                    request = self.queue.get(timeout=left)
                except queue.Empty:
                    break
            if request is None:
                stopped = True
                break
            self.running += 1
            incoming = [request]
        if jobs:
            self._complete(jobs)
        return stopped


class _GenerateLane(_Lane):
    """The ``main`` lane of a worker serving a causal LM: the engine's loop runs in the main thread (continuous
    batching: every running generation advances one token per step), and a thread of its own reads each request
    (:meth:`~packcache.server.completions.CompletionApp.prepare`: the JSON, the chat template, the tokenizer) and
    hands it to the engine, so a long prompt never holds a step.

    ``pending`` counts the generations from their request's arrival to their last bytes; ``started`` is when the
    engine's current step began (the master's ``timeout`` bounds a step, not a generation, which may run for
    minutes).
    """

    def __init__(self, engine: Any, start: Callable[[_Request], None]) -> None:
        self.engine = engine
        self.reader = _Lane("prepare", start)  # its own thread
        super().__init__("main", lambda request: None, own_thread=False)

    def submit(self, request: _Request) -> None:
        request.lane = self
        self.pending += 1
        self.reader.queue.put(request)

    @property
    def started(self) -> float | None:
        """Since when the engine's current step or the reading thread's request runs (the earlier)."""
        times = [t for t in (self.engine.busy_since(), self.reader.started) if t is not None]
        return min(times) if times else None

    @started.setter
    def started(self, value: float | None) -> None:
        pass  # :class:`_Lane` sets it; here it is the engine's and the reader's

    def serve(self) -> None:
        """Run the engine's loop (the worker's main thread) until :meth:`stop`."""
        self.engine.run()

    def stop(self) -> None:
        self.reader.stop()
        self.engine.stop(drain=False)

    def cancel_all(self) -> None:
        """End every generation now (a shutdown past its grace): each answer ends with an error event."""
        self.engine.stop(drain=False)


# ---------------------------------------------------------------- the worker


class BufferingWorker(Worker):  # type: ignore[misc]
    """A gunicorn worker that reads whole requests in an event loop before running the application.

    ``limits`` (a class attribute: :func:`worker_class` makes a subclass with the server's) gives
    the body limit and the three client deadlines. The application may name the requests that
    skip the model's queue in ``express_routes``: a set of ``(method, path)``.
    """

    limits: Limits = Limits()
    batching: Batching = Batching()

    def init_process(self) -> None:
        self.conns: dict[int, _Conn] = {}
        self.done: queue.SimpleQueue[tuple[_Request, bytes, bool]] = queue.SimpleQueue()
        # a generation's bytes as the engine makes them: (request, bytes, headers of its answer, whether the last)
        self.streamed: queue.SimpleQueue[tuple[_Request, bytes, list[tuple[str, str]], bool]] = queue.SimpleQueue()
        self.cut_off = False  # a shutdown's grace ran out for the generations: they were ended
        self.selector = selectors.DefaultSelector()
        self.accepting = False
        self.accept_paused_until = 0.0
        self.could_send = 0  # connections that may send a request soon (the loop counts them; the batcher reads)
        self.body_budget = 16 * self.limits.max_body_bytes
        self.body_held = 0
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.max_connections = max(8, min(1000, (soft if soft > 0 else 1024) - 64))
        super().init_process()  # loads the application, then calls run()

    # ------------------------------------------------------------ the loop

    def run(self) -> None:
        """The event loop runs in a thread of its own; this (the main) thread runs the ``main`` lane.

        The model must run in the main thread: torch's OpenMP pool (libgomp) keeps its threads
        spinning between parallel regions only for the process's initial thread. From any other
        thread each of a forward's ~50 parallel regions wakes sleeping threads, and one batch took
        twice as long with 2 torch threads (``benchmarks/serve.py``, 1 worker: 27 against a
        ``sync`` worker's 45 requests/s). Signals still reach the main thread: gunicorn's handlers
        run there between two requests or in the lane's wait, and its wake-up pipe wakes the loop.
        """
        express: Iterable[tuple[str, str]] = getattr(self.wsgi, "express_routes", ())
        self.express_routes: frozenset[tuple[str, str]] = frozenset(express)
        batched = self.batching.enabled and hasattr(self.wsgi, "prepare") and hasattr(self.wsgi, "complete")
        self.main: _Lane
        if getattr(self.wsgi, "generation_routes", None):
            self.main = _GenerateLane(self.wsgi.engine, self._start_generation)
        elif batched:
            self.main = _BatchLane(self._prepare, self._complete, self.batching, lambda: self.could_send > 0)
        else:
            self.main = _Lane("main", self._call_app, own_thread=False)
        self.express = _Lane("express", self._call_app)
        failed: list[BaseException] = []

        def loop() -> None:
            try:
                self._loop()
            except BaseException as exc:  # re-raised in the main thread, as gunicorn expects of run()
                failed.append(exc)
            finally:
                self.main.stop()  # the main thread leaves its lane once the loop has ended

        loop_thread = threading.Thread(target=loop, name="packcache-loop", daemon=True)
        loop_thread.start()
        self.main.serve()
        loop_thread.join()
        if failed:
            raise failed[0]

    def handle_exit(self, sig: int, frame: Any) -> None:
        # In the main thread, which may have been running the model when the signal came: the
        # loop's thread woke on gunicorn's wake-up pipe before ``alive`` changed, so wake it again.
        super().handle_exit(sig, frame)
        with contextlib.suppress(OSError):
            os.write(self.PIPE[1], b".")

    def _loop(self) -> None:
        for listener in self.sockets:
            listener.setblocking(False)
        self.selector.register(self.PIPE[0], selectors.EVENT_READ, None)
        stop_by: float | None = None
        try:
            while True:
                now = time.monotonic()
                if not self.alive and stop_by is None:
                    stop_by = now + self.cfg.graceful_timeout
                    self._stop_accepting_idle()
                if stop_by is not None and (not self.conns or now >= stop_by):
                    break
                if stop_by is not None and not self.cut_off and now >= stop_by - _cut_off_margin(self.cfg):
                    self._cut_off()  # the generations still running end with an error event, sent before the exit
                if self.ppid != os.getppid():
                    self.log.info("Parent changed, shutting down: %s", self)
                    break
                self._heartbeat(now)
                self._set_accepting(self._may_accept(now))
                for key, mask in self.selector.select(self._wait(now)):
                    self._dispatch(key, mask)
                self._finish_done()
                self._finish_streams()
                self._expire(time.monotonic())
                self._count_could_send(time.monotonic())
        finally:
            self.main.stop()
            self.express.stop()
            for conn in list(self.conns.values()):
                self._close(conn)
            self.selector.close()
            for listener in self.sockets:
                listener.close()

    def _heartbeat(self, now: float) -> None:
        # The master replaces a worker that stays silent for `timeout`: stay silent only when the
        # application itself has run one request that long (a hung model), never for a slow client.
        started = [t for t in (self.main.started, self.express.started) if t is not None]
        # pinned by
        # tests/test_server_worker.py::test_an_application_that_hangs_past_the_timeout_still_gets_its_worker_replaced
        if not started or now - min(started) < self.timeout:
            self.notify()

    def _wait(self, now: float) -> float:
        deadlines = [c.deadline for c in self.conns.values() if c.state != _APP and c.deadline]
        return max(0.0, min([1.0, *(d - now for d in deadlines)]))

    def _count_could_send(self, now: float) -> None:
        """How many connections may send a request soon: sending one, or answered within the last second (a
        client in a loop). The batcher waits for more requests only while there is one (``batch_wait``)."""
        if self.main.pending:
            self.could_send = sum(
                1 for c in self.conns.values()
                if c.state == _BODY or (c.state == _HEAD and (c.buf or (c.served and now - c.began < 1.0)))
            )  # fmt: skip

    def _may_accept(self, now: float) -> bool:
        # With batching, while fewer than ACCEPT_WAITING requests wait for the model's lane (a forward may run:
        # a request accepted now joins the next one); without, only while the lane is idle, as a sync worker
        # accepts only when free. Either way the kernel hands new connections to workers with room. A stalled
        # client never makes the lane busy.
        batched = isinstance(self.main, _BatchLane)
        waiting = self.main.pending - (self.main.running if batched else 0)
        room = ACCEPT_WAITING if batched else 1
        if isinstance(self.main, _GenerateLane):  # the engine's sequences, and a few more reading or queued
            room = self.main.engine.max_seqs + ACCEPT_WAITING
        # pinned by tests/test_server_api.py::test_kept_alive_clients_connecting_at_once_are_all_served_soon
        if not self.alive or waiting >= room or now < self.accept_paused_until:
            return False
        return len(self.conns) < self.max_connections or any(c.state in _EVICTABLE for c in self.conns.values())

    def _set_accepting(self, wanted: bool) -> None:
        if wanted == self.accepting:
            return
        for listener in self.sockets:
            if wanted:
                self.selector.register(listener, selectors.EVENT_READ, "listener")
            else:
                self.selector.unregister(listener)
        self.accepting = wanted

    def _stop_accepting_idle(self) -> None:
        """SIGTERM: no new connection; close kept-alive connections waiting for their next request; the rest
        finish. A connection accepted before the signal whose first request has not come yet is no idle one:
        its client sent (or is sending) a request, which gets its answer (or the header deadline)."""
        self._set_accepting(False)
        for conn in list(self.conns.values()):
            # pinned by
            # tests/test_server_worker.py::test_a_connection_accepted_before_sigterm_still_gets_the_answer_to_its_first_request  # noqa: E501
            if conn.state == _HEAD and not conn.buf and conn.served:
                self._close(conn)
            else:
                conn.keep_alive = False

    def _dispatch(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.data is None:  # the wake-up pipe: a signal, or an application thread finished
            with contextlib.suppress(OSError):
                while os.read(self.PIPE[0], 4096):
                    pass
        elif key.data == "listener":
            self._accept(key.fileobj)  # type: ignore[arg-type]
        else:
            conn: _Conn = key.data
            if mask & selectors.EVENT_WRITE and conn.state == _WRITE:
                self._send(conn)
            elif mask & selectors.EVENT_WRITE and conn.state == _STREAM:
                self._send_stream(conn)
            elif mask & selectors.EVENT_READ:
                self._receive(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if c.state != _APP and c.deadline and c.deadline <= now]:
            if conn.state == _HEAD and not conn.buf:
                self._close(conn)  # nothing of a request came: an idle connection, closed quietly
            elif conn.state in (_HEAD, _BODY):
                what = "the request headers" if conn.state == _HEAD else "the request body"
                limit = self.limits.header_timeout if conn.state == _HEAD else self.limits.body_timeout
                self._refuse(conn, _Refusal(408, f"{what} did not arrive within {limit:g} s"))
            else:  # _WRITE: the client does not take its answer; _LINGER: done waiting
                self._close(conn)

    # ------------------------------------------------------------ connections

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(64):
            # One at a time, each read at once: a request that came with its connection makes the model's
            # lane busy before the next accept, so a burst of connections is shared with the other workers.
            if not self._may_accept(time.monotonic()):
                return
            if len(self.conns) >= self.max_connections and not self._evict_one():
                return
            try:
                sock, peer = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.log.warning("packcache serve: cannot accept a connection (%s)", errno.errorcode[exc.errno])
                    if not self._evict_one():
                        self.accept_paused_until = time.monotonic() + 0.5  # not a busy loop on a full table
                        return
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    continue
                raise
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            now = time.monotonic()
            conn = _Conn(sock, peer if isinstance(peer, tuple) else (str(peer), 0), now)
            self.conns[sock.fileno()] = conn
            self._await_request(conn, now)
            self._receive(conn)

    def _evict_one(self) -> bool:
        """Close the oldest connection still sending a request (or lingering): room for a new one."""
        candidates = [c for c in self.conns.values() if c.state in _EVICTABLE]
        if not candidates:
            return False
        self._close(min(candidates, key=lambda c: (c.state != _LINGER, c.accepted)))
        return True

    def _watch(self, conn: _Conn, events: int) -> None:
        if events == conn.events:
            return
        if not conn.events:
            self.selector.register(conn.sock, events, conn)
        elif not events:
            self.selector.unregister(conn.sock)
        else:
            self.selector.modify(conn.sock, events, conn)
        conn.events = events

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.generating is not None:  # the client went away (or was closed): its slot is freed at the next step
            self._cancel(conn.generating)
        self._watch(conn, 0)
        self._release_body(conn)
        self.conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _release_body(self, conn: _Conn) -> None:
        self.body_held -= conn.charged
        conn.charged = 0
        conn.body = _Body()

    def _await_request(self, conn: _Conn, now: float) -> None:
        conn.state, conn.deadline = _HEAD, now + self.limits.header_timeout
        conn.method, conn.target, conn.headers, conn.length = "", "", [], 0
        # One parser per request: the answers are written by the loop, not through h11, so h11's own cycle
        # (start_next_cycle after our response) never applies; pipelined bytes go to the next request's parser.
        conn.parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        conn.fed, conn.framing = 0, bytearray()
        conn.began = now
        self._watch(conn, selectors.EVENT_READ)
        if conn.buf:  # pipelined: the next request's bytes already came
            self._advance(conn)

    def _receive(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:  # the client closed (or shut down its side) before a whole request came
            self._close(conn)
            return
        if conn.state == _LINGER:
            return  # dropped: the answer is sent, the client is still sending
        if conn.state in (_APP, _STREAM):  # pipelined: kept for after the answer, within a head's size
            conn.buf += data
            if len(conn.buf) > MAX_HEAD_BYTES:
                self._close(conn)
            return
        if conn.state == _HEAD and not conn.buf:
            conn.began = time.monotonic()
        conn.buf += data
        self._advance(conn)

    def _advance(self, conn: _Conn) -> None:
        """Parse what is buffered; hand a whole request to the application."""
        try:
            if conn.state == _HEAD and not self._parse_head(conn):
                return
            if conn.state == _BODY and not self._parse_body(conn):
                return
        except _Refusal as refusal:
            self._refuse(conn, refusal)
            return
        self._start_app(conn)

    # ------------------------------------------------------------ parsing

    def _next_event(self, conn: _Conn) -> Any:
        """h11's next event for ``conn``'s request; h11's refusals as this worker's."""
        assert conn.parser is not None
        try:
            return conn.parser.next_event()
        except h11.RemoteProtocolError as exc:
            # h11's messages quote the client's bytes: the answer names the fault without them.
            if conn.state != _HEAD:
                raise _Refusal(400, "a malformed chunked body") from None
            if exc.error_status_hint == 431:
                raise _Refusal(431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes") from None
            if exc.error_status_hint == 501:
                raise _Refusal(501, "the only transfer coding served is chunked") from None
            if "Host" in str(exc):  # RFC 9112 3.2: exactly one, in every HTTP/1.1 request
                raise _Refusal(400, "an HTTP/1.1 request needs exactly one Host header") from None
            raise _Refusal(400, "a malformed request line or header field") from None

    def _parse_head(self, conn: _Conn) -> bool:
        """Give the head's new bytes to h11; once it has the request line and headers, check what it let through."""
        assert conn.parser is not None
        if not conn.fed:
            while conn.buf[:2] == b"\r\n":  # RFC 9112 2.2: empty lines before a request line are ignored (h11 refuses)
                del conn.buf[:2]
            if not conn.buf or conn.buf == b"\r":  # a CRLF may be split between two reads
                return False
        conn.parser.receive_data(bytes(conn.buf[conn.fed :]))
        conn.fed = len(conn.buf)
        event = self._next_event(conn)
        if event is h11.NEED_DATA:
            return False
        assert isinstance(event, h11.Request)
        early = conn.parser.trailing_data[0]  # bytes after the head: the body's first ones, or a pipelined request
        head = bytes(conn.buf[: len(conn.buf) - len(early)])
        conn.buf, conn.fed = bytearray(), 0
        if len(head) > MAX_HEAD_BYTES + 4:
            raise _Refusal(431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes")
        # h11 splits lines at a bare LF, joins folded lines, and lets control characters but NUL through; a
        # proxy that reads them otherwise frames another request (RFC 9112 2.2, 5.2: refuse). pinned by
        # tests/test_server_framing.py::test_framing_h11_would_take_is_refused_as_before
        if _BARE.search(head.replace(b"\r\n", b"")):
            raise _Refusal(400, "a bare CR, LF, NUL or another control character in the request head")
        if _FOLD.search(head):
            raise _Refusal(400, "a header field folded over two lines (obs-fold)")
        version = event.http_version.decode("ascii")
        if version not in ("1.0", "1.1"):
            raise _Refusal(505, "HTTP/1.0 and HTTP/1.1 are served")
        conn.version = (int(version[0]), int(version[2]))
        if len(event.method) > MAX_METHOD or len(event.target) > MAX_TARGET:
            raise _Refusal(400, "a malformed request line")
        conn.method, conn.target = event.method.decode("ascii"), event.target.decode("latin-1")
        if head.count(b"\r\n") - 2 > MAX_FIELDS:
            raise _Refusal(431, f"more than {MAX_FIELDS} header fields")
        # h11 merges equal Content-Length fields and "2, 2" into one: two of them are refused (RFC 9112 6.3).
        lengths = _CONTENT_LENGTH.findall(head)
        if len(lengths) > 1:
            raise _Refusal(400, "more than one Content-Length")
        if lengths and not (lengths[0].isdigit() and len(lengths[0]) <= 18):
            raise _Refusal(400, "Content-Length is not a byte count")
        conn.headers = [(name.decode("ascii"), value.decode("latin-1")) for name, value in event.headers]
        self._framing(conn, early=bool(early))
        if conn.length is None:
            conn.framing = bytearray(early)  # h11 has them: the first chunk's size line, perhaps its data
        return True

    def _framing(self, conn: _Conn, *, early: bool) -> None:
        """How the body is delimited (RFC 9112 6.3), refused when ambiguous; 413 and 417 before any body.

        ``early``: bytes of the body came with the head (no ``100 Continue`` then)."""
        lengths = [v for n, v in conn.headers if n == "content-length"]
        codings = [v for n, v in conn.headers if n == "transfer-encoding"]
        tokens = {t.strip().lower() for n, v in conn.headers if n == "connection" for t in v.split(",")}
        conn.keep_alive = conn.version == (1, 1) and "close" not in tokens and self.alive
        limit = self.limits.max_body_bytes
        if codings:
            if lengths:  # h11 lets Transfer-Encoding win: a proxy that reads Content-Length frames another request
                raise _Refusal(400, "both Content-Length and Transfer-Encoding")
            if conn.version != (1, 1):
                raise _Refusal(400, "Transfer-Encoding in an HTTP/1.0 request")
            if [c.strip().lower() for c in ",".join(codings).split(",")] != ["chunked"]:
                raise _Refusal(501, "the only transfer coding served is chunked")
            conn.length = None
        elif lengths:
            if len(lengths) > 1:
                raise _Refusal(400, "more than one Content-Length")
            if not lengths[0].isdigit() or not lengths[0].isascii() or len(lengths[0]) > 18:
                raise _Refusal(400, "Content-Length is not a byte count")
            conn.length = int(lengths[0])
            if conn.length > limit:
                raise _Refusal(413, f"the body is {conn.length} bytes; at most {limit} are accepted")
        else:
            conn.length = 0
        expect = [v.strip().lower() for n, v in conn.headers if n == "expect"]
        if expect and expect != ["100-continue"]:
            raise _Refusal(417, "the only expectation served is 100-continue")
        conn.state, conn.deadline = _BODY, time.monotonic() + self.limits.body_timeout
        if expect and conn.length != 0 and conn.version == (1, 1) and not early:
            # The client waits for this before it sends the body (curl does, for bodies over 1 KiB). It
            # reserves nothing: the body is charged as it comes, like any other.
            with contextlib.suppress(OSError):
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _charge(self, conn: _Conn, size: int) -> None:
        """Count ``size`` bytes of ``conn``'s body, received and about to be kept, against the budget.

        Past the budget, refuse (503) the biggest body still arriving, the oldest of equals, until
        these bytes fit: another connection's, or ``conn``'s own (raised) if it would be the biggest.
        Bodies the application holds are never taken back; when they fill the budget, ``conn`` is refused.
        """
        # Bytes received, never a declared size: 20 clients each declaring 4 MiB and sending 1 byte held a
        # worker's whole budget and every small /embed got 503; pinned by tests/test_server_worker.py::
        # test_twenty_clients_each_sending_one_byte_of_a_declared_4_mib_body_never_stop_embed
        needed = (conn.charged + size, -conn.began)
        while self.body_held + size > self.body_budget:
            # The biggest first, so bodies that never finish cannot lock small requests out; pinned by
            # tests/test_server_worker.py::
            # test_clients_sending_real_bytes_past_the_body_budget_lose_the_biggest_bodies_and_memory_stays_bounded
            arriving = [c for c in self.conns.values() if c.state == _BODY and c.charged and c is not conn]
            victim = max(arriving, key=lambda c: (c.charged, -c.began), default=None)
            if victim is None:
                raise _Refusal(503, _SERVED, _RETRY)
            if (victim.charged, -victim.began) < needed:
                raise _Refusal(503, _BIGGEST, _RETRY)
            self._refuse(victim, _Refusal(503, _BIGGEST, _RETRY))
        self.body_held += size
        conn.charged += size

    def _parse_body(self, conn: _Conn) -> bool:
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
            event = self._next_event(conn)
            if event is h11.NEED_DATA:
                if chunked:
                    self._chunk_framing(conn, self._parsed(conn), waiting=True)
                return False
            if isinstance(event, h11.Data):
                if chunked:
                    self._chunk_framing(conn, self._parsed(conn) - len(event.data), waiting=False)
                    del conn.framing[: len(event.data)]
                self._charge(conn, len(event.data))
                conn.body.add(event.data)
            elif isinstance(event, h11.EndOfMessage):
                if chunked:
                    self._chunk_framing(conn, self._parsed(conn), waiting=False, trailers=True)
                conn.buf = bytearray(parser.trailing_data[0])  # a pipelined request's first bytes
                conn.parser, conn.framing = None, bytearray()
                return True
            else:  # pragma: no cover - h11 gives a request's body as Data and EndOfMessage only
                raise _Refusal(400, "a malformed request body")

    @staticmethod
    def _parsed(conn: _Conn) -> int:
        """How many bytes of ``conn.framing`` h11 has parsed: the rest waits in its buffer.

        h11 0.16 keeps that buffer in ``_receive_buffer``: its public ``trailing_data`` copies it, which for a body
        of 1-byte chunks would copy up to 64 KiB per chunk. Another h11 without it gets the copy, never a failure."""
        assert conn.parser is not None
        held = getattr(conn.parser, "_receive_buffer", None)
        unparsed = len(held) if held is not None else len(conn.parser.trailing_data[0])
        return len(conn.framing) - unparsed

    def _chunk_framing(self, conn: _Conn, parsed: int, *, waiting: bool, trailers: bool = False) -> None:
        """Check the chunked framing h11 parsed since the last data (``conn.framing[:parsed]``): a chunk's CRLF and
        the next size line, or the last chunk and the trailers; then drop it. 413 once a chunk's size passes the
        limit, before its data. ``waiting``: h11 needs more bytes (only whole lines are checked then).

        h11 takes any byte but LF in a chunk extension, ends the trailers at a bare LF, folds trailer lines, and
        bounds a line at 32 KiB only: each is refused here, as before h11. pinned by tests/test_server_framing.py::
        test_framing_h11_would_take_is_refused_as_before
        """
        if waiting:
            pending = conn.framing[parsed:]  # a line (or the trailers) h11 has not parsed yet
            if len(pending) - pending.rfind(b"\n") > MAX_CHUNK_LINE + 2 or len(pending) > MAX_TRAILER_BYTES:
                raise _Refusal(400, "a chunk line is too long, or too many trailer fields")
            parsed = conn.framing.rfind(b"\r\n", 0, parsed) + 2  # a chunk's CRLF may be half parsed
            if parsed < 2:
                return
        framing = bytes(conn.framing[:parsed])
        if not framing:
            return
        lines = framing.split(b"\r\n")
        if _BARE.search(framing.replace(b"\r\n", b"")) or (trailers and _FOLD.search(framing)):
            raise _Refusal(400, "a bare CR, LF, NUL or another control character in the chunked framing")
        if max(map(len, lines)) > MAX_CHUNK_LINE or len(framing) > MAX_TRAILER_BYTES + MAX_CHUNK_LINE:
            raise _Refusal(400, "a chunk line is too long, or too many trailer fields")
        if not trailers:
            size_line = next((line for line in reversed(lines) if line), b"")
            declared = int(size_line.partition(b";")[0], 16) if size_line else 0
            limit = self.limits.max_body_bytes
            if len(conn.body) + declared > limit:
                raise _Refusal(413, f"the body is over {limit} bytes")
        del conn.framing[:parsed]

    # ------------------------------------------------------------ the application

    def _start_app(self, conn: _Conn) -> None:
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
        conn.body = _Body()  # the copy above is the application's; the budget stays held until it answers
        conn.state = _APP
        lane = self.express if (conn.method, environ["PATH_INFO"]) in self.express_routes else self.main
        request = _Request(conn, environ, conn.method == "HEAD")
        if isinstance(lane, _GenerateLane):
            # A generation may wait and run for minutes: a client that closes meanwhile frees its slot.
            conn.generating = request
            self._watch(conn, selectors.EVENT_READ)
        else:
            self._watch(conn, 0)  # one request at a time: the next one waits in the kernel's buffer
        lane.submit(request)

    # ------------------------------------------------------------ generations

    def _start_generation(self, request: _Request) -> None:
        """In the generation lane's reading thread: read the request and hand it to the engine, or answer it."""
        try:
            prepared = self.wsgi.prepare(request.environ)
        except BaseException as exc:
            self._fail(request, exc)
            return
        if isinstance(prepared, tuple):
            self._answer(request, prepared)
            return
        completion = prepared

        def sink(output: Any) -> None:  # in the engine's thread, once per step with new text, then once at the end
            taken = completion.take(output)
            last = output.finish_reason is not None
            if isinstance(taken, tuple):
                self._answer(request, taken)
            elif taken is not None and (taken or last):
                self.streamed.put((request, taken, completion.headers(), last))
                with contextlib.suppress(OSError):
                    os.write(self.PIPE[1], b".")

        try:
            request.generation = self.wsgi.engine.submit(completion.prompt, completion.sampling, sink)
        except BaseException as exc:
            self._fail(request, exc)
            return
        if request.cancelled:  # the client left while the request was read
            self.wsgi.engine.cancel(request.generation)

    def _cancel(self, request: _Request) -> None:
        request.cancelled = True
        if request.generation is not None:
            self.wsgi.engine.cancel(request.generation)

    def _cut_off(self) -> None:
        """A shutdown's grace is nearly over: end the generations still running (each answer ends with an error
        event), so their clients see the end of the stream rather than a connection reset."""
        self.cut_off = True
        if isinstance(self.main, _GenerateLane) and self.main.pending:
            self.log.warning("packcache serve: ending %d generations: the shutdown's grace ran out", self.main.pending)
            self.main.cancel_all()

    def _finish_streams(self) -> None:
        while True:
            try:
                request, data, headers, last = self.streamed.get_nowait()
            except queue.Empty:
                return
            conn = request.conn
            if last:
                assert request.lane is not None
                request.lane.pending -= 1
                self._release_body(conn)
                if conn.generating is request:
                    conn.generating = None
            if conn.closed:
                continue
            if conn.state == _APP:  # the answer's first bytes: its head
                conn.chunked = request.environ["SERVER_PROTOCOL"] == "HTTP/1.1"
                # HTTP/1.0 has no chunked framing: the end of the body is the connection's close.
                conn.keep_alive = conn.keep_alive and conn.chunked and self.alive
                names = {name.lower() for name, _ in headers}
                lines = ["HTTP/1.1 200 OK", *(f"{name}: {value}" for name, value in headers)]
                if conn.chunked and "transfer-encoding" not in names:
                    lines.append("Transfer-Encoding: chunked")
                lines.append("Connection: " + ("keep-alive" if conn.keep_alive else "close"))
                conn.pending = bytearray(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
                conn.state, conn.ended, conn.deadline = _STREAM, False, 0.0
                if request.head_only:
                    data, conn.chunked = b"", False
            if data:
                conn.pending += b"%x\r\n%b\r\n" % (len(data), data) if conn.chunked else data
            if last:
                conn.ended = True
                if conn.chunked:
                    conn.pending += b"0\r\n\r\n"
                conn.keep_alive = conn.keep_alive and self.alive
            self._send_stream(conn)

    def _send_stream(self, conn: _Conn) -> None:
        """Send what a streamed answer has ready; a client that takes none of it for ``send_timeout`` is closed
        (its generation cancelled)."""
        sent_any = False
        try:
            while conn.pending:
                sent = conn.sock.send(conn.pending)
                del conn.pending[:sent]
                sent_any = True
        except (BlockingIOError, InterruptedError):
            if sent_any or not conn.deadline:
                conn.deadline = time.monotonic() + self.limits.send_timeout
            self._watch(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
            return
        except OSError:
            self._close(conn)
            return
        conn.deadline = 0.0  # nothing waits to be sent: a stream between two tokens has no deadline
        if not conn.ended:
            self._watch(conn, selectors.EVENT_READ)  # a client that closes cancels its generation
            return
        conn.served += 1
        conn.chunked = conn.ended = False
        if conn.keep_alive and self.alive:
            self._await_request(conn, time.monotonic())
        elif conn.buf:
            self._linger(conn)
        else:
            self._close(conn)

    def _call_app(self, request: _Request) -> None:
        """Run the application on one request (in a lane's thread); the loop sends the answer."""
        try:
            answer = self._application(request.environ)
        except BaseException as exc:  # the lane must answer and go on whatever happens, or the worker stops accepting
            self._fail(request, exc)
            return
        self._answer(request, answer)

    def _prepare(self, request: _Request) -> Any:
        """The batcher's first half, in the ``main`` lane: the application's job for ``request``, or ``None``
        once the request is answered (a bad request, a route without the model)."""
        try:
            prepared = self.wsgi.prepare(request.environ)
        except BaseException as exc:
            self._fail(request, exc)
            return None
        if isinstance(prepared, tuple):
            self._answer(request, prepared)
            return None
        return prepared

    def _complete(self, jobs: list[tuple[_Request, Any]]) -> None:
        """The batcher's second half: one forward for every job, then each request's answer to the loop."""
        try:
            answers = self.wsgi.complete([job for _, job in jobs])
        except BaseException as exc:
            for request, _ in jobs[1:]:
                self._fail(request, Exception())
            self._fail(jobs[0][0], exc)
            return
        for (request, _), answer in zip(jobs, answers, strict=True):
            self._answer(request, answer)

    def _answer(self, request: _Request, answer: tuple[str, list[tuple[str, str]], bytes]) -> None:
        try:
            response, keep_alive = self._response(request, *answer)
        except Exception as exc:
            self._fail(request, exc)
            return
        self._deliver(request, response, keep_alive)

    def _fail(self, request: _Request, exc: BaseException) -> None:
        """Answer 500 and close, for an application that raised ``exc`` (logged)."""
        if not isinstance(exc, Exception) and threading.current_thread() is threading.main_thread():
            raise exc  # gunicorn's SIGABRT/SIGQUIT/SIGINT handlers exit from the main thread: a hung model included
        self.log.error("packcache serve: the application failed", exc_info=exc)
        body = _error("internal error (logged by the worker)")
        response = (
            "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
        self._deliver(request, response, False)

    def _deliver(self, request: _Request, response: bytes, keep_alive: bool) -> None:
        self.done.put((request, response, keep_alive))
        with contextlib.suppress(OSError):
            os.write(self.PIPE[1], b".")  # wake the loop

    def _response(
        self, request: _Request, status: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[bytes, bool]:
        """The HTTP response bytes of an application's answer, and whether the connection stays open."""
        keep_alive = request.conn.keep_alive and self.alive  # after the application: a SIGTERM meanwhile closes
        names = {name.lower() for name, _ in headers}
        if "content-length" not in names:
            headers.append(("Content-Length", str(len(body))))
        headers.append(("Connection", "keep-alive" if keep_alive else "close"))
        lines = [f"HTTP/1.1 {status}", *(f"{name}: {value}" for name, value in headers)]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        code = int(status[:3])
        bodyless = request.head_only or code in (204, 304) or 100 <= code < 200
        return (head if bodyless else head + body), keep_alive

    def _application(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        answer: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[..., Any]:
            if answer and exc_info is None:
                raise RuntimeError("start_response called twice")
            answer[:] = [status, list(headers)]
            return lambda data: None  # the legacy write() callable: unused by this application

        result: Iterable[bytes] = self.wsgi(environ, start_response)
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        status, headers = answer
        for name, value in headers:
            if any(c in name + value for c in "\r\n\0"):
                raise ValueError("a response header with CR, LF or NUL")
        return str(status), headers, body

    def _finish_done(self) -> None:
        while True:
            try:
                request, response, keep_alive = self.done.get_nowait()
            except queue.Empty:
                return
            assert request.lane is not None
            request.lane.pending -= 1
            conn = request.conn
            self._release_body(conn)
            if conn.generating is request:
                conn.generating = None
            if conn.closed:
                continue
            conn.keep_alive = keep_alive and conn.keep_alive
            conn.state, conn.deadline = _WRITE, time.monotonic() + self.limits.send_timeout
            conn.out = memoryview(response)
            self._send(conn)

    # ------------------------------------------------------------ answers

    def _send(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            while conn.out:
                sent = conn.sock.send(conn.out)
                conn.out = conn.out[sent:]
        except (BlockingIOError, InterruptedError):
            self._watch(conn, selectors.EVENT_WRITE)
            return
        except OSError:
            self._close(conn)
            return
        conn.out = None
        conn.served += 1
        if conn.state == _LINGER:
            self._linger(conn)
        elif conn.keep_alive and self.alive:
            self._await_request(conn, time.monotonic())
        elif conn.buf:
            self._linger(conn)  # pipelined bytes came: read them off before closing, or the answer may be lost
        else:
            self._close(conn)

    def _refuse(self, conn: _Conn, refusal: _Refusal) -> None:
        """Answer ``refusal`` and close: the rest of this request (if any) is never read."""
        now = time.monotonic()
        self._release_body(conn)
        route = self._route(conn)
        recorder = getattr(self.wsgi, "refused", None)
        if recorder is not None:
            with contextlib.suppress(Exception):  # metrics never fail an answer
                recorder(route, refusal.code, now - conn.began)
        body = _error(str(refusal))
        lines = [
            f"HTTP/1.1 {refusal.code} {_REASONS[refusal.code]}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in refusal.headers),
        ]
        conn.out = memoryview(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        conn.state, conn.keep_alive, conn.deadline = _LINGER, False, now + self.limits.send_timeout
        conn.buf, conn.parser, conn.framing = bytearray(), None, bytearray()
        self._send(conn)

    def _route(self, conn: _Conn) -> str:
        path = conn.target.partition("?")[0]
        return path[:64]  # the application's ``refused`` names it ("other" for a path it does not serve)

    def _linger(self, conn: _Conn) -> None:
        # Closing with unread bytes in the receive buffer sends a reset, which can destroy the answer
        # before the client reads it: shut down our side, read and drop until the client closes.
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_WR)
        conn.state, conn.buf = _LINGER, bytearray()
        conn.deadline = min(conn.deadline, time.monotonic() + LINGER_SECONDS)
        self._watch(conn, selectors.EVENT_READ)


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def _cut_off_margin(cfg: Any) -> float:
    """Seconds before the end of a shutdown's grace at which the generations still running are ended: time to
    send their last bytes before gunicorn's master kills the worker."""
    return float(min(2.0, cfg.graceful_timeout / 4))


def worker_class(limits: Limits, batching: Batching | None = None) -> type[BufferingWorker]:
    """A :class:`BufferingWorker` subclass with the server's limits and batching (gunicorn instantiates it per
    worker)."""
    return type("PackcacheWorker", (BufferingWorker,), {"limits": limits, "batching": batching or Batching()})
