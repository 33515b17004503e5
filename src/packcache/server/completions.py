"""The WSGI application of a worker serving a causal LM: OpenAI's chat and text completions, streamed or whole.

* ``POST /v1/chat/completions``: ``{"model", "messages": [{"role", "content", "name"}, ...], "max_tokens" |
  "max_completion_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options":
  {"include_usage", "continuous_usage_stats"}, "response_format": {"type": "text"}, "n": 1, "user"}``. The
  messages go through the tokenizer's chat template with the generation prompt added
  (:meth:`~packcache.server.llm.LLMEngine.chat_prompt`); a model without a template is refused (400), as
  transformers' own ``apply_chat_template`` refuses. ``content`` is a string or a list of ``{"type": "text",
  "text"}`` parts; a ``name`` goes to the template, which must use it (else 400).
* ``POST /v1/completions``: ``{"model", "prompt": str | [str] | [int, ...], ...}`` with the same sampling
  fields; ``max_tokens`` defaults to 16, as OpenAI's (or the server's bound, if lower).
* ``GET /v1/models``, ``GET /healthz``, ``GET /health``, ``GET /metrics`` as the embedding application's.

Each body is parsed by its route's declared model (:class:`~packcache.server.requests.ChatRequest`,
:class:`~packcache.server.requests.CompletionRequest`): every field is served or refused by name, and unknown
fields are refused as OpenAI refuses them. Bounds: the prompt has at least one token, and its tokens plus
``max_tokens`` fit the engine's ``max_model_len`` (else 400 ``context_length_exceeded``, as OpenAI answers, also
when ``max_tokens`` was left at its default); ``max_tokens`` is at most the server's ``max_tokens``
(:class:`Generation`) and defaults, for chat, to what is left of the context up to that bound. ``stop``: at
most 4 strings of at most 256 characters. ``temperature`` in [0, 2] (0: greedy; any other value is sampled
exactly, :mod:`.sampling`), ``top_p`` in (0, 1], ``seed`` an integer from -2**63 to 2**64 - 1. Fields OpenAI
has and this server does not serve (``logprobs``, ``tools``, ``n`` over 1, non-zero penalties, JSON mode in
``response_format``, ...) are refused by name when set to anything but their default, never ignored. Whatever
reaches the engine has passed its own check first (:meth:`~packcache.server.llm.LLMEngine.check`): a client's
input is never refused after it was accepted. Errors are OpenAI's shape: ``{"error": {"message", "type",
"param", "code"}}``.

Streaming (``"stream": true``) answers server-sent events: one ``data: {chunk}`` per step that brought new
text, the last chunk with ``finish_reason`` (``stop``: an end-of-sequence token or a stop string, which is
not sent; ``length``: ``max_tokens`` or the context) and ``usage``, then ``data: [DONE]``. With
``stream_options.include_usage``, the usage comes as OpenAI sends it then: in a last chunk of its own with
no choices. With ``stream_options.continuous_usage_stats`` (vLLM's), every chunk carries the usage so far.
A generation the server has to end (a shutdown past its grace period, a failure of the model)
ends with ``data: {"error": ...}`` and ``data: [DONE]``: a client always sees the stream end cleanly.

The generation itself runs in the worker (:mod:`.worker`): :meth:`CompletionApp.prepare` turns a request
into a :class:`Completion` (the prompt's token ids and the sampling), the worker hands it to the engine,
and :meth:`Completion.take` turns each of the engine's outputs into the bytes to send. Under any other WSGI
server the generation routes answer 500: they need the worker's engine loop.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

from .. import _defaults
from .llm import LLMEngine
from .sampling import Output, Sampling
from .wsgiapp import Answer, Call, Limits, Refusal, WSGIApp, openai_error

if TYPE_CHECKING:
    from .requests import Bounds, ChatRequest, CompletionRequest  # pydantic: imported when a request is parsed

__all__ = ["Completion", "CompletionApp", "Generation"]

logger = logging.getLogger("packcache.server")

_CHAT, _TEXT = "/v1/chat/completions", "/v1/completions"
#: ``max_tokens`` of a ``/v1/completions`` request that sends none: OpenAI's API fixes it at 16.
OPENAI_COMPLETION_TOKENS = 16
#: Seconds over which ``packcache_generation_tokens_per_second`` counts a worker's generated tokens.
RATE_WINDOW = 10.0


@dataclass(frozen=True)
class Generation:
    """What a request may ask the engine for.

    Attributes:
        max_tokens: the most tokens one request may generate (and the chat default's bound).
    """

    max_tokens: int = _defaults.LLM_MAX_TOKENS

    def __post_init__(self) -> None:
        value = self.max_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Generation.max_tokens must be a positive integer, not {value!r}")


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


@dataclass(eq=False)
class Completion:
    """One generation request: its prompt and sampling (for the engine), and how to answer each output.

    :meth:`take` is called with every :class:`~packcache.server.sampling.Output` of the request, in order, from
    the engine's thread: a streamed request gets the bytes of its server-sent events (``b""`` when there is
    nothing to send), a whole one ``None`` until its final output, then its :data:`~packcache.server.wsgiapp.Answer`.
    """

    route: str
    prompt: list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool
    model: str
    started: float
    app: CompletionApp = field(repr=False)
    continuous_usage: bool = False  # the usage so far in every streamed chunk
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list, repr=False)
    first: float | None = None  # when the first generated token came (time to first token)
    counted: int = 0  # completion tokens already counted on /metrics
    _sent_role: bool = False
    _tokens_sent: int = 0  # generated tokens the stream has sent an event for

    @property
    def chat(self) -> bool:
        return self.route == _CHAT

    def headers(self) -> list[tuple[str, str]]:
        """The headers of a streamed answer (status 200; the worker frames the body)."""
        return [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                ("X-Packcache-Worker", str(self.app.pid))]  # fmt: skip

    def take(self, output: Output) -> bytes | Answer | None:
        """The bytes (streamed) or the answer (whole, at the final output) for ``output``. Never raises."""
        try:
            return self._take(output)
        except Exception:
            logger.exception("packcache serve: answering %s failed", self.route)
            if self.stream:
                return _event({"error": {"message": "internal error (logged by the worker)", "type": "server_error",
                                         "param": None, "code": None}}) + _DONE  # fmt: skip
            internal = openai_error(Refusal(500, "internal error (logged by the worker)"))
            return self.app._answer(self.route, 500, internal, "application/json", [], self.started)

    def _take(self, output: Output) -> bytes | Answer | None:
        now = time.perf_counter()
        if self.first is None and (output.completion_tokens or output.text):
            self.first = now  # the first token, even one whose text is held back or empty
        self.app._count(self, output, now)
        if not self.stream:
            self.text.append(output.text)
            if output.finish_reason is None:
                return None
            if output.finish_reason in ("error", "cancelled"):
                message = output.error or "the generation was cancelled: the server is stopping"
                return self.app._answer(self.route, 500, openai_error(Refusal(500, message)), "application/json", [],
                                        self.started)  # fmt: skip
            return self.app._answer(self.route, 200, self._whole(output), "application/json",
                                    [("X-Packcache-Worker", str(self.app.pid))], self.started)  # fmt: skip
        out = b""
        if self.chat and not self._sent_role:
            self._sent_role = True
            before = Output("", output.prompt_tokens, 0, None)  # the usage before the first token
            out += _event(self._chunk({"role": "assistant", "content": ""}, None, before))
        if output.text or output.finish_reason is None or output.completion_tokens > self._tokens_sent:
            # an event per generated token, empty text included (llama.cpp's server does the same), the last one
            # too (the final chunk after it carries only the finish reason): a client sees each token
            self._tokens_sent = output.completion_tokens
            out += _event(self._chunk({"content": output.text} if self.chat else output.text, None, output))
        if output.finish_reason is None:
            return out
        if output.finish_reason in ("error", "cancelled"):
            message = output.error or "the generation was cancelled: the server is stopping"
            self.app._observe(self.route, 500, self.started)
            error = {"message": message, "type": "server_error", "param": None, "code": None}
            return out + _event({"error": error}) + _DONE
        usage = self._usage(output)
        last = self._chunk({} if self.chat else "", output.finish_reason, output)
        if self.include_usage:
            out += _event(last)
            last = self._chunk(None, None)
            last["choices"] = []
        last["usage"] = usage
        self.app._observe(self.route, 200, self.started)
        return out + _event(last) + _DONE

    def _usage(self, output: Output) -> dict[str, int]:
        return {"prompt_tokens": output.prompt_tokens, "completion_tokens": output.completion_tokens,
                "total_tokens": output.prompt_tokens + output.completion_tokens}  # fmt: skip

    def _chunk(self, delta: Any, finish: str | None, output: Output | None = None) -> dict[str, Any]:
        """One streamed chunk; with ``continuous_usage`` and an ``output``, the usage so far in it."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            kind, prefix = "chat.completion.chunk", "chatcmpl-"
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            kind, prefix = "text_completion", "cmpl-"
        chunk = {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model,
                 "choices": [choice] if delta is not None else []}  # fmt: skip
        if self.continuous_usage and output is not None:
            # pinned by tests/test_server_llm_api.py::test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk
            chunk["usage"] = self._usage(output)
        return chunk

    def _whole(self, output: Output) -> bytes:
        text = "".join(self.text)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": output.finish_reason}  # fmt: skip
            kind, prefix = "chat.completion", "chatcmpl-"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": output.finish_reason}
            kind, prefix = "text_completion", "cmpl-"
        body = {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self._usage(output)}  # fmt: skip
        return json.dumps(body, ensure_ascii=False).encode()


class CompletionApp(WSGIApp):
    """The WSGI callable of a generation worker (:class:`~packcache.server.wsgiapp.WSGIApp` holds what it shares
    with the embedding worker's). ``metrics`` is a :class:`~packcache.server.metrics.WorkerMetrics`.

    ``express_routes`` never wait for the engine; ``generation_routes`` are what the worker hands the engine
    (through :meth:`prepare` and :meth:`Completion.take`).
    """

    methods: ClassVar[dict[str, str]] = {
        _CHAT: "POST",
        _TEXT: "POST",
        "/v1/models": "GET",
        "/metrics": "GET",
        "/healthz": "GET",
        "/health": "GET",
    }
    max_json_depth = 6
    engine: LLMEngine
    express_routes = frozenset({("GET", "/healthz"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models")})
    generation_routes = frozenset({("POST", _CHAT), ("POST", _TEXT)})

    def __init__(
        self,
        engine: LLMEngine,
        metrics: Any,
        exposition: Callable[[], tuple[bytes, str]],
        limits: Limits | None = None,
        generation: Generation | None = None,
    ) -> None:
        self.generation = generation or Generation()
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) of the last RATE_WINDOW seconds
        self._recent_lock = threading.Lock()
        super().__init__(engine, metrics, exposition, limits)

    def prepare(self, environ: dict[str, Any]) -> Answer | Completion:
        """Read and check a request: its answer, or the :class:`Completion` to generate. Never raises."""
        prepared: Answer | Completion = super().prepare(environ)
        return prepared

    def _request(self, route: str, environ: dict[str, Any], started: float, call: Call) -> Completion:
        from . import requests  # pydantic: imported by the master before it forks (engines.preimport), never by the CLI

        body, bounds = self._json(environ), self.bounds()
        request: ChatRequest | CompletionRequest = (
            requests.parse(requests.ChatRequest, body, bounds) if route == _CHAT
            else requests.parse(requests.CompletionRequest, body, bounds)
        )  # fmt: skip
        return self._completion(route, request, started)

    def bounds(self) -> Bounds:
        """What one request may ask for (:class:`~packcache.server.requests.Bounds`)."""
        from .requests import Bounds

        engine, limits = self.engine, self.limits
        return Bounds(model_id=engine.model_id, max_texts=limits.max_texts, max_text_chars=limits.max_text_chars,
                      dimension=0, prompts=frozenset(), max_tokens=self.generation.max_tokens,
                      vocab_size=engine.vocab_size)  # fmt: skip

    def _alone(self, prepared: Completion) -> Answer:
        # only packcache serve's worker runs the engine's loop
        return self._answer(prepared.route, 500, openai_error(Refusal(
            500, "generation needs packcache serve's worker (the engine runs in its main thread)"
        )), "application/json", [], prepared.started)  # fmt: skip

    # ------------------------------------------------------------ answers and figures

    def _count(self, completion: Completion, output: Output, now: float) -> None:
        """Tokens in and out, time to first token, and the worker's recent rate, for ``output``."""
        try:
            done = output.finish_reason is not None
            new = output.completion_tokens - completion.counted
            completion.counted = output.completion_tokens
            generated = getattr(self.metrics, "generated", None)
            if generated is None:
                return
            first = completion.first == now
            generated(
                prompt_tokens=output.prompt_tokens if done else 0, completion_tokens=max(0, new),
                first_token_seconds=(now - completion.started) if first else None, rate=self._rate(now, new),
            )  # fmt: skip
        except Exception:
            logger.exception("packcache serve: updating the metrics failed")

    def _rate(self, now: float, tokens: int) -> float:
        """Tokens this worker generated per second over the last :data:`RATE_WINDOW` seconds."""
        with self._recent_lock:
            if tokens > 0:
                self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW

    def _refresh(self) -> None:
        with_rate = getattr(self.metrics, "generated", None)
        if with_rate is not None:  # the recent rate decays while nothing is generated
            with_rate(prompt_tokens=0, completion_tokens=0, first_token_seconds=None,
                      rate=self._rate(time.perf_counter(), 0))  # fmt: skip

    def _model_card(self) -> dict[str, Any]:
        return {**super()._model_card(), "max_model_len": self.engine.max_model_len}

    # ------------------------------------------------------------ requests

    def _completion(self, route: str, request: ChatRequest | CompletionRequest, started: float) -> Completion:
        """The :class:`Completion` of a parsed request: its prompt's tokens and its sampling, checked against the
        context and against what the engine runs."""
        from .requests import ChatRequest

        chat = isinstance(request, ChatRequest)
        where = "messages" if chat else "prompt"
        prompt = self._chat_prompt(request) if isinstance(request, ChatRequest) else self._text_prompt(request)
        if not prompt:
            # pinned by tests/test_server_llm_api.py::test_an_empty_prompt_to_a_tokenizer_without_bos_is_refused_by_name
            raise Refusal(400, f"'{where}' has no tokens (this model's tokenizer adds none of its own): send at least "
                           "one token", param=where)  # fmt: skip
        limit = self.engine.max_model_len
        if len(prompt) >= limit:
            raise Refusal(400, f"This model's maximum context length is {limit} tokens, however the prompt has "
                           f"{len(prompt)} tokens", param=where, kind="context_length_exceeded")  # fmt: skip
        asked = request.asked_tokens
        if asked is not None:
            name, max_tokens = asked
            if len(prompt) + max_tokens > limit:
                raise Refusal(400, f"This model's maximum context length is {limit} tokens, however you requested "
                               f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for "
                               "the completion)", param=name, kind="context_length_exceeded")  # fmt: skip
        elif chat:
            max_tokens = min(self.generation.max_tokens, limit - len(prompt))
        else:
            max_tokens = min(OPENAI_COMPLETION_TOKENS, self.generation.max_tokens)  # never over the server's bound
            if len(prompt) + max_tokens > limit:
                # pinned by tests/test_server_llm_api.py::
                #   test_a_prompt_without_room_for_the_default_16_tokens_is_context_length_exceeded
                raise Refusal(400, f"This model's maximum context length is {limit} tokens, however you requested "
                               f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for "
                               f"the completion: max_tokens defaults to {max_tokens}); send a smaller max_tokens or "
                               "a shorter prompt", param="max_tokens", kind="context_length_exceeded")  # fmt: skip
        sampling = Sampling(
            max_tokens=max_tokens, temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p, seed=request.seed, stop=request.stops,
        )  # fmt: skip
        try:
            self.engine.check(prompt, sampling)  # whatever the engine would refuse is the client's 400, here
        except ValueError as exc:
            raise Refusal(400, str(exc)) from None
        return Completion(route, prompt, sampling, request.stream is True, request.include_usage,
                          self.engine.model_id, started, self, continuous_usage=request.continuous_usage)  # fmt: skip

    def _chat_prompt(self, request: ChatRequest) -> list[int]:
        messages = [
            {"role": m.role, "content": m.text, **({"name": m.name} if m.name is not None else {})}
            for m in request.messages
        ]
        try:
            return self.engine.chat_prompt(messages)
        except ValueError as exc:
            raise Refusal(400, str(exc), param="messages") from None

    def _text_prompt(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt  # a string or token ids, as the request's model left it
        if isinstance(prompt, str):
            return self.engine.encode(prompt)
        return list(cast("list[int]", prompt))
