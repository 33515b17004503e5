"""A loaded all-MiniLM-L6-v2 at work: :class:`MiniLM` embeds texts on the packed encoder, longest first, in
packed-token forward passes, mean-pooled and normalised as sentence-transformers computes it. How it is loaded is
:mod:`packcache.models.minilm`'s, where :class:`MiniLM` is importable from (the path to use).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tokenizers
import torch

from ..cache import WeightCache
from ..torch import ConversionReport, PackedLinear
from .bert import BertEncoder, PackedTokens

__all__ = ["MiniLM"]


class MiniLM:
    """A loaded all-MiniLM-L6-v2: :meth:`embed` texts into unit vectors of 384 floats.

    Attributes:
        scheme: ``fp32``, ``bf16``, ``int8`` or ``int4``.
        kernel_path: ``bf16`` or ``fp32``, the kernel path the packed layers and the rest of
            the encoder run (:mod:`packcache.kernels`); :attr:`kernels` names the torch ops.
        cache: the :class:`~packcache.WeightCache` the weights came from (caching off
            when :func:`~packcache.models.minilm.load` was given ``cache=False``).
        report: the :class:`~packcache.torch.ConversionReport` of the load.
        load_seconds: wall time of the weight load (cache open, map or pack).
        encoder: the :class:`BertEncoder` over the packed weights.
        tokenizer: the ``tokenizers.Tokenizer``.
    """

    def __init__(
        self,
        scheme: str,
        cache: WeightCache,
        encoder: BertEncoder,
        tokenizer: tokenizers.Tokenizer,
        report: ConversionReport,
        load_seconds: float,
        owns_cache: bool,
    ) -> None:
        self.scheme = scheme
        self.cache = cache
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.report = report
        self.load_seconds = load_seconds
        self.kernel_path = report.kernel_path
        self._owns_cache = owns_cache
        self._counting: tokenizers.Tokenizer | None = None

    @property
    def kernels(self) -> str:
        """The torch ops the packed linear layers run (e.g. the fused kernel for few rows, else dequantise + GEMM)."""
        for module in self.encoder.modules():
            if isinstance(module, PackedLinear):
                return module.packer.kernels(module.kernel_path)
        return "none (no packed layer)"

    @property
    def dimension(self) -> int:
        """Width of an embedding (384)."""
        return self.encoder.config.hidden_size

    @property
    def max_seq_length(self) -> int:
        """Tokens per text the encoder reads, special tokens included (256); :meth:`embed` truncates to it."""
        truncation = self.tokenizer.truncation
        return int(truncation["max_length"]) if truncation else self.encoder.config.max_position_embeddings

    def tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text before truncation, special tokens included, tokenized as :meth:`embed` does
        (stripped): a text is truncated by :meth:`embed` iff its count is over :attr:`max_seq_length`."""
        if isinstance(texts, str):
            raise TypeError("tokens() takes a sequence of strings; wrap a single text in a list")
        counting = self._counting
        if counting is None:
            # A copy without truncation: the embedding tokenizer keeps 256 tokens and cannot say how many there were.
            counting = self._counting = tokenizers.Tokenizer.from_str(self.tokenizer.to_str())
            counting.no_truncation()
        return [len(e.ids) for e in counting.encode_batch([str(t).strip() for t in texts])]

    def embed(
        self,
        texts: Sequence[str],
        batch_size: int | None = None,
        max_tokens: int = 8192,
        *,
        normalize: bool = True,
    ) -> np.ndarray[Any, Any]:
        """Embed ``texts``: float32 ``[len(texts), 384]``, mean-pooled over their tokens, L2-normalised
        (``normalize=False``: the mean-pooled vectors, before the model's Normalize module).

        Texts are stripped of surrounding whitespace and truncated to the tokenizer's
        limit (256 tokens), as sentence-transformers does. The encoder runs on packed tokens
        (:mod:`packcache.models.bert`): texts longest first, at most ``max_tokens`` tokens per
        forward pass (a longer text is a pass of its own), no padding anywhere: each text attends
        over its own tokens alone. ``batch_size`` is the most texts of a pass (``None``, the
        default: as many as ``max_tokens`` allows; a pass of 64 short texts ran 8 % faster than two
        of 32). With the compiled kernels (``packcache.native.status().batch_invariant``) and the
        fp32, bf16 or int8 scheme, a text's vector has the same bits alone and among any others;
        whatever the scheme, it never depends on where the weights came from.
        """
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of strings; wrap a single text in a list")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 (or None: as many as max_tokens holds), not {batch_size}")
        result = np.empty((len(texts), self.dimension), dtype=np.float32)
        encodings = self.tokenizer.encode_batch([str(t).strip() for t in texts])
        with torch.inference_mode():
            for order in _passes([len(e.ids) for e in encodings], batch_size or len(texts), max_tokens):
                # one attention group per text: its attention sums over its own tokens, whatever shares the pass
                tokens = PackedTokens.build(
                    [encodings[i].ids for i in order], [encodings[i].type_ids for i in order], [1] * len(order)
                )
                hidden = self.encoder.encode(tokens).float()
                lengths = torch.tensor(tokens.lengths)
                owner = torch.repeat_interleave(torch.arange(len(order)), lengths)
                pooled = hidden.new_zeros(len(order), hidden.shape[1]).index_add_(0, owner, hidden)
                pooled /= lengths[:, None].to(pooled.dtype)
                if normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
                result[order] = pooled.numpy()
        return result

    def close(self) -> None:
        """Close the cache if :func:`~packcache.models.minilm.load` opened it (embeddings computed stay valid)."""
        if self._owns_cache:
            self.cache.close()

    def __enter__(self) -> MiniLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MiniLM(scheme={self.scheme!r}, kernel_path={self.kernel_path!r}, cache={self.cache!r})"


def _passes(lengths: Sequence[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Indices longest first, cut into forward passes of at most ``batch_size`` texts and ``max_tokens`` tokens (a
    text longer than that is a pass of its own).

    >>> _passes([3, 10, 9, 2, 4], 2, 100)
    [[1, 2], [4, 0], [3]]
    >>> _passes([3, 10, 9, 2, 4], 8, 12)
    [[1], [2], [4, 0, 3]]
    """
    passes: list[list[int]] = []
    total = 0
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if not passes or len(passes[-1]) >= batch_size or total + lengths[index] > max_tokens:
            passes.append([])
            total = 0
        passes[-1].append(index)
        total += lengths[index]
    return passes


# The public face is packcache.models.minilm: reprs and help() name it, whichever private module defines the class.
MiniLM.__module__ = "packcache.models.minilm"
# doctest looks for a class's examples only in the module its __module__ names, and their methods' here.
__test__ = {"MiniLM": MiniLM}
