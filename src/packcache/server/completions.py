"""The WSGI application of a worker serving a causal LM: OpenAI's chat and text completions, streamed or whole.

* ``POST /v1/chat/completions``: ``{"model", "messages": [{"role", "content"}, ...], "max_tokens" |
  "max_completion_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options":
  {"include_usage"}, "n": 1, "user"}``. The messages go through the tokenizer's chat template with the
  generation prompt added (:meth:`~packcache.server.llm.LLMEngine.chat_prompt`); a model without a template
  is refused (400), as transformers' own ``apply_chat_template`` refuses. ``content`` is a string or a list
  of ``{"type": "text", "text"}`` parts.
* ``POST /v1/completions``: ``{"model", "prompt": str | [str] | [int, ...], ...}`` with the same sampling
  fields; ``max_tokens`` defaults to 16, as OpenAI's.
* ``GET /v1/models``, ``GET /healthz``, ``GET /metrics`` as the embedding application's.

Bounds: the prompt's tokens plus ``max_tokens`` must fit the engine's ``max_model_len`` (else 400
``context_length_exceeded``, as OpenAI answers); ``max_tokens`` is at most the server's ``max_tokens``
(:class:`Generation`) and defaults, for chat, to what is left of the context up to that bound. ``stop``: at
most 4 strings of at most 256 characters. ``temperature`` in [0, 2] (0: greedy), ``top_p`` in (0, 1],
``seed`` an integer. Fields OpenAI has and this server does not serve (``logprobs``, ``tools``, ``n`` over
1, non-zero penalties, ...) are refused by name when set to anything but their default, never ignored;
unknown fields are refused as OpenAI refuses them. Errors are OpenAI's shape: ``{"error": {"message",
"type", "param", "code"}}``.

Streaming (``"stream": true``) answers server-sent events: one ``data: {chunk}`` per step that brought new
text, the last chunk with ``finish_reason`` (``stop``: an end-of-sequence token or a stop string, which is
not sent; ``length``: ``max_tokens`` or the context) and ``usage``, then ``data: [DONE]``. With
``stream_options.include_usage``, the usage comes as OpenAI sends it then: in a last chunk of its own with
no choices. A generation the server has to end (a shutdown past its grace period, a failure of the model)
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
from typing import Any, ClassVar

from .. import _defaults
from .llm import LLMEngine
from .sampling import Output, Sampling
from .wsgiapp import Answer, Call, Limits, Refusal, WSGIApp, openai_error

__all__ = ["Completion", "CompletionApp", "Generation"]

logger = logging.getLogger("packcache.server")

_CHAT, _TEXT = "/v1/chat/completions", "/v1/completions"
_SAMPLING_KEYS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "n", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
})  # fmt: skip
_CHAT_KEYS = _SAMPLING_KEYS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "response_format", "parallel_tool_calls"}  # fmt: skip
_TEXT_KEYS = _SAMPLING_KEYS | {"prompt", "echo", "best_of", "suffix"}
#: Fields this server does not serve, with the value that means "not asked for": any other value is refused.
_UNSERVED: dict[str, tuple[Any, ...]] = {
    "n": (1, None), "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}), "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
    "tool_choice": (None, "none"), "parallel_tool_calls": (None,), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""),
}  # fmt: skip
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
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
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list, repr=False)
    first: float | None = None  # when the first generated token came (time to first token)
    counted: int = 0  # completion tokens already counted on /metrics
    _sent_role: bool = False

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
            out += _event(self._chunk({"role": "assistant", "content": ""}, None))
        if output.text or output.finish_reason is None:
            # one event per step, empty text included (llama.cpp's server does the same): a client sees each token
            out += _event(self._chunk({"content": output.text} if self.chat else output.text, None))
        if output.finish_reason is None:
            return out
        if output.finish_reason in ("error", "cancelled"):
            message = output.error or "the generation was cancelled: the server is stopping"
            self.app._observe(self.route, 500, self.started)
            error = {"message": message, "type": "server_error", "param": None, "code": None}
            return out + _event({"error": error}) + _DONE
        usage = self._usage(output)
        last = self._chunk({} if self.chat else "", output.finish_reason)
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

    def _chunk(self, delta: Any, finish: str | None) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            kind, prefix = "chat.completion.chunk", "chatcmpl-"
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            kind, prefix = "text_completion", "cmpl-"
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice] if delta is not None else []}  # fmt: skip

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
    }
    max_json_depth = 6
    engine: LLMEngine
    express_routes = frozenset({("GET", "/healthz"), ("GET", "/metrics"), ("GET", "/v1/models")})
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
        request = self._json(environ)
        if not isinstance(request, dict):
            raise Refusal(400, f"the body must be a JSON object, not {type(request).__name__}")
        return self._completion(route, request, started)

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

    def _completion(self, route: str, request: dict[str, Any], started: float) -> Completion:
        chat = route == _CHAT
        allowed = _CHAT_KEYS if chat else _TEXT_KEYS
        self._check_fields(request, allowed)
        for name, defaults in _UNSERVED.items():
            value = request.get(name)
            if name in request and not any(value == d and type(value) is type(d) for d in defaults):
                raise Refusal(400, f"'{name}' is not served by this server (only its default: "
                               f"{defaults[0]!r})", param=name)  # fmt: skip
        self._check_model(request)
        prompt = self._chat_prompt(request) if chat else self._text_prompt(request)
        limit = self.engine.max_model_len
        if len(prompt) >= limit:
            raise Refusal(400, f"This model's maximum context length is {limit} tokens, however the prompt has "
                           f"{len(prompt)} tokens", param="messages" if chat else "prompt",
                           kind="context_length_exceeded")  # fmt: skip
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        asked = next((request[n] for n in names if request.get(n) is not None), None)
        bound = self.generation.max_tokens
        if asked is None:
            max_tokens = min(bound, limit - len(prompt)) if chat else 16
        else:
            name = next(n for n in names if request.get(n) is not None)
            if not isinstance(asked, int) or isinstance(asked, bool) or not 1 <= asked <= bound:
                raise Refusal(400, f"'{name}' must be an integer from 1 to {bound}, not {str(asked)[:40]}",
                               param=name)  # fmt: skip
            max_tokens = asked
            if len(prompt) + max_tokens > limit:
                raise Refusal(400, f"This model's maximum context length is {limit} tokens, however you requested "
                               f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for "
                               "the completion)", param=name, kind="context_length_exceeded")  # fmt: skip
        stream = request.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise Refusal(400, "'stream' must be true or false", param="stream")
        options = request.get("stream_options")
        include_usage = False
        if options is not None:
            if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
                raise Refusal(400, "'stream_options' must be an object with 'include_usage'", param="stream_options")
            include_usage = options.get("include_usage") is True
        self._check_user(request)
        sampling = Sampling(
            max_tokens=max_tokens, temperature=_number(request, "temperature", 1.0, 0.0, 2.0, low_open=False),
            top_p=_number(request, "top_p", 1.0, 0.0, 1.0, low_open=True), seed=_seed(request), stop=_stops(request),
        )  # fmt: skip
        return Completion(route, prompt, sampling, bool(stream), include_usage, self.engine.model_id, started, self)

    def _chat_prompt(self, request: dict[str, Any]) -> list[int]:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refusal(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects",
                           param="messages")  # fmt: skip
        if len(messages) > MAX_MESSAGES:
            raise Refusal(400, f"{len(messages)} messages; at most {MAX_MESSAGES}", param="messages")
        plain = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise Refusal(400, f"messages[{index}] must be an object with a string 'role'", param="messages")
            unknown = sorted(set(message) - {"role", "content", "name"})
            if unknown:
                raise Refusal(400, f"messages[{index}] has {unknown[0][:40]!r}: only role, content and name are "
                               "served", param="messages")  # fmt: skip
            plain.append({"role": message["role"], "content": _content(message.get("content"), index)})
        try:
            return self.engine.chat_prompt(plain)
        except ValueError as exc:
            raise Refusal(400, str(exc), param="messages") from None

    def _text_prompt(self, request: dict[str, Any]) -> list[int]:
        if "prompt" not in request:
            raise Refusal(400, "'prompt' is a required property", param="prompt")
        prompt = request["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list: OpenAI's clients send this shape too
        if isinstance(prompt, str):
            if len(prompt) > self.limits.max_body_bytes:
                raise Refusal(400, "'prompt' is too long", param="prompt")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise Refusal(400, "'prompt' is not valid Unicode (a lone surrogate)", param="prompt") from None
            return self.engine.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocabulary = self.engine.vocab_size
            if any(not 0 <= t < vocabulary for t in prompt):
                raise Refusal(400, f"token ids must be in [0, {vocabulary})", param="prompt")
            return list(prompt)
        raise Refusal(400, "'prompt' must be a string, a list of one string, or a list of token ids (one prompt "
                       "per request)", param="prompt")  # fmt: skip


def _content(content: Any, index: int) -> str:
    """A message's text: a string, or the concatenation of its ``{"type": "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise Refusal(400, f"messages[{index}].content must be a string or a list of text parts (only text is served)",
                   param="messages")  # fmt: skip


def _number(request: dict[str, Any], name: str, default: float, low: float, high: float, *, low_open: bool) -> float:
    value = request.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value <= high
    ok = ok and (value > low if low_open else value >= low)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise Refusal(400, f"'{name}' must be a number in {bounds}, not {str(value)[:40]}", param=name)
    return float(value)


def _seed(request: dict[str, Any]) -> int | None:
    seed = request.get("seed")
    if seed is None:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**64:
        raise Refusal(400, "'seed' must be a 64-bit integer", param="seed")
    return seed


def _stops(request: dict[str, Any]) -> tuple[str, ...]:
    stop = request.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list) or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):  # fmt: skip
        raise Refusal(400, f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings of at most "
                       f"{MAX_STOP_CHARS} characters", param="stop")  # fmt: skip
    return tuple(stops)
