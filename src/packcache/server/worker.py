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

The request line, headers and body are read by h11 and checked where h11 is more lenient
(:mod:`._http1`); the lanes and the batching of the ``main`` lane are :mod:`._lanes`'s; what a lane's
thread runs, and how an answer becomes the bytes the loop sends, :mod:`._calls`'s.

Deadlines (:class:`~packcache.server.wsgiapp.Limits`), each checked by the loop, so a client that
trickles one byte at a time meets them as one that sends nothing:

* ``header_timeout``: the request line and headers, from the moment the connection is ready
  for a request (accepted, or its previous response sent). Past it: ``408`` if any byte of
  the request came, else the connection is closed (an idle kept-alive connection).
* ``body_timeout``: the whole body, from the end of the headers. Past it: ``408``.
* ``send_timeout``: the whole response, from when it is ready. Past it the connection is
  closed (a client that does not read its answer).

Malformed and oversized requests are refused before the application sees them (:mod:`._http1`).

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
that hangs gets its worker replaced. Slow clients never get it killed.

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
import os
import queue
import resource
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

import h11
from gunicorn.workers.base import Worker  # type: ignore[import-untyped]

from ._calls import AppCalls
from ._http1 import (
    MAX_HEAD_BYTES,
    Body,
    Conn,
    HttpRefusal,
    Request,
    State,
    frame_stream,
    parse_body,
    parse_head,
    wsgi_environ,
)  # fmt: skip
from ._lanes import BatchLane, GenerateLane, Lane
from .app import Batching
from .wsgiapp import Limits

__all__ = ["BufferingWorker", "worker_class"]

#: With batching, a worker accepts new connections while fewer requests than this wait for its model. One
#: accepted at a time (accept, read the request, stop: it waits) took 32 kept-alive clients a connection per
#: forward, and the last ones waited seconds in the kernel's queue (benchmarks/serve.py, p99 13.9 s at 32 clients);
#: no bound lets one worker take a whole burst another worker could serve.
ACCEPT_WAITING = 8
LINGER_SECONDS = 2.0  # after an error answer: read and drop what the client still sends, so it gets the answer
_READ = 65536

_RETRY = (("Retry-After", "1"),)
_BIGGEST = "the worker's memory for request bodies is full and this is the biggest body still arriving; retry"
_SERVED = "the worker's memory for request bodies is held by requests being served; retry"


class BufferingWorker(Worker):  # type: ignore[misc]
    """A gunicorn worker that reads whole requests in an event loop before running the application.

    ``limits`` (a class attribute: :func:`worker_class` makes a subclass with the server's) gives
    the body limit and the three client deadlines. The application may name the requests that
    skip the model's queue in ``express_routes``: a set of ``(method, path)``.
    """

    limits: Limits = Limits()
    batching: Batching = Batching()

    def init_process(self) -> None:
        self.conns: dict[int, Conn] = {}
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
        self.calls = AppCalls(self.wsgi, self.log, lambda: bool(self.alive), self._wake)
        express: Iterable[tuple[str, str]] = getattr(self.wsgi, "express_routes", ())
        self.express_routes: frozenset[tuple[str, str]] = frozenset(express)
        batched = self.batching.enabled and hasattr(self.wsgi, "prepare") and hasattr(self.wsgi, "complete")
        self.main: Lane
        if getattr(self.wsgi, "generation_routes", None):
            self.main = GenerateLane(self.wsgi.engine, self.calls.start_generation)
        elif batched:
            self.main = BatchLane(self.calls.prepare, self.calls.complete, self.batching, lambda: self.could_send > 0)
        else:
            self.main = Lane("main", self.calls.call, own_thread=False)
        self.express = Lane("express", self.calls.call)
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
        self._wake()

    def _wake(self) -> None:
        """Wake the loop's thread (gunicorn's wake-up pipe), from any thread."""
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
        deadlines = [c.deadline for c in self.conns.values() if c.state != State.APP and c.deadline]
        return max(0.0, min([1.0, *(d - now for d in deadlines)]))

    def _count_could_send(self, now: float) -> None:
        """How many connections may send a request soon: sending one, or answered within the last second (a
        client in a loop). The batcher waits for more requests only while there is one (``batch_wait``)."""
        if self.main.pending:
            self.could_send = sum(
                1 for c in self.conns.values()
                if c.state == State.BODY or (c.state == State.HEAD and (c.buf or (c.served and now - c.began < 1.0)))
            )  # fmt: skip

    def _may_accept(self, now: float) -> bool:
        # With batching, while fewer than ACCEPT_WAITING requests wait for the model's lane (a forward may run:
        # a request accepted now joins the next one); without, only while the lane is idle, as a sync worker
        # accepts only when free. Either way the kernel hands new connections to workers with room. A stalled
        # client never makes the lane busy.
        batched = isinstance(self.main, BatchLane)
        waiting = self.main.pending - (self.main.running if batched else 0)
        room = ACCEPT_WAITING if batched else 1
        if isinstance(self.main, GenerateLane):  # the engine's sequences, and a few more reading or queued
            room = self.main.engine.max_seqs + ACCEPT_WAITING
        # pinned by tests/test_server_api.py::test_kept_alive_clients_connecting_at_once_are_all_served_soon
        if not self.alive or waiting >= room or now < self.accept_paused_until:
            return False
        return len(self.conns) < self.max_connections or any(c.state in State.EVICTABLE for c in self.conns.values())

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
            if conn.state == State.HEAD and not conn.buf and conn.served:
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
            conn: Conn = key.data
            if mask & selectors.EVENT_WRITE and conn.state == State.WRITE:
                self._send(conn)
            elif mask & selectors.EVENT_WRITE and conn.state == State.STREAM:
                self._send_stream(conn)
            elif mask & selectors.EVENT_READ:
                self._receive(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if c.state != State.APP and c.deadline and c.deadline <= now]:
            if conn.state == State.HEAD and not conn.buf:
                self._close(conn)  # nothing of a request came: an idle connection, closed quietly
            elif conn.state in (State.HEAD, State.BODY):
                what = "the request headers" if conn.state == State.HEAD else "the request body"
                limit = self.limits.header_timeout if conn.state == State.HEAD else self.limits.body_timeout
                self._refuse(conn, HttpRefusal(408, f"{what} did not arrive within {limit:g} s"))
            else:  # State.WRITE: the client does not take its answer; State.LINGER: done waiting
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
            conn = Conn(sock, peer if isinstance(peer, tuple) else (str(peer), 0), now)
            self.conns[sock.fileno()] = conn
            self._await_request(conn, now)
            self._receive(conn)

    def _evict_one(self) -> bool:
        """Close the oldest connection still sending a request (or lingering): room for a new one."""
        candidates = [c for c in self.conns.values() if c.state in State.EVICTABLE]
        if not candidates:
            return False
        self._close(min(candidates, key=lambda c: (c.state != State.LINGER, c.accepted)))
        return True

    def _watch(self, conn: Conn, events: int) -> None:
        if events == conn.events:
            return
        if not conn.events:
            self.selector.register(conn.sock, events, conn)
        elif not events:
            self.selector.unregister(conn.sock)
        else:
            self.selector.modify(conn.sock, events, conn)
        conn.events = events

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.generating is not None:  # the client went away (or was closed): its slot is freed at the next step
            self.calls.cancel(conn.generating)
        self._watch(conn, 0)
        self._release_body(conn)
        self.conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _release_body(self, conn: Conn) -> None:
        self.body_held -= conn.charged
        conn.charged = 0
        conn.body = Body()

    def _await_request(self, conn: Conn, now: float) -> None:
        conn.state, conn.deadline = State.HEAD, now + self.limits.header_timeout
        conn.method, conn.target, conn.headers, conn.length = "", "", [], 0
        # One parser per request: the answers are written by the loop, not through h11, so h11's own cycle
        # (start_next_cycle after our response) never applies; pipelined bytes go to the next request's parser.
        conn.parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        conn.fed, conn.framing = 0, bytearray()
        conn.began = now
        self._watch(conn, selectors.EVENT_READ)
        if conn.buf:  # pipelined: the next request's bytes already came
            self._advance(conn)

    def _receive(self, conn: Conn) -> None:
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
        if conn.state == State.LINGER:
            return  # dropped: the answer is sent, the client is still sending
        if conn.state in (State.APP, State.STREAM):  # pipelined: kept for after the answer, within a head's size
            conn.buf += data
            if len(conn.buf) > MAX_HEAD_BYTES:
                self._close(conn)
            return
        if conn.state == State.HEAD and not conn.buf:
            conn.began = time.monotonic()
        conn.buf += data
        self._advance(conn)

    def _advance(self, conn: Conn) -> None:
        """Parse what is buffered; hand a whole request to the application."""
        try:
            if conn.state == State.HEAD and not parse_head(conn, self.limits, alive=self.alive):
                return
            if conn.state == State.BODY and not parse_body(conn, self.limits, self._charge):
                return
        except HttpRefusal as refusal:
            self._refuse(conn, refusal)
            return
        self._start_app(conn)

    # ------------------------------------------------------------ the body budget

    def _charge(self, conn: Conn, size: int) -> None:
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
            arriving = [c for c in self.conns.values() if c.state == State.BODY and c.charged and c is not conn]
            victim = max(arriving, key=lambda c: (c.charged, -c.began), default=None)
            if victim is None:
                raise HttpRefusal(503, _SERVED, _RETRY)
            if (victim.charged, -victim.began) < needed:
                raise HttpRefusal(503, _BIGGEST, _RETRY)
            self._refuse(victim, HttpRefusal(503, _BIGGEST, _RETRY))
        self.body_held += size
        conn.charged += size

    # ------------------------------------------------------------ the application

    def _start_app(self, conn: Conn) -> None:
        environ = wsgi_environ(conn)
        conn.body = Body()  # the copy above is the application's; the budget stays held until it answers
        conn.state = State.APP
        lane = self.express if (conn.method, environ["PATH_INFO"]) in self.express_routes else self.main
        request = Request(conn, environ, conn.method == "HEAD")
        if isinstance(lane, GenerateLane):
            # A generation may wait and run for minutes: a client that closes meanwhile frees its slot.
            conn.generating = request
            self._watch(conn, selectors.EVENT_READ)
        else:
            self._watch(conn, 0)  # one request at a time: the next one waits in the kernel's buffer
        lane.submit(request)

    # ------------------------------------------------------------ generations

    def _cut_off(self) -> None:
        """A shutdown's grace is nearly over: end the generations still running (each answer ends with an error
        event), so their clients see the end of the stream rather than a connection reset."""
        self.cut_off = True
        if isinstance(self.main, GenerateLane) and self.main.pending:
            self.log.warning("packcache serve: ending %d generations: the shutdown's grace ran out", self.main.pending)
            self.main.cancel_all()

    def _finish_streams(self) -> None:
        while True:
            try:
                request, data, headers, last = self.calls.streamed.get_nowait()
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
            frame_stream(conn, request, data, headers, last, alive=bool(self.alive))
            self._send_stream(conn)

    def _send_stream(self, conn: Conn) -> None:
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

    def _finish_done(self) -> None:
        while True:
            try:
                request, response, keep_alive = self.calls.done.get_nowait()
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
            conn.state, conn.deadline = State.WRITE, time.monotonic() + self.limits.send_timeout
            conn.out = memoryview(response)
            self._send(conn)

    # ------------------------------------------------------------ answers

    def _send(self, conn: Conn) -> None:
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
        if conn.state == State.LINGER:
            self._linger(conn)
        elif conn.keep_alive and self.alive:
            self._await_request(conn, time.monotonic())
        elif conn.buf:
            self._linger(conn)  # pipelined bytes came: read them off before closing, or the answer may be lost
        else:
            self._close(conn)

    def _refuse(self, conn: Conn, refusal: HttpRefusal) -> None:
        """Answer ``refusal`` and close: the rest of this request (if any) is never read."""
        now = time.monotonic()
        self._release_body(conn)
        route = self._route(conn)
        recorder = getattr(self.wsgi, "refused", None)
        if recorder is not None:
            with contextlib.suppress(Exception):  # metrics never fail an answer
                recorder(route, refusal.code, now - conn.began)
        conn.out = memoryview(self.calls.refusal(route, refusal))
        conn.state, conn.keep_alive, conn.deadline = State.LINGER, False, now + self.limits.send_timeout
        conn.buf, conn.parser, conn.framing = bytearray(), None, bytearray()
        self._send(conn)

    def _route(self, conn: Conn) -> str:
        path = conn.target.partition("?")[0]
        return path[:64]  # the application's ``refused`` names it ("other" for a path it does not serve)

    def _linger(self, conn: Conn) -> None:
        # Closing with unread bytes in the receive buffer sends a reset, which can destroy the answer
        # before the client reads it: shut down our side, read and drop until the client closes.
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_WR)
        conn.state, conn.buf = State.LINGER, bytearray()
        conn.deadline = min(conn.deadline, time.monotonic() + LINGER_SECONDS)
        self._watch(conn, selectors.EVENT_READ)


def _cut_off_margin(cfg: Any) -> float:
    """Seconds before the end of a shutdown's grace at which the generations still running are ended: time to
    send their last bytes before gunicorn's master kills the worker."""
    return float(min(2.0, cfg.graceful_timeout / 4))


def worker_class(limits: Limits, batching: Batching | None = None) -> type[BufferingWorker]:
    """A :class:`BufferingWorker` subclass with the server's limits and batching (gunicorn instantiates it per
    worker)."""
    return type("PackcacheWorker", (BufferingWorker,), {"limits": limits, "batching": batching or Batching()})
