"""The WSGI application of one worker: ``POST /embed``, ``GET /metrics``, ``GET /healthz``.

No web framework: three routes, a JSON body, and checks that turn every bad request into
a 4xx with a JSON error (``{"error": "..."}``) instead of an exception in the worker.

* ``POST /embed`` with ``{"texts": ["...", ...]}`` answers ``{"embeddings": [[...], ...]}``:
  one L2-normalised float32 vector per text, in order, as JSON numbers (exact: each float32
  written as the shortest decimal that reads back as the same double). The header
  ``X-Packcache-Worker`` names the worker pid that computed it. Refused with 400: a body
  that is not JSON (or nested deeper than 4 levels, or an integer over 40 digits: parsed by
  :func:`packcache._boundedjson.loads`), not an object with exactly the key ``texts``, texts
  that are not a list of strings, more than ``max_texts`` texts, a text longer than
  ``max_text_chars`` characters or not encodable as UTF-8 (a lone surrogate). 413 for a
  body over ``max_body_bytes`` (read no further), 400 for an empty body or a bad ``Content-Length``.
  Under ``packcache serve`` the worker (:mod:`.worker`) has read the whole body before this runs
  and refuses framing problems, oversized bodies and clients past their deadlines (408) itself;
  these checks stay for any other WSGI server.
* ``GET /metrics``: the Prometheus exposition of every worker (:mod:`.metrics`); this
  worker's cache figures are written first, so the scraping worker is never stale.
* ``GET /healthz``: 200 ``{"status": "ok", ...}`` once the worker has loaded its model,
  whatever the cache's state. A ``degraded`` cache still serves correct embeddings (from
  heap) and a restart would not fix a full disk: that is for alerts on ``/metrics``, not
  for a health check that would take the worker out of rotation.

Anything else: 404, or 405 with ``Allow`` for a known path and another method. An
exception inside the model answers 500 and is logged; the worker keeps serving.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .._boundedjson import loads
from ..errors import FormatError
from .engines import Engine

__all__ = ["EmbeddingApp", "Limits"]

logger = logging.getLogger("packcache.server")

StartResponse = Callable[..., Any]

_STATUS = {
    200: "200 OK",
    400: "400 Bad Request",
    404: "404 Not Found",
    405: "405 Method Not Allowed",
    413: "413 Content Too Large",
    500: "500 Internal Server Error",
}
_METHODS = {"/embed": "POST", "/metrics": "GET", "/healthz": "GET"}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how long its client may take (:mod:`.worker` keeps the deadlines).

    Attributes:
        max_texts: texts per ``POST /embed`` (256: a batch that takes seconds, not minutes, on one core).
        max_text_chars: characters per text (10,000; the tokenizer keeps the first 256 tokens).
        max_body_bytes: bytes of request body (4 MiB).
        header_timeout: seconds for the request line and headers, from the connection being ready
            for a request (accepted, or its previous response sent); then 408, or a quiet close
            if nothing came.
        body_timeout: seconds for the whole body, from the end of the headers; then 408.
        send_timeout: seconds for the client to take the whole response; then the connection is closed.
    """

    max_texts: int = 256
    max_text_chars: int = 10_000
    max_body_bytes: int = 4 << 20
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    send_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_texts", "max_text_chars", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, not {value!r}")
        for name in ("header_timeout", "body_timeout", "send_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 3600:
                raise ValueError(f"Limits.{name} must be seconds in (0, 3600], not {value!r}")  # NaN fails too


class _Refusal(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class EmbeddingApp:
    """The WSGI callable. ``metrics`` is a :class:`~packcache.server.metrics.WorkerMetrics` (or
    anything with its ``publish``/``observe``); ``exposition`` returns the ``/metrics`` body and type.

    ``express_routes`` tells the worker (:mod:`.worker`) which requests never wait behind a batch.
    """

    express_routes = frozenset({("GET", "/healthz"), ("GET", "/metrics")})

    def __init__(
        self, engine: Engine, metrics: Any, exposition: Callable[[], tuple[bytes, str]], limits: Limits | None = None
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.exposition = exposition
        self.limits = limits or Limits()
        self.pid = os.getpid()
        metrics.publish(engine.stats())

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        started = time.perf_counter()
        path = environ.get("PATH_INFO") or "/"
        route = path if path in _METHODS else "other"
        headers: list[tuple[str, str]] = []
        try:
            code, body, content_type = self._dispatch(route, environ, headers)
        except _Refusal as refusal:
            code, body, content_type = refusal.code, _error(str(refusal)), "application/json"
        except Exception:  # a request must never take the worker down
            logger.exception("packcache serve: %s %s failed", environ.get("REQUEST_METHOD"), route)
            code, body, content_type = 500, _error("internal error (logged by the worker)"), "application/json"
        try:
            self.metrics.observe(route, code, time.perf_counter() - started)
            self.metrics.publish(self.engine.stats())
        except Exception:  # metrics are reported, never a reason to fail the request
            logger.exception("packcache serve: updating the metrics failed")
        headers += [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        start_response(_STATUS[code], headers)
        return [body]

    def refused(self, route: str, code: int, seconds: float) -> None:
        """Count a request the worker answered itself (408, 413, ...), as :meth:`__call__` counts its own."""
        self.metrics.observe(route if route in _METHODS else "other", code, seconds)

    def _dispatch(self, route: str, environ: dict[str, Any], headers: list[tuple[str, str]]) -> tuple[int, bytes, str]:
        if route == "other":
            raise _Refusal(404, "not found: the routes are POST /embed, GET /metrics, GET /healthz")
        method = environ.get("REQUEST_METHOD", "GET")
        if method != _METHODS[route]:
            headers.append(("Allow", _METHODS[route]))
            raise _Refusal(405, f"{route} takes {_METHODS[route]}, not {method[:16]}")
        if route == "/metrics":
            self.metrics.publish(self.engine.stats())
            body, content_type = self.exposition()
            return 200, body, content_type
        if route == "/healthz":
            return 200, self._health(), "application/json"
        texts = self._texts(environ)
        embeddings = self.engine.embed(texts)
        headers.append(("X-Packcache-Worker", str(self.pid)))
        body = json.dumps({"embeddings": embeddings.tolist()}, separators=(",", ":")).encode()
        return 200, body, "application/json"

    def _health(self) -> bytes:
        stats = self.engine.stats()
        return json.dumps({
            "status": "ok", "pid": self.pid, "engine": self.engine.name, "scheme": self.engine.scheme,
            "state": stats.state if stats is not None else None,
            "heap_reason": stats.heap_reason if stats is not None else None,
        }).encode()  # fmt: skip

    def _body(self, environ: dict[str, Any]) -> bytes:
        limit = self.limits.max_body_bytes
        length_text = environ.get("CONTENT_LENGTH") or ""
        stream = environ["wsgi.input"]
        if length_text:
            if not length_text.isdigit() or len(length_text) > 18:
                raise _Refusal(400, "Content-Length is not a byte count")
            length = int(length_text)
            if length > limit:
                raise _Refusal(413, f"the body is {length} bytes; at most {limit} are accepted")
            body: bytes = stream.read(length)
        else:
            body = stream.read(limit + 1)  # chunked: read one byte past the limit to know
            if len(body) > limit:
                raise _Refusal(413, f"the body is over {limit} bytes")
        if not body:
            raise _Refusal(400, 'send a JSON body: {"texts": ["..."]}')
        return body

    def _texts(self, environ: dict[str, Any]) -> list[str]:
        try:
            request = loads(self._body(environ), what="request body", max_depth=4)
        except FormatError as exc:
            raise _Refusal(400, str(exc)) from None
        if not isinstance(request, dict) or set(request) != {"texts"}:
            keys = [key[:40] for key in sorted(request)[:5]] if isinstance(request, dict) else None
            raise _Refusal(
                400, f'expected an object with exactly the key "texts", got {keys or type(request).__name__}'
            )
        texts = request["texts"]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise _Refusal(400, '"texts" must be a list of strings')
        limits = self.limits
        if len(texts) > limits.max_texts:
            raise _Refusal(400, f"{len(texts)} texts; at most {limits.max_texts} per request")
        for index, text in enumerate(texts):
            if len(text) > limits.max_text_chars:
                raise _Refusal(400, f"text {index} has {len(text)} characters; at most {limits.max_text_chars}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise _Refusal(400, f"text {index} is not valid Unicode (a lone surrogate)") from None
        return texts


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
