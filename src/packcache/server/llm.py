"""What a server worker generates text with: a causal LM on packed weights (:func:`packcache.hf.from_pretrained` with
``AutoModelForCausalLM``) under transformers' continuous batching, driven from the worker's main thread.

The worker submits requests (token ids, :class:`Sampling`, a sink) from its connection threads; :meth:`LLMEngine.run`
runs the generation loop in the main thread, one step (one forward of every running sequence) at a time, and calls
each request's sink once per step with the text new since the last call, then once with its finish reason.

Why the main thread: torch's OpenMP pool keeps its threads spinning between parallel regions only for the
process's initial thread; from any other thread every region wakes sleeping threads (a decode step at 4 sequences
took 81 ms in the main thread, 118 ms in continuous batching's own background thread). So the manager's
background thread is never started: :meth:`LLMEngine.run` drives its batch processor itself, step by step, which
also lets one step's error fail that step's requests instead of the whole loop.

Sampling is per request (OpenAI sends ``temperature``, ``top_p`` and ``seed`` with each request) while
transformers' is per manager: the manager decodes greedily, and one logits processor of ours (:class:`_Sampler`)
samples each sampled row itself with its request's parameters and its own ``torch.Generator``, leaving the chosen
token the only finite score so the greedy argmax takes it. A seeded request draws one uniform number per token from
its own generator, so it gives the same tokens alone and batched (up to float rounding of its logits).

The paged KV cache is sized from the engine's options (``max_seqs`` sequences of ``max_model_len`` tokens), not
from free memory as transformers does by default: that default allocated (and zero-filled) gigabytes at the first
request. The pinned transformers internals this module uses are listed in :data:`INTERNALS`; a test checks them.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _defaults
from ..stats import CacheStats
from .engines import EngineSpec, model_id_of

__all__ = ["INTERNALS", "LLMEngine", "Output", "Sampling", "is_causal_lm", "load_llm"]

#: The members of transformers' continuous batching (5.23.0) this module relies on, beyond its public
#: ``init_continuous_batching``/``add_request``/``cancel_request``: ``(class, attribute)``.
INTERNALS = (
    ("ContinuousBatchingManager", "_create_batch_processor"),
    ("ContinuousBatchingManager", "_generation_step"),
    ("ContinuousBatchingManager", "_wake_up_loop"),
    ("ContinuousBatchingManager", "output_router"),
    ("ContinuousBatchingManager", "logit_processor"),
    ("ContinuousBatchingManager", "batch_processor"),
    ("ContinuousBatchProcessor", "prepare_next_batch"),
    ("ContinuousBatchProcessor", "update_batch"),
    ("ContinuousBatchProcessor", "handle_batch_error"),
    ("ContinuousBatchProcessor", "fail_all_requests"),
    ("ContinuousBatchProcessor", "cache"),
)


@dataclass(frozen=True)
class Sampling:
    """How one request generates.

    Attributes:
        max_tokens: tokens to generate at most (then ``finish_reason`` ``"length"``).
        temperature: ``0``: greedy; else the logits are divided by it before sampling.
        top_p: nucleus sampling: the smallest set of most likely tokens whose probabilities reach ``top_p``.
        seed: the request's generator seed (``None``: a random one): a seeded request repeats its tokens.
        stop: strings that end the generation where they first appear (not included in the text).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Output:
    """One delivery to a request's sink.

    Attributes:
        text: the text new since the previous :class:`Output` of this request.
        prompt_tokens: the prompt's tokens.
        completion_tokens: tokens generated so far.
        finish_reason: ``None`` while running; ``"stop"`` (EOS or a stop string), ``"length"`` (``max_tokens``),
            ``"cancelled"`` or ``"error"`` in the last one.
        error: what went wrong, with ``finish_reason`` ``"error"``.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    error: str | None = None


class _Detokenizer:
    """Token ids to text, incrementally: :meth:`add` returns the text new since its last call, never a partial
    multi-byte character (a decode ending in U+FFFD is held back until the next token completes it).

    The last emitted tokens are decoded again with the new ones (``prefix``), so a tokenizer that drops a word's
    leading space at the start of a decode (sentencepiece) still gives the space.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded with the text already returned
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """The text of the tokens held back (an incomplete character at the very end included, as U+FFFD)."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if after.startswith(before) else after


class _Request:
    """One request's state, touched only by the engine's thread (but created in :meth:`LLMEngine.submit`)."""

    def __init__(
        self, request_id: str, slot: int, prompt: list[int], sampling: Sampling, sink: Callable[[Output], None],
        tokenizer: Any,
    ) -> None:  # fmt: skip
        import torch

        self.id = request_id
        self.slot = slot
        self.prompt_tokens = len(prompt)
        self.sampling = sampling
        self.sink = sink
        self.detokenizer = _Detokenizer(tokenizer)
        self.text = ""  # all the text decoded so far
        self.sent = 0  # characters of it delivered
        self.seen = 0  # generated tokens handled
        self.done = False
        self.greedy = sampling.temperature <= 0.0
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(sampling.seed if sampling.seed is not None else secrets.randbits(63))

    def deliver(self, text: str, finish_reason: str | None = None, error: str | None = None) -> None:
        if self.done:
            return
        if finish_reason is not None:
            self.done = True
        elif not text:
            return
        self.sink(Output(text, self.prompt_tokens, self.seen, finish_reason, error))

    def take_text(self, new: str, final: bool) -> tuple[str, bool]:
        """Add decoded text; return what no stop string can still claim (all of it when ``final``), and whether a
        stop string ended the request (the text then ends where the stop string begins)."""
        self.text += new
        stops = tuple(s for s in self.sampling.stop if s)
        if stops:
            found = [i for i in (self.text.find(s, self.sent) for s in stops) if i >= 0]
            if found:
                end = min(found)
                text, self.sent = self.text[self.sent : end], end
                return text, True
        end = len(self.text) if final else len(self.text) - _held(self.text, self.sent, stops)
        text, self.sent = self.text[self.sent : end], max(self.sent, end)
        return text, False


def _held(text: str, start: int, stops: tuple[str, ...]) -> int:
    """The longest tail of ``text[start:]`` that is the start of a stop string (held back until it is decided)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text) - start), longest, -1):
            if stop.startswith(text[len(text) - k :]):
                longest = k
                break
    return longest


def _sampler_class() -> type:
    """:class:`_Sampler`, made when transformers is imported (this module imports it only in a worker)."""
    import transformers.generation.continuous_batching.cb_logits_processors as _cb_module

    cb: Any = _cb_module

    class _Sampler(cb.ContinuousBatchingLogitsProcessor):  # type: ignore[misc]
        """Samples every row of a sampled request with its own parameters and generator; greedy rows pass through.

        ``prepare_tensor_args`` gives each row its request's slot number; ``__call__`` (same thread, same step) finds
        the request by slot and leaves its chosen token the only finite score of the row."""

        supported_kwargs: dict[str, type] = {}  # noqa: RUF012  (the base class's shape)
        ignored_kwargs: tuple[str, ...] = ()

        def __init__(self, slots: dict[int, _Request]) -> None:
            self.slots = slots

        def fill_defaults(self, int32_tensor: Any) -> None:
            int32_tensor.fill_(-1)

        def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Any:
            import torch

            by_id = self.slots_by_id()
            return torch.tensor([by_id.get(r.state.request_id, -1) for r in requests_with_new_token], dtype=torch.int32)

        def slots_by_id(self) -> dict[str, int]:
            return {request.id: slot for slot, request in list(self.slots.items())}

        def __call__(self, scores: Any, tensor_arg: Any) -> Any:
            chosen: list[tuple[int, _Request]] = []
            for row, slot in enumerate(tensor_arg[: scores.size(0)].tolist()):
                request = self.slots.get(slot)
                if request is not None and not request.greedy:
                    chosen.append((row, request))
            if not chosen:
                return scores
            scores = scores.clone()
            for row, request in chosen:
                token = _sample(scores[row], request.sampling, request.generator)
                scores[row].fill_(-math.inf)
                scores[row, token] = 0.0
            return scores

    return _Sampler


def _sample(logits: Any, sampling: Sampling, generator: Any) -> int:
    """One token from ``logits`` (one row) at ``sampling``'s temperature and top_p, with one uniform draw of
    ``generator`` (so a seeded request's draws do not depend on the other rows of its steps).

    No sort of the vocabulary (18 ms for 128k tokens, per row and step, on 2 cores): without top_p the draw is
    inverted on the cumulative probabilities in vocabulary order; with top_p the nucleus comes from ``topk`` over
    a growing ``k`` (most of the mass is in a few hundred tokens), and only a flat distribution reaches the whole
    vocabulary."""
    import torch

    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    draw = float(torch.rand(1, generator=generator, dtype=torch.float64)[0])
    if sampling.top_p >= 1.0:
        cumulative = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        index = int(torch.searchsorted(cumulative, torch.tensor([draw * float(cumulative[-1])]), right=True)[0])
        return min(index, probs.numel() - 1)
    k = min(_NUCLEUS_START, probs.numel())
    while True:
        values, order = torch.topk(probs, k)  # sorted, largest first
        cumulative = torch.cumsum(values, dim=-1, dtype=torch.float64)
        if float(cumulative[-1]) >= sampling.top_p or k == probs.numel():
            break
        k = min(k * 8, probs.numel())
    keep = min(int(torch.searchsorted(cumulative, torch.tensor([sampling.top_p], dtype=torch.float64))[0]) + 1, k)
    total = float(cumulative[keep - 1])
    index = int(torch.searchsorted(cumulative[:keep], torch.tensor([draw * total]), right=True)[0])
    return int(order[min(index, keep - 1)])


#: The first ``k`` of the nucleus search (:func:`_sample`).
_NUCLEUS_START = 256


class LLMEngine:
    """A causal LM under continuous batching: requests submitted from any thread, generated by :meth:`run` in the
    thread that calls it (the worker's main thread).

    Attributes:
        name, scheme, kernel_path, cache_file, load_seconds, model_id: as :class:`packcache.server.engines.Engine`
            (what ``/metrics`` and ``/v1/models`` report).
        kind: ``"generate"``.
        max_model_len: prompt and completion tokens one sequence may hold.
        max_seqs: sequences generated together in one step at most.
        page_size: tokens per block of the paged KV cache.
        kv_bytes: bytes of the KV cache (allocated, and zero-filled, at load).
        has_chat_template: whether the tokenizer has a chat template (:meth:`chat_prompt`).
        eos_token_ids: the token ids that end a generation (the generation config's, else the tokenizer's).
        setup_seconds: continuous batching's setup at load (the KV cache allocated and zero-filled).
        warmup_seconds: the warm-up request's time at load.
    """

    name = "packcache"
    kind = "generate"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        scheme: str,
        cache_file: str = "",
        load_seconds: float = 0.0,
        model_id: str = "",
        max_seqs: int = _defaults.LLM_MAX_SEQS,
        max_model_len: int | None = None,
        page_size: int = _defaults.LLM_PAGE_SIZE,
        warmup: bool = True,
    ) -> None:
        """Set up continuous batching on ``model`` (its KV cache allocated here) and, with ``warmup``, run one short
        request so the first user request does not pay the first forward's costs.

        Raises:
            ValueError: ``max_seqs``, ``max_model_len`` or ``page_size`` out of range (named), a model without a
                position limit and no ``max_model_len``.
        """

        import transformers as _transformers_module

        transformers: Any = _transformers_module  # untyped calls, as a value
        self.model = model
        self.tokenizer = tokenizer
        self.scheme = scheme
        self.cache_file = cache_file
        self.load_seconds = load_seconds
        self.model_id = model_id
        report = getattr(model, "packcache_report", None)
        self.kernel_path = str(getattr(report, "kernel_path", "") or "")
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be at least 1, not {max_seqs}")
        if page_size < 4:
            raise ValueError(f"page_size must be at least 4, not {page_size}")
        config = model.config.get_text_config()
        positions = getattr(config, "max_position_embeddings", None)
        if max_model_len is None:
            if not isinstance(positions, int) or positions < 2:
                raise ValueError("the model's config has no max_position_embeddings: give max_model_len")
            max_model_len = min(positions, _defaults.LLM_MAX_MODEL_LEN)
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, not {max_model_len}")
        if isinstance(positions, int) and max_model_len > positions:
            raise ValueError(f"max_model_len {max_model_len} is over the model's max_position_embeddings {positions}")
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        self.vocab_size = int(config.vocab_size)
        self.page_size = page_size
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.eos_token_ids = _eos_ids(model, tokenizer)

        # reentrant: stop() and cancel() may run in a signal handler, in the thread that holds it in run()
        self._lock = threading.RLock()
        self._requests: dict[str, _Request] = {}  # live requests, by id
        self._slots: dict[int, _Request] = {}  # the same, by slot (what the sampler reads)
        self._counter = itertools.count()
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stopping: str | None = None  # "drain" or "hard"
        self._step_started: float | None = None
        self._running = False
        self._loop_thread: threading.Thread | None = None

        started = time.perf_counter()
        blocks = math.ceil(max_seqs * max_model_len / page_size)
        generation = transformers.GenerationConfig(
            max_new_tokens=max_model_len, do_sample=False, eos_token_id=self.eos_token_ids or -1
        )
        batching = transformers.ContinuousBatchingConfig(
            num_blocks=blocks, page_size=page_size, max_batch_tokens=max(_defaults.LLM_MAX_BATCH_TOKENS, max_seqs),
            max_requests_per_batch=max_seqs, use_async_batching=False, use_cuda_graph=False,
            allow_block_sharing=False, scheduler_type="fifo",
        )  # fmt: skip
        self._manager: Any = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=batching
        )
        import transformers.generation.continuous_batching.cb_logits_processors as _cb_module

        cb: Any = _cb_module
        processors = cb.ContinuousBatchingLogitsProcessorList(
            transformers.LogitsProcessorList([_sampler_class()(self._slots)])
        )
        processors.tensors_required = 1  # counted only for the processors it converts itself
        self._manager.logit_processor = processors
        self._processor: Any = self._manager._create_batch_processor()
        self._manager.batch_processor = self._processor
        self._manager.current_batch = 0
        kv = self._processor.cache.cache_tensor
        self.kv_bytes = int(kv.numel() * kv.element_size())
        self.setup_seconds = time.perf_counter() - started
        self.warmup_seconds = 0.0
        if warmup:
            started = time.perf_counter()
            self._warm_up()
            self.warmup_seconds = time.perf_counter() - started

    # ------------------------------------------------------------------ what the worker calls

    def stats(self) -> CacheStats | None:
        """The cache's lock-free snapshot (``None`` for a model loaded without packcache)."""
        cache = getattr(self.model, "packcache", None)
        return None if cache is None else cache.stats()

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of ``messages`` (OpenAI chat messages: ``role`` and ``content``) through the tokenizer's
        chat template, the assistant's turn opened.

        Raises:
            ValueError: the model has no chat template; a message that is not a role and a string content (or a
                list of text parts); the template refused them (its message, one line).
        """
        if not self.has_chat_template:
            raise ValueError(f"the model {self.model_id!r} has no chat template: use /v1/completions")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        plain = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] has no role")
            plain.append({"role": message["role"], "content": _content(message.get("content"), i)})
        try:
            ids: Any = self.tokenizer.apply_chat_template(
                plain, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # jinja's errors (a template's raise_exception among them) have no common base
            why = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(f"the chat template refused the messages: {why[:300]}") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def encode(self, text: str) -> list[int]:
        """The token ids of a ``/v1/completions`` prompt, with the special tokens (BOS) the tokenizer adds."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return [int(i) for i in ids]

    def submit(self, prompt: list[int], sampling: Sampling, sink: Callable[[Output], None]) -> str:
        """Queue a request (any thread); its outputs go to ``sink``, called from the thread of :meth:`run`: once per
        step with new text, then exactly once with ``finish_reason`` set. Returns the request id.

        Raises:
            ValueError: an empty prompt, a token id out of the vocabulary, ``max_tokens`` under 1, a prompt and
                ``max_tokens`` over :attr:`max_model_len`, a temperature under 0 or a ``top_p`` outside ``(0, 1]``.
            RuntimeError: the engine is stopping.
        """
        if not prompt:
            raise ValueError("the prompt has no tokens")
        vocab = int(self.model.config.get_text_config().vocab_size)
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"a prompt token id is not in the vocabulary [0, {vocab})")
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {sampling.max_tokens}")
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt's {len(prompt)} tokens and max_tokens {sampling.max_tokens} are over the model's "
                f"{self.max_model_len} tokens (max_model_len)"
            )
        if not sampling.temperature >= 0.0:
            raise ValueError(f"temperature must be 0 or more, not {sampling.temperature}")
        if not 0.0 < sampling.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], not {sampling.top_p}")
        with self._lock:
            if self._stopping is not None:
                raise RuntimeError("the engine is stopping: it takes no new request")
            number = next(self._counter)
            request = _Request(f"gen-{number}", number, list(prompt), sampling, sink, self.tokenizer)
            self._requests[request.id] = request
            self._slots[request.slot] = request
            # under the lock: a hard stop that has cancelled every request it knows never misses this one
            self._manager.add_request(
                list(prompt), request_id=request.id, max_new_tokens=sampling.max_tokens, streaming=True,
                eos_token_id=self.eos_token_ids or -1,
            )  # fmt: skip
        return request.id

    def cancel(self, request_id: str) -> None:
        """Cancel a request (any thread; an unknown or finished one is ignored): its sequence is gone by the next
        step and its sink gets its last :class:`Output`, ``finish_reason`` ``"cancelled"``."""
        self._cancels.put(request_id)  # SimpleQueue: safe in a signal handler
        self._wake()

    def run(self) -> None:
        """Generate, in the calling thread, until :meth:`stop`.

        Raises:
            RuntimeError: :meth:`run` is already running.
        """
        with self._lock:
            if self._running:
                raise RuntimeError("the engine's loop is already running")
            self._running = True
            self._loop_thread = threading.current_thread()
        try:
            while True:
                self._take_cancels()
                with self._lock:
                    stopping, idle = self._stopping, not self._requests
                if stopping == "hard":
                    self._cancel_all()
                    self._step()  # the scheduler drops them
                    return
                if stopping == "drain" and idle:
                    return
                if not self._step():
                    self._manager._wake_up_loop.wait(timeout=0.1)
                    self._manager._wake_up_loop.clear()
        finally:
            with self._lock:
                self._running = False
                self._loop_thread = None

    def stop(self, *, drain: bool) -> None:
        """Make :meth:`run` return (any thread, a signal handler too): with ``drain`` once every running request has
        finished, else at once, each running request ending ``"cancelled"``. New requests are refused from now on;
        a hard stop after a drain still cancels what is left."""
        with self._lock:
            if self._stopping != "hard":
                self._stopping = "drain" if drain else "hard"
        self._wake()

    def _wake(self) -> None:
        """Wake the loop from its wait for work. Not from the loop's own thread (a signal handler there): the
        event's lock may be held by the code the handler interrupted, and the loop looks again within 0.1 s."""
        if threading.current_thread() is not self._loop_thread:
            self._manager._wake_up_loop.set()

    def busy_since(self) -> float | None:
        """``time.monotonic()`` when the current step began, ``None`` between steps."""
        return self._step_started

    # ------------------------------------------------------------------ the loop's parts (engine thread only)

    def _step(self) -> bool:
        """One generation step and its deliveries; False when there was nothing to run."""
        ran = False
        self._step_started = time.monotonic()
        try:
            try:
                ran = bool(self._processor.prepare_next_batch())
            except Exception as exc:  # the scheduler's state is unknown: fail everything it holds
                self._processor.fail_all_requests(exc)
                ran = True
            else:
                if ran:
                    try:
                        self._manager._generation_step()
                        self._processor.update_batch()
                    except Exception as exc:  # fails this step's requests (FAILED outputs), the engine goes on
                        self._processor.handle_batch_error(exc)
        finally:
            self._step_started = None
        self._deliver()
        return ran

    def _take_cancels(self) -> None:
        while True:
            try:
                request_id = self._cancels.get_nowait()
            except queue.Empty:
                return
            request = self._requests.get(request_id)
            if request is not None and not request.done:
                self._manager.cancel_request(request_id)
                self._finish(request, "cancelled")

    def _cancel_all(self) -> None:
        with self._lock:
            requests = list(self._requests.values())
        for request in requests:
            self._manager.cancel_request(request.id)
            self._finish(request, "cancelled")

    def _finish(self, request: _Request, reason: str, error: str | None = None, text: str = "") -> None:
        with self._lock:
            self._requests.pop(request.id, None)
            self._slots.pop(request.slot, None)
        request.deliver(text, reason, error)

    def _deliver(self) -> None:
        """Hand every output of the step to its request's sink."""
        outputs = self._manager.output_router.output_queue
        while True:
            try:
                output = outputs.get_nowait()
            except queue.Empty:
                return
            request = self._requests.get(output.request_id)
            if request is None or request.done:
                continue
            try:
                self._handle(request, output)
            except Exception as exc:  # a sink's or the tokenizer's error ends this request only
                self._manager.cancel_request(request.id)
                self._finish(request, "error", f"{type(exc).__name__}: {exc}"[:300])

    def _handle(self, request: _Request, output: Any) -> None:
        from transformers.generation.continuous_batching.requests import RequestStatus

        if output.status == RequestStatus.FAILED:
            self._finish(request, "error", str(output.error or "generation failed")[:300])
            return
        tokens = output.generated_tokens
        new = tokens[request.seen :]
        request.seen = len(tokens)  # EOS counted: the model generated it
        finished = output.status == RequestStatus.FINISHED
        eos = bool(finished and tokens and tokens[-1] in self.eos_token_ids)
        if eos:
            new = new[:-1]  # never text
        text = request.detokenizer.add(new) if new else ""
        if finished:
            text += request.detokenizer.flush()
        text, stopped = request.take_text(text, final=finished)
        if stopped:
            self._manager.cancel_request(request.id)
            self._finish(request, "stop", text=text)
        elif finished:
            self._finish(request, "stop" if eos else "length", text=text)
        else:
            request.deliver(text)

    def _warm_up(self) -> None:
        """One short request, generated here: the first forward's one-time costs (allocations, kernel setup) are
        paid at load, not by the first user request."""
        done = threading.Event()

        def sink(output: Output) -> None:
            if output.finish_reason is not None:
                done.set()

        prompt = self.encode("Hello")[: self.max_model_len - 2] or [0]
        self.submit(prompt, Sampling(max_tokens=2, temperature=0.0), sink)
        while not done.is_set():
            if not self._step():
                self._manager._wake_up_loop.wait(timeout=0.01)


def _content(content: Any, index: int) -> str:
    """A chat message's content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a generation: the generation config's ``eos_token_id``, else the model config's, else the
    tokenizer's."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else list(value)
        ids = [int(i) for i in ids if isinstance(i, int) and i >= 0]
        if ids:
            return ids
    return []


def is_causal_lm(model: str | None) -> bool:
    """Whether ``model`` is a causal LM ``serve`` generates with: a directory (or a hub id in the local hub cache)
    whose ``config.json`` names an architecture ending in ``ForCausalLM`` (or, naming none, a ``model_type``
    transformers has a causal LM class for), and that is no sentence-transformers save; or a cache file built with
    ``AutoModelForCausalLM``. Never raises: anything unreadable is ``False``."""
    if model is None:
        return False
    try:
        from ..bundle import is_cache_file, open_bundle

        if is_cache_file(model):
            with open_bundle(model) as bundle:
                return bundle.record.auto_class == "AutoModelForCausalLM"
        from ..hub import is_local_path, resolve_model

        path = model if is_local_path(model) else os.fspath(resolve_model(model))
        if not os.path.isdir(path) or os.path.lexists(os.path.join(path, "modules.json")):
            return False
        from .._boundedjson import load_file

        config = load_file(os.path.join(path, "config.json"), what="config.json", max_bytes=1 << 20)
        if not isinstance(config, dict):
            return False
        architectures = config.get("architectures")
        if isinstance(architectures, list) and architectures:
            return any(isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures)
        model_type = config.get("model_type")
        if not isinstance(model_type, str):
            return False
        import transformers.models.auto.modeling_auto as _auto_module

        auto: Any = _auto_module
        return model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except Exception:  # never raises: a model this cannot read is not one it serves as a causal LM
        return False


def load_llm(spec: EngineSpec) -> LLMEngine:
    """Load ``spec``'s causal LM in this (worker) process: a checkpoint directory through its content-named cache
    file (named here when ``cache_dir`` is set), or the cache file ``spec.model`` that holds the model; then set up
    continuous batching (its KV cache sized by ``spec.max_seqs`` and ``spec.max_model_len``) and warm it up.

    Raises:
        ValueError: no model; a bad checkpoint, scheme or option (named). FormatError, OSError: a model file cannot
            be read. Cache problems never raise: they are in :meth:`LLMEngine.stats`.
    """
    import torch

    from ..bundle import is_cache_file, open_bundle
    from ..loader import resolve_scheme
    from ..torch import check_kernels
    from .engines import prefault, spec_cache

    torch.set_num_threads(spec.torch_threads)
    hf: Any = importlib.import_module("packcache.hf")
    os.environ["HF_HUB_OFFLINE"] = "1"
    if spec.model is None:
        raise ValueError("the causal loader needs a model: a directory or a cache file")
    cache: Any
    if is_cache_file(spec.model):
        with open_bundle(spec.model) as bundle:
            scheme = bundle.record.scheme
        path: str | None = spec.model
        cache = None  # the file is its own cache
        given_scheme = None if spec.scheme in (None, "auto") else spec.scheme
        group_size = None
    else:
        scheme = given_scheme = resolve_scheme(spec.scheme)  # once: the file's name and the load agree on it
        group_size = spec.group_size
        path = spec.cache
        if path is not None and spec.cache_dir is not None:
            path = str(hf.default_cache_path(
                spec.model, scheme, group_size=group_size or _defaults.GROUP_SIZE, cache_dir=spec.cache_dir,
                auto_class="AutoModelForCausalLM",
            ))  # fmt: skip
        cache = spec_cache(spec, path, hf.platform(scheme, group_size or _defaults.GROUP_SIZE))
    started = time.perf_counter()
    model = hf.from_pretrained(
        spec.model, given_scheme, cache, auto_class="AutoModelForCausalLM", kernel_path=spec.kernel_path,
        group_size=group_size,
    )  # fmt: skip
    tokenizer = hf.tokenizer(spec.model)
    load_seconds = time.perf_counter() - started
    check_kernels(model)
    if spec.prefault:
        prefault(model)
    return LLMEngine(
        model, tokenizer, scheme=scheme, cache_file=path or "", load_seconds=load_seconds,
        model_id=spec.model_id or model_id_of(spec.model), max_seqs=spec.max_seqs, max_model_len=spec.max_model_len,
        page_size=spec.page_size,
    )  # fmt: skip
