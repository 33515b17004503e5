"""The WSGI application of an embedding worker: OpenAI's and TEI's embedding APIs and this server's ``POST /embed``.

No web framework: a few routes, a JSON body, and one declared model per request shape (:mod:`.requests`) that
turns every bad request into a 4xx with a JSON error in the shape of the API it was sent to, instead of an
exception in the worker.

* ``POST /v1/embeddings`` (OpenAI's): ``{"input": str | [str, ...], "model": ..., "encoding_format":
  "float" | "base64", "dimensions": N, "user": ...}`` answers ``{"object": "list", "data": [{"object":
  "embedding", "index": i, "embedding": [...] | "<base64>"}], "model": ..., "usage": {"prompt_tokens": N,
  "total_tokens": N}}``. ``base64`` is the little-endian float32 bytes, as OpenAI sends them;
  ``dimensions`` keeps the first N values and L2-normalises them again (OpenAI's shortened embeddings),
  refused over the model's width. ``model`` must be the served name (:attr:`Engine.model_id`, listed by
  ``GET /v1/models``) or absent: another name is refused with 404 ``model_not_found``, as OpenAI and vLLM
  do (TEI ignores it), so a client never gets vectors of a model it did not ask for. Token-id inputs
  are refused (texts only). A text over the model's ``max_tokens`` is refused (OpenAI refuses over the
  context length) unless the server runs with ``--auto-truncate``. ``usage`` counts the tokens the
  model read (at most ``max_tokens`` per text). Errors: ``{"error": {"message", "type":
  "invalid_request_error", "param", "code"}}`` (OpenAI's shape), 400 (404 for an unknown model).
* ``POST /embed`` with TEI's ``{"inputs": str | [str, ...], "normalize": true, "truncate": false,
  "truncation_direction": "Right", "prompt_name": null}`` answers a bare ``[[...], ...]`` as TEI does.
  ``truncate`` defaults to ``--auto-truncate`` (off): a text over ``max_tokens`` is refused unless it
  is set. ``normalize: false`` gives the model's output before its Normalize module. ``prompt_name``
  prefixes one of the model's prompts (the model's default prompt when it has one and none is named).
  Errors in TEI's shape and codes: ``{"error": "...", "error_type": "Validation"}`` with 413 (too many
  inputs, a text too long), 400 ``Empty`` (no input), 422 (a field of the wrong type).
* ``POST /embed`` with ``{"texts": ["...", ...]}`` (this server's own shape) answers ``{"embeddings":
  [[...], ...]}``: one L2-normalised float32 vector per text, in order; texts over ``max_tokens`` are
  truncated, as always. Refused with 400 and ``{"error": "..."}``: not an object with exactly the key
  ``texts``, texts that are not a list of strings. A body that is neither shape is answered in this one.
* Every embedding route: at most ``max_texts`` texts of at most ``max_text_chars`` characters, each
  encodable as UTF-8; a body that is not JSON (or nested deeper than 4 levels, or an integer over
  40 digits: parsed by :func:`packcache._boundedjson.loads`) is refused (400); 413 for a body over
  ``max_body_bytes`` (read no further), 400 for an empty body or a bad ``Content-Length``. Vectors are
  JSON numbers, exact (each float32 written as the shortest decimal that reads back as the same
  double). The header ``X-Packcache-Worker`` names the worker pid that computed them, and
  ``X-Packcache-Forward-Texts`` how many texts its forward carried (batching: this request's and others').
  Under ``packcache serve`` the worker (:mod:`.worker`) has read the whole body before this runs
  and refuses framing problems, oversized bodies and clients past their deadlines (408) itself;
  these checks stay for any other WSGI server.
* ``GET /v1/models``: ``{"object": "list", "data": [{"id": model_id, "object": "model", "created": ...,
  "owned_by": "packcache"}]}``. ``GET /info``: TEI's, with the fields that apply.
* ``GET /metrics``: the Prometheus exposition of every worker (:mod:`.metrics`); this
  worker's cache figures are written first, so the scraping worker is never stale.
* ``GET /healthz``: 200 ``{"status": "ok", ...}`` once the worker has loaded its model,
  whatever the cache's state. A ``degraded`` cache still serves correct embeddings (from
  heap) and a restart would not fix a full disk: that is for alerts on ``/metrics``, not
  for a health check that would take the worker out of rotation. ``GET /health``: TEI's probe,
  200 with an empty body when ``/healthz`` answers ``ok``.

Anything else: 404, or 405 with ``Allow`` for a known path and another method (``{"error": ...}``). An
exception inside the model answers 500 (in the route's error shape) and is logged; the worker keeps serving.

Batching: :meth:`EmbeddingApp.prepare` turns an embedding request into a :class:`Job` (its final texts,
their token count, how to answer), and :meth:`EmbeddingApp.complete` runs the jobs of several requests
in one forward (one ``engine.embed`` call per ``normalize`` value) and answers each. The worker
(:mod:`.worker`) gathers the jobs up to :class:`Batching`'s token budget; any other WSGI server calls
the application, which prepares and completes one request at a time.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .. import _defaults
from .engines import Engine
from .wsgiapp import Answer, Call, Limits, Refusal, WSGIApp, openai_error

if TYPE_CHECKING:  # pydantic: imported when a request is parsed, never by the command line
    from .requests import Bounds, EmbeddingsRequest, TEIEmbedRequest, TextsRequest

__all__ = ["Batching", "EmbeddingApp", "Job"]

logger = logging.getLogger("packcache.server")

_ROUTES = {
    "/embed": "POST",
    "/v1/embeddings": "POST",
    "/v1/models": "GET",
    "/info": "GET",
    "/metrics": "GET",
    "/healthz": "GET",
    "/health": "GET",
}
_LEGACY, _TEI, _OPENAI = "legacy", "tei", "openai"


@dataclass(frozen=True)
class Batching:
    """How a worker merges concurrent requests into one forward (:mod:`.worker`).

    Attributes:
        max_batch_tokens: tokens per forward (each text's, at most the model's ``max_tokens``; TEI's
            ``--max-batch-tokens`` and default, 16384). A request over it alone still runs, alone.
            0 turns batching off: one forward per request.
        batch_wait: seconds the model's thread may wait for more requests before a forward that still
            has room, and only while another connection of the worker could send one (1 ms): a lone
            client never waits. Requests that come while a forward runs join the next one without it.
    """

    max_batch_tokens: int = _defaults.MAX_BATCH_TOKENS
    batch_wait: float = _defaults.BATCH_WAIT

    def __post_init__(self) -> None:
        value = self.max_batch_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"Batching.max_batch_tokens must be a non-negative integer, not {value!r}")
        wait = self.batch_wait
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= 1:
            raise ValueError(f"Batching.batch_wait must be seconds in [0, 1], not {wait!r}")

    @property
    def enabled(self) -> bool:
        return self.max_batch_tokens > 0


@dataclass(eq=False)
class Job:
    """One request's texts, waiting for a forward, and how to answer it (:meth:`EmbeddingApp.complete`).

    Attributes:
        texts: the final texts (prompts applied), as the engine embeds them.
        tokens: the tokens the model reads for them (each at most ``max_tokens``): the batch budget's count.
        normalize: L2-normalised rows, or the model's output before its Normalize module.
    """

    texts: list[str]
    tokens: int
    normalize: bool
    route: str
    api: str
    started: float
    answer: Callable[[np.ndarray[Any, Any]], bytes] = field(repr=False)


class EmbeddingApp(WSGIApp):
    """The WSGI callable of an embedding worker (:class:`~packcache.server.wsgiapp.WSGIApp` holds what it shares
    with the generation worker's).

    ``express_routes`` tells the worker (:mod:`.worker`) which requests never wait behind a batch.
    :meth:`prepare` and :meth:`complete` are the two halves of a request the worker's batcher uses.
    """

    methods = _ROUTES
    route_shapes: ClassVar[dict[str, str]] = {"/v1/embeddings": _OPENAI}
    shape = _LEGACY
    engine: Engine
    empty_body = 'send a JSON body: {"texts": ["..."]}, {"inputs": ...} or {"input": ...}'
    express_routes = frozenset({("GET", "/healthz"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
                                ("GET", "/info")})  # fmt: skip

    def __init__(
        self,
        engine: Engine,
        metrics: Any,
        exposition: Callable[[], tuple[bytes, str]],
        limits: Limits | None = None,
        batching: Batching | None = None,
    ) -> None:
        self.batching = batching or Batching()
        super().__init__(engine, metrics, exposition, limits)

    def prepare(self, environ: dict[str, Any]) -> Answer | Job:
        """Read and check a request: its answer, or for an embedding request the :class:`Job` to run
        (:meth:`complete`). Never raises: a bad request is a 4xx answer, a failure a 500."""
        prepared: Answer | Job = super().prepare(environ)
        return prepared

    def _request(self, route: str, environ: dict[str, Any], started: float, call: Call) -> Job:
        from . import requests  # pydantic: imported by the master before it forks (engines.preimport), never by the CLI

        if route == "/v1/embeddings":  # call.shape: OpenAI's (route_shapes)
            return self._openai(requests.parse(requests.EmbeddingsRequest, self._json(environ), self.bounds()),
                                route, started)  # fmt: skip
        request = self._json(environ)  # /embed: TEI's shape or this server's own
        call.shape = _TEI if isinstance(request, dict) and "inputs" in request else _LEGACY
        if call.shape == _TEI:
            return self._tei(requests.parse(requests.TEIEmbedRequest, request, self.bounds()), route, started)
        return self._legacy(requests.parse(requests.TextsRequest, request, self.bounds()), route, started)

    def bounds(self) -> Bounds:
        """What one request may ask for (:class:`~packcache.server.requests.Bounds`)."""
        from .requests import Bounds

        engine, limits = self.engine, self.limits
        return Bounds(model_id=engine.model_id, max_texts=limits.max_texts, max_text_chars=limits.max_text_chars,
                      dimension=engine.dimension, prompts=frozenset(engine.prompts), max_tokens=0,
                      vocab_size=0)  # fmt: skip

    def _alone(self, prepared: Job) -> Answer:
        return self.complete([prepared])[0]

    def _error(self, shape: str, refusal: Refusal) -> bytes:
        return _error(shape, refusal)

    def complete(self, jobs: Sequence[Job]) -> list[Answer]:
        """Embed every job's texts in one forward per ``normalize`` value, and answer each job.

        Never raises: a failure of the model answers 500 to every job of the forward (logged)."""
        rows: dict[int, np.ndarray[Any, Any]] = {}
        shared: dict[int, int] = {}  # texts in the job's forward
        failed = False
        for normalize in (True, False):
            chosen = [job for job in jobs if job.normalize is normalize]
            texts = [text for job in chosen for text in job.texts]
            if not chosen:
                continue
            try:
                vectors = self.engine.embed(texts, normalize=normalize) if texts else None
            except Exception:
                logger.exception("packcache serve: a forward of %d texts failed", len(texts))
                failed = True
                continue
            if texts:
                self._count_forward(len(chosen), len(texts), sum(job.tokens for job in chosen))
            at = 0
            for job in chosen:
                rows[id(job)] = vectors[at : at + len(job.texts)] if vectors is not None else _empty(self.engine)
                shared[id(job)] = len(texts)
                at += len(job.texts)
        answers = []
        for job in jobs:
            # The forward's size: a row's last bits can depend on the texts it shared a forward with.
            forward = str(shared.get(id(job), 0))
            headers = [("X-Packcache-Worker", str(self.pid)), ("X-Packcache-Forward-Texts", forward)]
            try:
                if id(job) not in rows:
                    raise RuntimeError("the forward failed")
                code, body = 200, job.answer(rows[id(job)])
            except Exception:
                if not failed:
                    logger.exception("packcache serve: answering %s failed", job.route)
                code, body, headers = 500, _error(job.api, _internal()), []
            answers.append(self._answer(job.route, code, body, "application/json", headers, job.started))
        return answers

    def _count_forward(self, requests: int, texts: int, tokens: int) -> None:
        observe = getattr(self.metrics, "forward", None)
        if observe is not None:
            try:
                observe(requests, texts, tokens)
            except Exception:
                logger.exception("packcache serve: updating the metrics failed")

    # ------------------------------------------------------------ routes without the model

    def _other_info(self, route: str) -> dict[str, Any]:
        """TEI's ``GET /info``, with the fields that apply."""
        from .. import __version__

        engine = self.engine
        return {
            "model_id": engine.model_id, "model_sha": None, "model_dtype": engine.scheme,
            "model_type": {"embedding": {"pooling": None}}, "max_concurrent_requests": None,
            "max_input_length": engine.max_tokens, "max_batch_tokens": self.batching.max_batch_tokens,
            "max_batch_requests": None, "max_client_batch_size": self.limits.max_texts,
            "auto_truncate": self.limits.auto_truncate, "tokenization_workers": 1,
            "prompts": sorted(engine.prompts), "default_prompt_name": engine.default_prompt_name,
            "dimension": engine.dimension, "engine": engine.name, "version": __version__,
        }  # fmt: skip

    # ------------------------------------------------------------ the three request shapes

    def _legacy(self, request: TextsRequest, route: str, started: float) -> Job:
        final = self._prompted(request.texts, None)
        counts = self.engine.tokens(final) if final else []

        def answer(vectors: np.ndarray[Any, Any]) -> bytes:
            return json.dumps({"embeddings": vectors.tolist()}, separators=(",", ":")).encode()

        return Job(final, self._read(counts), True, route, _LEGACY, started, answer)

    def _tei(self, request: TEIEmbedRequest, route: str, started: float) -> Job:
        normalize = True if request.normalize is None else request.normalize
        truncate = self.limits.auto_truncate if request.truncate is None else request.truncate
        final = self._prompted(request.texts, request.prompt_name)
        counts = self.engine.tokens(final)
        if not truncate:
            self._refuse_long(counts, lambda i, n, m: Refusal(
                413, f"Input validation error: `inputs` must have less than {m + 1} tokens. Given: {n} (input {i}; "
                "send \"truncate\": true to keep the first tokens)", kind="Validation"))  # fmt: skip

        def answer(vectors: np.ndarray[Any, Any]) -> bytes:
            return json.dumps(vectors.tolist(), separators=(",", ":")).encode()

        return Job(final, self._read(counts), normalize, route, _TEI, started, answer)

    def _openai(self, request: EmbeddingsRequest, route: str, started: float) -> Job:
        final = self._prompted(request.texts, None)
        counts = self.engine.tokens(final)
        if not self.limits.auto_truncate:
            self._refuse_long(counts, lambda i, n, m: Refusal(
                400, f"This model's maximum context length is {m} tokens, however input {i} has {n} tokens; "
                "shorten it (or run the server with --auto-truncate)", param="input",
                kind="context_length_exceeded"))  # fmt: skip
        used = self._read(counts)
        served = self.engine.model_id
        encoding, dimensions = request.encoding_format, request.dimensions

        def answer(vectors: np.ndarray[Any, Any]) -> bytes:
            if dimensions is not None and dimensions < vectors.shape[1]:
                vectors = vectors[:, :dimensions]
                norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
                vectors = (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
            data: list[Any] = (
                [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in vectors]
                if encoding == "base64" else vectors.tolist()
            )  # fmt: skip
            body = {
                "object": "list",
                "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(data)],
                "model": served, "usage": {"prompt_tokens": used, "total_tokens": used},
            }  # fmt: skip
            return json.dumps(body, separators=(",", ":")).encode()

        return Job(final, used, True, route, _OPENAI, started, answer)

    # ------------------------------------------------------------ checks

    def _prompted(self, texts: list[str], prompt_name: str | None) -> list[str]:
        """``texts`` with the named prompt (else the model's default prompt) before each, as sentence-transformers'
        ``encode(prompt_name=...)`` does."""
        engine = self.engine
        name = prompt_name if prompt_name is not None else engine.default_prompt_name
        if name is None:
            return texts
        if name not in engine.prompts:
            known = ", ".join(sorted(engine.prompts)) or "none"
            message = f"prompt {name[:40]!r} is not one of the model's prompts ({known})"
            raise Refusal(422 if prompt_name is not None else 500, message, kind="Validation")
        prefix = engine.prompts[name]
        return [prefix + text for text in texts] if prefix else texts

    def _refuse_long(self, counts: list[int], refusal: Callable[[int, int, int], Refusal]) -> None:
        limit = self.engine.max_tokens
        for index, count in enumerate(counts):
            if count > limit:
                raise refusal(index, count, limit)

    def _read(self, counts: list[int]) -> int:
        """Tokens the model reads of texts of ``counts`` tokens (each truncated to its ``max_tokens``)."""
        limit = self.engine.max_tokens
        return sum(min(count, limit) for count in counts)


def _empty(engine: Engine) -> np.ndarray[Any, Any]:
    return np.zeros((0, engine.dimension), dtype=np.float32)


def _internal() -> Refusal:
    return Refusal(500, "internal error (logged by the worker)", kind="Backend")


def _error(api: str, refusal: Refusal) -> bytes:
    if api == _OPENAI:
        return openai_error(refusal)
    if api == _TEI:
        return json.dumps({"error": str(refusal), "error_type": refusal.kind or "Validation"}).encode()
    return json.dumps({"error": str(refusal)}).encode()
