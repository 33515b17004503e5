"""One generation request as the engine sees it: its sampling, its text as it is decoded, and what its sink gets.

Sampling is per request (OpenAI sends ``temperature``, ``top_p`` and ``seed`` with each request) while
transformers' is per manager: the manager decodes greedily, and one logits processor (:func:`sampler_class`)
samples each sampled row itself with its request's parameters and its own generator, leaving the chosen token the
only finite score so the greedy argmax takes it. A seeded request draws one uniform number per token from its own
generator (a row that gets no token, a prompt read in part, is never sampled); with the compiled kernels its
logits are the same bits alone and batched at every scheme (:mod:`packcache.server.llm`), so it gives the same
tokens alone and batched.

Sampling is exact for every value a request may give (:mod:`.requests` bounds them): the probabilities are
computed in float64 from the logits minus their maximum, so no temperature in (0, 2] overflows them (the smallest
ones give the limit of the distribution, the most likely token, ties shared) and no ``top_p`` in (0, 1] is lost
to rounding; every seed of the accepted range seeds its own stream (:func:`generator`).

A request's text is decoded incrementally (:class:`Detokenizer`: never half a character), and a tail that may
still become a stop string is held back until it is decided (:meth:`RequestState.take_text`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Detokenizer", "Output", "RequestState", "Sampling", "generator", "sample", "sampler_class"]

#: Added to a seed before it seeds numpy's ``SeedSequence`` (which takes non-negative integers only): every seed of
#: the accepted range, -2**63 to 2**64 - 1, maps to its own entropy.
SEED_OFFSET = 2**63


@dataclass(frozen=True)
class Sampling:
    """How one request generates.

    Attributes:
        max_tokens: tokens to generate at most (then ``finish_reason`` ``"length"``).
        temperature: ``0``: greedy; else the logits are divided by it before sampling.
        top_p: nucleus sampling: the smallest set of most likely tokens whose probabilities reach ``top_p``.
        seed: the request's generator seed (``None``: a random one): a seeded request repeats its tokens, and two
            seeds draw two streams (:func:`generator`).
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


class Detokenizer:
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


class RequestState:
    """One request's state, touched only by the engine's thread (but created in
    :meth:`~packcache.server.llm.LLMEngine.submit`)."""

    def __init__(
        self, request_id: str, slot: int, prompt: list[int], sampling: Sampling, sink: Callable[[Output], None],
        tokenizer: Any,
    ) -> None:  # fmt: skip
        self.id = request_id
        self.slot = slot
        self.prompt_tokens = len(prompt)
        self.sampling = sampling
        self.sink = sink
        self.detokenizer = Detokenizer(tokenizer)
        self.text = ""  # all the text decoded so far
        self.sent = 0  # characters of it delivered
        self.seen = 0  # generated tokens handled
        self.done = False
        self.greedy = sampling.temperature <= 0.0
        self.generator = None if self.greedy else generator(sampling.seed)

    def deliver(
        self, text: str, finish_reason: str | None = None, error: str | None = None, *, token: bool = False
    ) -> None:
        """Hand ``text`` to the sink at the end (``finish_reason``), whenever there is text, and for every generated
        ``token`` even when its text is empty (a partial UTF-8 sequence, or text a stop string may still claim): a
        stream sends an event per token, so a client sees each one, and the time to the first."""
        if self.done:
            return
        if finish_reason is not None:
            self.done = True
        elif not text and not token:
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


def sampler_class() -> type:
    """:class:`_Sampler`, made when transformers is imported (only a worker imports it)."""
    import transformers.generation.continuous_batching.cb_logits_processors as _cb_module

    cb: Any = _cb_module

    class _Sampler(cb.ContinuousBatchingLogitsProcessor):  # type: ignore[misc]
        """Samples every row of a sampled request with its own parameters and generator; greedy rows pass through.

        ``prepare_tensor_args`` gives each row its request's slot number; ``__call__`` (same thread, same step) finds
        the request by slot and leaves its chosen token the only finite score of the row."""

        supported_kwargs: dict[str, type] = {}  # noqa: RUF012  (the base class's shape)
        ignored_kwargs: tuple[str, ...] = ()

        def __init__(self, slots: dict[int, RequestState]) -> None:
            self.slots = slots
            self.rows = 0  # rows of this step with a new token (prepare_tensor_args)

        def fill_defaults(self, int32_tensor: Any) -> None:
            int32_tensor.fill_(-1)

        def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Any:
            import torch

            by_id = self.slots_by_id()
            self.rows = len(requests_with_new_token)
            return torch.tensor([by_id.get(r.state.request_id, -1) for r in requests_with_new_token], dtype=torch.int32)

        def slots_by_id(self) -> dict[str, int]:
            return {request.id: slot for slot, request in list(self.slots.items())}

        def __call__(self, scores: Any, tensor_arg: Any) -> Any:
            chosen: list[tuple[int, RequestState, np.random.Generator]] = []
            # A step has a row per sequence, but only the first self.rows get a token: the others (a prompt read
            # in part) hold row 0's logits and an earlier step's slot, and sampling one spent a draw of a request
            # that got no token from it.
            # pinned by tests/test_server_llm.py::test_a_seeded_request_draws_once_per_token_beside_a_split_prompt
            for row, slot in enumerate(tensor_arg[: min(scores.size(0), self.rows)].tolist()):
                request = self.slots.get(slot)
                if request is not None and request.generator is not None:  # a greedy row has none
                    chosen.append((row, request, request.generator))
            if not chosen:
                return scores
            scores = scores.clone()
            for row, request, draws in chosen:
                token = sample(scores[row], request.sampling, draws)
                scores[row].fill_(-math.inf)
                scores[row, token] = 0.0
            return scores

    return _Sampler


def generator(seed: int | None) -> np.random.Generator:
    """A request's own generator: numpy's PCG64 seeded through ``SeedSequence`` by ``seed + 2**63`` (``None``: fresh
    entropy from the OS). torch's CPU generator, used before, keeps only a seed's low 32 bits: seeds 0 and 2**32, or
    -1 and 2**64 - 1, drew the same tokens.

    >>> generator(0).random() != generator(2**32).random()
    True
    """
    # pinned by tests/test_server_llm.py::test_every_seed_of_the_accepted_range_draws_its_own_stream
    entropy = None if seed is None else seed + SEED_OFFSET
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def sample(logits: Any, sampling: Sampling, generator: np.random.Generator) -> int:
    """One token from ``logits`` (one row) at ``sampling``'s temperature and top_p, with one uniform draw of
    ``generator`` (so a seeded request's draws do not depend on the other rows of its steps).

    The probabilities are ``softmax((logits - max) / temperature)`` in float64: the shifted logits are at most 0, so
    no temperature overflows them (float32 logits divided by ``1e-40`` were inf, every probability NaN); a
    temperature so small that every other token underflows to 0 leaves the most likely ones, which is the limit of
    the distribution. The draw is float64 too, so it never rounds up onto a token of probability 0.

    No sort of the vocabulary (18 ms for 128k tokens, per row and step, on 2 cores): without top_p the draw is
    inverted on the cumulative probabilities in vocabulary order; with top_p the nucleus comes from ``topk`` over
    a growing ``k`` (most of the mass is in a few hundred tokens), and only a flat distribution reaches the whole
    vocabulary."""
    import torch

    # pinned by tests/test_server_llm.py::test_a_tiny_temperature_or_top_p_samples_the_argmax_and_never_nan
    scores = logits.to(torch.float64)
    probs = torch.softmax((scores - scores.max()) / sampling.temperature, dim=-1)
    draw = float(generator.random())
    if sampling.top_p >= 1.0:
        cumulative = torch.cumsum(probs, dim=-1)
        point = torch.tensor([draw * float(cumulative[-1])], dtype=torch.float64)
        return min(int(torch.searchsorted(cumulative, point, right=True)[0]), probs.numel() - 1)
    k = min(_NUCLEUS_START, probs.numel())
    while True:
        values, order = torch.topk(probs, k)  # sorted, largest first
        cumulative = torch.cumsum(values, dim=-1)
        if float(cumulative[-1]) >= sampling.top_p or k == probs.numel():
            break
        k = min(k * 8, probs.numel())
    keep = min(int(torch.searchsorted(cumulative, torch.tensor([sampling.top_p], dtype=torch.float64))[0]) + 1, k)
    total = float(cumulative[keep - 1])
    point = torch.tensor([draw * total], dtype=torch.float64)
    index = int(torch.searchsorted(cumulative[:keep], point, right=True)[0])
    return int(order[min(index, keep - 1)])


#: The first ``k`` of the nucleus search (:func:`sample`).
_NUCLEUS_START = 256
