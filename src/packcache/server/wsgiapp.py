"""What both WSGI applications of a worker share: routes by path and method, the request body, errors, figures.

:class:`WSGIApp` answers 404 for a path it does not serve and 405 (with ``Allow``) for a known path and another
method, answers its ``GET`` routes (``/healthz``, ``/health``, ``/v1/models``, ``/metrics`` and any of its own)
without the model, reads and bounds the JSON body of its ``POST`` routes, turns every bad request into a 4xx and
every failure into a logged 500 in the error shape of the API it was sent to, and counts each answer on
``/metrics``. A subclass (:class:`~packcache.server.app.EmbeddingApp`,
:class:`~packcache.server.completions.CompletionApp`) holds only its API: its routes, what it runs, and the
declared model of each route's body (:mod:`.requests`), which checks every field.

``GET /health`` is the probe TEI, vLLM and TGI answer: 200 with an empty body whenever ``/healthz`` answers
``ok``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .. import _defaults
from .._boundedjson import loads
from ..errors import FormatError

__all__ = ["Answer", "Call", "Limits", "Refusal", "StartResponse", "WSGIApp", "openai_error"]

logger = logging.getLogger("packcache.server")

StartResponse = Callable[..., Any]
#: An answer: the status line, headers, body.
Answer = tuple[str, list[tuple[str, str]], bytes]

_STATUS = {
    200: "200 OK",
    400: "400 Bad Request",
    404: "404 Not Found",
    405: "405 Method Not Allowed",
    413: "413 Content Too Large",
    422: "422 Unprocessable Content",
    500: "500 Internal Server Error",
    503: "503 Service Unavailable",
}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how long its client may take (:mod:`.worker` keeps the deadlines).

    Attributes:
        max_texts: texts per request (256: a batch that takes seconds, not minutes, on one core).
        max_text_chars: characters per text (10,000; the model reads its first ``max_tokens`` tokens).
        max_body_bytes: bytes of request body (4 MiB).
        header_timeout: seconds for the request line and headers, from the connection being ready
            for a request (accepted, or its previous response sent); then 408, or a quiet close
            if nothing came.
        body_timeout: seconds for the whole body, from the end of the headers; then 408.
        send_timeout: seconds for the client to take the whole response; then the connection is closed.
        auto_truncate: truncate texts over the model's ``max_tokens`` on the OpenAI and TEI routes instead
            of refusing them (TEI's ``--auto-truncate``; a TEI request's ``truncate`` still wins).
    """

    max_texts: int = _defaults.MAX_TEXTS
    max_text_chars: int = _defaults.MAX_TEXT_CHARS
    max_body_bytes: int = _defaults.MAX_BODY_BYTES
    header_timeout: float = _defaults.HEADER_TIMEOUT
    body_timeout: float = _defaults.BODY_TIMEOUT
    send_timeout: float = _defaults.SEND_TIMEOUT
    auto_truncate: bool = False

    def __post_init__(self) -> None:
        for name in ("max_texts", "max_text_chars", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, not {value!r}")
        for name in ("header_timeout", "body_timeout", "send_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 3600:
                raise ValueError(f"Limits.{name} must be seconds in (0, 3600], not {value!r}")  # NaN fails too
        if not isinstance(self.auto_truncate, bool):
            raise ValueError(f"Limits.auto_truncate must be True or False, not {self.auto_truncate!r}")


class Refusal(Exception):
    """A bad request. ``param``, ``kind``: OpenAI's ``param`` and ``code``, or TEI's ``error_type`` (``kind``)."""

    def __init__(self, code: int, message: str, *, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.kind = kind


def openai_error(refusal: Refusal) -> bytes:
    """``refusal`` in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "server_error" if refusal.code >= 500 else "invalid_request_error"
    code = refusal.kind if refusal.kind not in (None, "Validation", "Backend", "Empty") else None
    return json.dumps({"error": {"message": str(refusal), "type": kind, "param": refusal.param, "code": code}}).encode()


@dataclass
class Call:
    """One request in :meth:`WSGIApp.prepare`: the headers its answer gets, and the API shape of its errors."""

    shape: str
    headers: list[tuple[str, str]] = field(default_factory=list)


class WSGIApp:
    """The WSGI callable's frame. ``metrics`` is a :class:`~packcache.server.metrics.WorkerMetrics` (or anything
    with its ``publish``/``observe``); ``exposition`` returns the ``/metrics`` body and type.

    A subclass names its routes in ``methods`` (path: method), the shape of an error before its route chose one
    (``shape``, or per route ``route_shapes``: what the worker's own refusals of a route's requests take), how deep its
    JSON may nest, and implements :meth:`_request` (a ``POST`` route) and
    :meth:`_alone` (a prepared request under a WSGI server other than the worker).
    """

    methods: ClassVar[dict[str, str]] = {"/v1/models": "GET", "/metrics": "GET", "/healthz": "GET", "/health": "GET"}
    shape: ClassVar[str] = "openai"
    route_shapes: ClassVar[dict[str, str]] = {}
    max_json_depth: ClassVar[int] = 4
    empty_body: ClassVar[str] = "send a JSON body"

    def __init__(
        self, engine: Any, metrics: Any, exposition: Callable[[], tuple[bytes, str]], limits: Limits | None
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.exposition = exposition
        self.limits = limits or Limits()
        self.pid = os.getpid()
        self.created = int(time.time())
        metrics.publish(engine.stats())

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        prepared = self.prepare(environ)
        status, headers, body = prepared if isinstance(prepared, tuple) else self._alone(prepared)
        start_response(status, headers)
        return [body]

    def refused(self, route: str, code: int, seconds: float) -> None:
        """Count a request the worker answered itself (408, 413, ...), as :meth:`prepare` counts its own."""
        self.metrics.observe(route if route in self.methods else "other", code, seconds)

    def refusal_body(self, route: str, code: int, message: str) -> bytes:
        """The body of an answer the worker gives a request on ``route`` itself (408, 413, 503 of its body budget, the
        500 of a failed call), in the error shape of the route's API, as :meth:`prepare` answers its own refusals: an
        OpenAI client reads an OpenAI error whoever refused its request."""
        # pinned by tests/test_server_requests.py::test_a_body_over_the_limit_is_refused_in_the_routes_own_error_shape
        return self._error(self.route_shapes.get(route, self.shape), Refusal(code, message))

    def prepare(self, environ: dict[str, Any]) -> Any:
        """Read and check a request: its answer, or what the subclass makes of a ``POST`` route (:meth:`_request`).
        Never raises: a bad request is a 4xx answer, a failure a 500."""
        started = time.perf_counter()
        path = environ.get("PATH_INFO") or "/"
        route = path if path in self.methods else "other"
        call = Call(self.route_shapes.get(route, self.shape))
        try:
            if route == "other":
                listed = ", ".join(f"{m} {p}" for p, m in self.methods.items())
                raise Refusal(404, f"not found: the routes are {listed}")
            method = environ.get("REQUEST_METHOD", "GET")
            if method != self.methods[route]:
                call.headers.append(("Allow", self.methods[route]))
                raise Refusal(405, f"{route} takes {self.methods[route]}, not {method[:16]}")
            if method == "POST":
                return self._request(route, environ, started, call)
            code, body, content_type = 200, *self._info(route)
        except Refusal as refusal:
            code, body, content_type = refusal.code, self._error(call.shape, refusal), "application/json"
        except Exception:  # a request must never take the worker down
            logger.exception("packcache serve: %s %s failed", environ.get("REQUEST_METHOD"), route)
            code, body, content_type = 500, self._error(call.shape, _internal()), "application/json"
        return self._answer(route, code, body, content_type, call.headers, started)

    # ------------------------------------------------------------ what a subclass serves

    def _request(self, route: str, environ: dict[str, Any], started: float, call: Call) -> Any:
        """A ``POST`` route's prepared request; ``call.shape`` names its errors' shape once the route knows it."""
        raise NotImplementedError

    def _alone(self, prepared: Any) -> Answer:
        """The answer of a prepared request when no worker batches or generates (any other WSGI server)."""
        raise NotImplementedError

    def _error(self, shape: str, refusal: Refusal) -> bytes:
        """The body of ``refusal`` in the API ``shape`` its request was sent to."""
        return openai_error(refusal)

    def _model_card(self) -> dict[str, Any]:
        """The served model, as ``GET /v1/models`` lists it."""
        return {"id": self.engine.model_id, "object": "model", "created": self.created, "owned_by": "packcache"}

    def _other_info(self, route: str) -> dict[str, Any]:
        """The answer of a ``GET`` route of the subclass's own."""
        raise NotImplementedError

    def _refresh(self) -> None:
        """Figures to bring up to date before ``/metrics`` is scraped (beyond the cache's)."""

    # ------------------------------------------------------------ answers and figures

    def _answer(
        self, route: str, code: int, body: bytes, content_type: str, headers: list[tuple[str, str]], started: float
    ) -> Answer:
        self._observe(route, code, started)
        return _STATUS[code], [*headers, ("Content-Type", content_type), ("Content-Length", str(len(body)))], body

    def _observe(self, route: str, code: int, started: float) -> None:
        try:
            self.metrics.observe(route, code, time.perf_counter() - started)
            self.metrics.publish(self.engine.stats())
        except Exception:  # metrics are reported, never a reason to fail the request
            logger.exception("packcache serve: updating the metrics failed")

    def _info(self, route: str) -> tuple[bytes, str]:
        if route == "/metrics":
            self._refresh()
            self.metrics.publish(self.engine.stats())
            return self.exposition()
        engine = self.engine
        if route in ("/healthz", "/health"):
            stats = engine.stats()
            check = engine.file_check.current()
            if check.damaged:
                # A damaged pack serves wrong answers with status 200: the node must leave the load balancer (a
                # degraded cache, or a check that could not run, still answers right). pinned by
                # tests/test_server_filecheck.py::test_a_server_of_a_damaged_file_says_so_in_healthz_metrics_and_its_log
                raise Refusal(503, check.reason, kind="Unhealthy")
            answer: dict[str, Any] = {
                "status": "ok", "pid": self.pid, "engine": engine.name, "scheme": engine.scheme,
                "state": stats.state if stats is not None else None,
                "heap_reason": stats.heap_reason if stats is not None else None, "file_check": check.state,
            }  # fmt: skip
        elif route == "/v1/models":
            answer = {"object": "list", "data": [self._model_card()]}
        else:
            answer = self._other_info(route)
        if route == "/health":  # TEI's (and vLLM's, TGI's) probe: /healthz's status, no body
            # pinned by tests/test_server_api.py::test_teis_health_probe_gets_200_with_an_empty_body
            return b"", "text/plain; charset=utf-8"
        return json.dumps(answer).encode(), "application/json"

    # ------------------------------------------------------------ the request body

    def _json(self, environ: dict[str, Any]) -> Any:
        """The request's JSON body, nested at most ``max_json_depth`` deep."""
        try:
            return loads(self._body(environ), what="request body", max_depth=self.max_json_depth)
        except FormatError as exc:
            raise Refusal(400, str(exc)) from None

    def _body(self, environ: dict[str, Any]) -> bytes:
        limit = self.limits.max_body_bytes
        length_text = environ.get("CONTENT_LENGTH") or ""
        stream = environ["wsgi.input"]
        if length_text:
            if not length_text.isdigit() or len(length_text) > 18:
                raise Refusal(400, "Content-Length is not a byte count")
            length = int(length_text)
            if length > limit:
                raise Refusal(413, f"the body is {length} bytes; at most {limit} are accepted")
            body: bytes = stream.read(length)
        else:
            body = stream.read(limit + 1)  # chunked: read one byte past the limit to know
            if len(body) > limit:
                raise Refusal(413, f"the body is over {limit} bytes")
        if not body:
            raise Refusal(400, self.empty_body)
        return body


def _internal() -> Refusal:
    return Refusal(500, "internal error (logged by the worker)", kind="Backend")
