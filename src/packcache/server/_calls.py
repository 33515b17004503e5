"""What the lanes' threads run: the application on a whole request, and its answer as the bytes the loop sends.

The worker's loop (:mod:`.worker`) hands a request to a lane (:mod:`._lanes`); the lane's thread calls
:class:`AppCalls`, which runs the application (whole, or as the batcher's two halves, or a generation handed to
the engine) and puts the response on :attr:`AppCalls.done` (a generation's bytes on :attr:`AppCalls.streamed`),
then wakes the loop to send it. Whatever the application does, the request gets an answer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ._http1 import HttpRefusal, Request, refusal_response
from .llm import EngineStopping

__all__ = ["AppCalls"]


class AppCalls:
    """The application's side of a worker: ``wsgi`` the application, ``log`` gunicorn's logger, ``alive`` whether the
    worker still keeps connections open, ``wake`` wakes the loop."""

    def __init__(self, wsgi: Any, log: Any, alive: Callable[[], bool], wake: Callable[[], None]) -> None:
        self.wsgi, self.log, self._alive, self._wake = wsgi, log, alive, wake
        self.done: queue.SimpleQueue[tuple[Request, bytes, bool]] = queue.SimpleQueue()
        # a generation's bytes as the engine makes them: (request, bytes, headers of its answer, whether the last)
        self.streamed: queue.SimpleQueue[tuple[Request, bytes, list[tuple[str, str]], bool]] = queue.SimpleQueue()

    def start_generation(self, request: Request) -> None:
        """In the generation lane's reading thread: read the request and hand it to the engine, or answer it."""
        try:
            prepared = self.wsgi.prepare(request.environ)
        except BaseException as exc:
            self.fail(request, exc)
            return
        if isinstance(prepared, tuple):
            self.answer(request, prepared)
            return
        completion = prepared

        def sink(output: Any) -> None:  # in the engine's thread, once per step with new text, then once at the end
            taken = completion.take(output)
            last = output.finish_reason is not None
            if isinstance(taken, tuple):
                self.answer(request, taken)
            elif taken is not None and (taken or last):
                self.streamed.put((request, taken, completion.headers(), last))
                self._wake()

        try:
            request.generation = self.wsgi.engine.submit(completion.prompt, completion.sampling, sink)
        except EngineStopping as exc:
            # A shutdown's grace ran out while this request was still arriving: no failure, and another server (or
            # this one restarted) takes it. pinned by
            #   tests/test_server_llm.py::test_a_generation_a_stopping_engine_cannot_take_is_a_503_in_openais_shape
            self.log.info("packcache serve: a generation request came as the engine stopped: 503")
            route = str(request.environ.get("PATH_INFO", ""))
            refused = getattr(self.wsgi, "refused", None)
            if refused is not None:
                refused(route, 503, 0.0)
            refusal = HttpRefusal(503, f"{exc}: send it again", (("Retry-After", "1"),))
            self._deliver(request, self.refusal(route, refusal), False)
            return
        except BaseException as exc:
            self.fail(request, exc)
            return
        if request.cancelled:  # the client left while the request was read
            self.wsgi.engine.cancel(request.generation)

    def cancel(self, request: Request) -> None:
        """Cancel ``request``'s generation: its client went away (either thread may see it first)."""
        request.cancelled = True
        if request.generation is not None:
            self.wsgi.engine.cancel(request.generation)

    def call(self, request: Request) -> None:
        """Run the application on one request (in a lane's thread); the loop sends the answer."""
        try:
            answer = self._application(request.environ)
        except BaseException as exc:  # the lane must answer and go on whatever happens, or the worker stops accepting
            self.fail(request, exc)
            return
        self.answer(request, answer)

    def prepare(self, request: Request) -> Any:
        """The batcher's first half, in the ``main`` lane: the application's job for ``request``, or ``None``
        once the request is answered (a bad request, a route without the model)."""
        try:
            prepared = self.wsgi.prepare(request.environ)
        except BaseException as exc:
            self.fail(request, exc)
            return None
        if isinstance(prepared, tuple):
            self.answer(request, prepared)
            return None
        return prepared

    def complete(self, jobs: list[tuple[Request, Any]]) -> None:
        """The batcher's second half: one forward for every job, then each request's answer to the loop."""
        try:
            answers = self.wsgi.complete([job for _, job in jobs])
        except BaseException as exc:
            for request, _ in jobs[1:]:
                self.fail(request, Exception())
            self.fail(jobs[0][0], exc)
            return
        for (request, _), answer in zip(jobs, answers, strict=True):
            self.answer(request, answer)

    def answer(self, request: Request, answer: tuple[str, list[tuple[str, str]], bytes]) -> None:
        try:
            response, keep_alive = self._response(request, *answer)
        except Exception as exc:
            self.fail(request, exc)
            return
        self._deliver(request, response, keep_alive)

    def fail(self, request: Request, exc: BaseException) -> None:
        """Answer 500 and close, for an application that raised ``exc`` (logged)."""
        if not isinstance(exc, Exception) and threading.current_thread() is threading.main_thread():
            raise exc  # gunicorn's SIGABRT/SIGQUIT/SIGINT handlers exit from the main thread: a hung model included
        self.log.error("packcache serve: the application failed", exc_info=exc)
        route = str(request.environ.get("PATH_INFO", ""))
        self._deliver(request, self.refusal(route, HttpRefusal(500, "internal error (logged by the worker)")), False)

    def refusal(self, route: str, refusal: HttpRefusal) -> bytes:
        """The response of ``refusal``, an answer the worker gives a request on ``route`` itself, its body in the
        route's API error shape when the application names one (``refusal_body``), else ``{"error": ...}``."""
        shaped = getattr(self.wsgi, "refusal_body", None)
        body = None
        if shaped is not None:
            try:
                body = shaped(route, refusal.code, str(refusal))
            except Exception:  # an answer is owed whatever the application does
                self.log.exception("packcache serve: shaping an error body failed")
        return refusal_response(refusal, body)

    def _deliver(self, request: Request, response: bytes, keep_alive: bool) -> None:
        self.done.put((request, response, keep_alive))
        self._wake()

    def _response(
        self, request: Request, status: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[bytes, bool]:
        """The HTTP response bytes of an application's answer, and whether the connection stays open."""
        keep_alive = request.conn.keep_alive and self._alive()  # after the application: a SIGTERM meanwhile closes
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
