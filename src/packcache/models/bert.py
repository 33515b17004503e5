"""A BERT encoder in plain torch, over token-packed batches (imports torch).

The skeleton is built on the ``meta`` device without running any initialisation:
its weights come from :func:`packcache.torch.convert` (served from the cache) or
:func:`packcache.torch.materialize`. Parameter names match Hugging Face's
``BertModel`` checkpoints.

The forward pass runs on *packed tokens*: the real tokens of every sequence of a
call are concatenated into one ``[tokens, hidden]`` matrix, so the linear layers,
GELU, LayerNorm and residual adds never compute a padding token, and each packed
layer is called once per call, which is what amortises its per-call work (the
dequantisation of an int8/int4 weight, see :mod:`packcache.kernels`). Only the
attention needs whole sequences: each :class:`AttentionGroup` of sequences of
similar length is padded for ``scaled_dot_product_attention`` and unpadded after.

>>> batch = PackedTokens.build([[101, 7, 102], [101, 102]], [[0, 0, 0], [0, 0]], [2])
>>> batch.ids.tolist(), batch.positions.tolist(), batch.lengths
([101, 7, 102, 101, 102], [0, 1, 2, 0, 1], [3, 2])
"""

from __future__ import annotations

import math
import os
import reprlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from .. import _boundedjson as boundedjson
from ..errors import FormatError

__all__ = ["MAX_CONFIG_BYTES", "MAX_SIZE", "AttentionGroup", "BertConfig", "BertEncoder", "PackedTokens"]


#: Largest count or dimension a ``config.json`` field may give: far past any BERT, far below an overflow.
#: What bounds a load is the checkpoint itself: :meth:`BertConfig.mismatch` checks every shape the
#: config implies against the safetensors header before anything is built.
MAX_SIZE = 1 << 31

#: The integer fields of :class:`BertConfig` (each from 1 to :data:`MAX_SIZE`).
_SIZES = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "max_position_embeddings", "type_vocab_size",
)  # fmt: skip

#: At most this many characters of a value go into a message (a 60 MB string must not become a 60 MB message).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` the encoder needs.

    Checked when made: every size an integer from 1 to :data:`MAX_SIZE` (``true`` is not a
    number), ``hidden_size`` a multiple of ``num_attention_heads``, ``layer_norm_eps`` a
    positive finite number, ``hidden_act`` ``gelu`` and ``position_embedding_type``
    ``absolute`` (the only ones this encoder computes), not ``is_decoder`` (it attends both ways), ``model_type``
    a string.

    >>> BertConfig(num_attention_heads=0)
    Traceback (most recent call last):
    ...
    ValueError: num_attention_heads must be an integer from 1 to 2147483648, got 0
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_embedding_type: str = "absolute"
    is_decoder: Any = False  #: a decoder BERT attends to earlier tokens only: this encoder does not compute it
    model_type: str = "bert"  #: names the default cache file (a BERT-family checkpoint may say "roberta", ...)

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ValueError(problem)

    def _problem(self) -> str | None:
        for name in _SIZES:
            value = getattr(self, name)
            # true for a count was read as 1, a zero heads count divided by zero; pinned by
            #   tests/test_bert.py::test_bert_config_refuses_bad_values_made_in_code_too,
            #   tests/test_bert.py::test_any_values_in_config_json_make_a_checked_config_or_one_format_error
            if type(value) is not int or not 1 <= value <= MAX_SIZE:
                return f"{name} must be an integer from 1 to {MAX_SIZE}, got {_REPR.repr(value)}"
        eps = self.layer_norm_eps
        # pinned by tests/test_bert.py::test_bert_config_refuses_bad_values_made_in_code_too
        if type(eps) not in (int, float) or not math.isfinite(eps) or eps <= 0:
            return f"layer_norm_eps must be a positive finite number, got {_REPR.repr(eps)}"
        # another activation was computed as gelu, relative positions as absolute, without a word; pinned by
        #   tests/test_minilm.py::test_malformed_model_files_end_in_one_line_naming_the_file_and_the_field
        if self.hidden_act != "gelu":
            return f"hidden_act {_REPR.repr(self.hidden_act)} is not supported (only 'gelu')"
        if self.position_embedding_type != "absolute":
            kind = _REPR.repr(self.position_embedding_type)
            return f"position_embedding_type {kind} is not supported (only 'absolute')"
        # a decoder's causal attention was computed both ways, without a word; pinned by
        #   tests/test_bert.py::test_a_decoder_bert_is_refused_not_run_as_an_encoder
        if self.is_decoder not in (False, None):
            return (
                f"is_decoder {_REPR.repr(self.is_decoder)} is not supported (a decoder; this encoder attends both ways)"
            )
        if not isinstance(self.model_type, str):
            return f"model_type must be a string, got {type(self.model_type).__name__}"
        # pinned by tests/test_bert.py::test_bert_config_refuses_bad_values_made_in_code_too
        if self.hidden_size % self.num_attention_heads:
            return f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
        return None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> BertConfig:
        """Read ``config.json``; unknown fields are ignored, missing ones take the defaults above.

        Read as every checkpoint file is (:func:`packcache._boundedjson.load_file`: no FIFO hang,
        a regular file of at most :data:`MAX_CONFIG_BYTES`, bounded JSON).

        Raises:
            FormatError: not a JSON object, or a field that fails the checks above (the message
                names the file and the field).
            UntrustedFileError: not a regular file. OSError: it cannot be read.
        """
        name = os.fspath(path)
        return cls.from_settings(boundedjson.load_file(name, what="config", max_bytes=MAX_CONFIG_BYTES), name)

    @classmethod
    def from_settings(cls, raw: Any, name: str) -> BertConfig:
        """:meth:`from_file` of ``config.json`` already parsed (``name`` in messages): a cache file's embedded one.

        Raises:
            FormatError: as :meth:`from_file`.
        """
        if not isinstance(raw, dict):
            raise FormatError(f"not a JSON object of settings (a JSON {_json_kind(raw)})", path=name)
        fields = {field: raw[field] for field in cls.__dataclass_fields__ if field in raw}
        try:
            return cls(**fields)
        except ValueError as exc:
            raise FormatError(str(exc), path=name) from None

    def tensor_shapes(self) -> Iterator[tuple[str, tuple[int, ...], tuple[str, ...]]]:
        """Every parameter of :class:`BertEncoder` of this config, in its order: ``(name, shape, the
        fields that set it)``. A generator: a consumer that stops at the first problem never walks
        the layers of an absurd ``num_hidden_layers``.

        >>> [(n, s) for n, s, _ in BertConfig(num_hidden_layers=1).tensor_shapes()][:2]
        [('embeddings.word_embeddings.weight', (30522, 384)), ('embeddings.position_embeddings.weight', (512, 384))]
        """
        width, inner = self.hidden_size, self.intermediate_size
        yield "embeddings.word_embeddings.weight", (self.vocab_size, width), ("vocab_size", "hidden_size")
        yield "embeddings.position_embeddings.weight", (self.max_position_embeddings, width), (
            "max_position_embeddings", "hidden_size",
        )  # fmt: skip
        yield "embeddings.token_type_embeddings.weight", (self.type_vocab_size, width), (
            "type_vocab_size", "hidden_size",
        )  # fmt: skip
        for part in ("weight", "bias"):
            yield f"embeddings.LayerNorm.{part}", (width,), ("hidden_size",)
        wide = ("num_hidden_layers", "hidden_size")
        inner_fields = (*wide, "intermediate_size")
        for index in range(self.num_hidden_layers):
            layer = f"encoder.layer.{index}"
            for linear in (*(f"attention.self.{part}" for part in ("query", "key", "value")), "attention.output.dense"):
                yield f"{layer}.{linear}.weight", (width, width), wide
                yield f"{layer}.{linear}.bias", (width,), wide
            for part in ("weight", "bias"):
                yield f"{layer}.attention.output.LayerNorm.{part}", (width,), wide
            yield f"{layer}.intermediate.dense.weight", (inner, width), inner_fields
            yield f"{layer}.intermediate.dense.bias", (inner,), inner_fields
            yield f"{layer}.output.dense.weight", (width, inner), inner_fields
            yield f"{layer}.output.dense.bias", (width,), wide
            for part in ("weight", "bias"):
                yield f"{layer}.output.LayerNorm.{part}", (width,), wide

    def mismatch(self, shape_of: Callable[[str], tuple[int, ...] | None]) -> str | None:
        """The first parameter whose shape a checkpoint does not have (``shape_of(name)``: its shape, or
        ``None`` when it holds no such tensor), as a sentence naming the fields; ``None`` if all match.
        Run before :class:`BertEncoder` is built: a config's sizes are then never larger than the weights.

        >>> held = {name: shape for name, shape, _ in BertConfig(num_hidden_layers=1).tensor_shapes()}
        >>> print(BertConfig(num_hidden_layers=2).mismatch(held.get))  # doctest: +NORMALIZE_WHITESPACE
        num_hidden_layers 2, hidden_size 384 call for encoder.layer.1.attention.self.query.weight
        of shape [384, 384]: the checkpoint has no such tensor
        """
        # pinned by tests/test_minilm.py::test_a_config_the_weights_do_not_match_is_refused_before_the_skeleton_is_built
        for name, shape, fields in self.tensor_shapes():
            found = shape_of(name)
            if found == shape:
                continue
            given = ", ".join(f"{field} {getattr(self, field)}" for field in fields)
            held = "the checkpoint has no such tensor" if found is None else f"it is {list(found)}"
            return f"{given} call for {name} of shape {list(shape)}: {held}"
        return None


#: Largest ``config.json`` read (a BERT config is under 1 KiB; one with a label map for every class, a few MiB).
MAX_CONFIG_BYTES = 16 << 20


def _json_kind(value: object) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


# --------------------------------------------------------------------------- packed tokens


@dataclass(frozen=True)
class AttentionGroup:
    """Consecutive sequences of a :class:`PackedTokens` attended together, padded to the longest.

    Attributes:
        start, end: their rows in the packed matrix.
        batch, length: the padded shape ``[batch, length]``.
        gather: long ``[batch * length]``: the packed row of each padded position (a padded
            position repeats the group's first row, masked out as a key); ``None`` without padding.
        scatter: long ``[end - start]``: the padded position of each real token; ``None`` without padding.
        key_mask: bool ``[batch, 1, 1, length]`` for the attention (True: attend); ``None`` without padding.
    """

    start: int
    end: int
    batch: int
    length: int
    gather: torch.Tensor | None
    scatter: torch.Tensor | None
    key_mask: torch.Tensor | None

    @classmethod
    def of(cls, start: int, lengths: Sequence[int]) -> AttentionGroup:
        """The group of sequences of ``lengths`` whose tokens start at packed row ``start``."""
        batch, longest, total = len(lengths), max(lengths), sum(lengths)
        if min(lengths) == longest:
            return cls(start, start + total, batch, longest, None, None, None)
        mask = torch.zeros(batch, longest, dtype=torch.bool)
        for i, length in enumerate(lengths):
            mask[i, :length] = True
        flat = mask.view(-1)
        scatter = flat.nonzero().view(-1)
        gather = torch.full((batch * longest,), start, dtype=torch.long)
        gather[scatter] = torch.arange(start, start + total)
        return cls(start, start + total, batch, longest, gather, scatter, mask[:, None, None, :])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, out: torch.Tensor) -> None:
        """Scaled dot-product attention of this group's rows of packed ``q``, ``k``, ``v`` ``[tokens, width]``,
        written to the same rows of ``out``."""
        width = q.shape[1]

        def padded(x: torch.Tensor) -> torch.Tensor:
            rows = x[self.start : self.end] if self.gather is None else x.index_select(0, self.gather)
            return rows.view(self.batch, self.length, heads, width // heads).transpose(1, 2)

        context = nn.functional.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=self.key_mask)
        context = context.transpose(1, 2).reshape(self.batch * self.length, width)
        if self.scatter is None:
            out[self.start : self.end] = context
        else:
            torch.index_select(context, 0, self.scatter, out=out[self.start : self.end])


@dataclass(frozen=True)
class PackedTokens:
    """Token sequences concatenated without padding, with the groups their attention runs in.

    Build it with :meth:`build`. ``ids``, ``types`` and ``positions`` are long ``[tokens]``;
    ``lengths`` gives each sequence's token count, in packed order.
    """

    ids: torch.Tensor
    types: torch.Tensor
    positions: torch.Tensor
    lengths: list[int]
    groups: list[AttentionGroup]

    @classmethod
    def build(
        cls, ids: Sequence[Sequence[int]], types: Sequence[Sequence[int]], group_sizes: Sequence[int]
    ) -> PackedTokens:
        """Pack sequences (token ids and type ids, in packed order), cut into attention groups of
        ``group_sizes`` consecutive sequences each (they must add up to ``len(ids)``).

        Raises:
            ValueError: group sizes that do not cover the sequences, or an empty sequence.
        """
        if sum(group_sizes) != len(ids) or any(size <= 0 for size in group_sizes):
            raise ValueError(f"group sizes {list(group_sizes)} do not cover {len(ids)} sequences")
        lengths = [len(seq) for seq in ids]
        if any(length == 0 for length in lengths):
            raise ValueError("a sequence has no token (an encoded text holds at least [CLS] and [SEP])")
        flat_ids = [token for seq in ids for token in seq]
        flat_types = [token for seq in types for token in seq]
        positions = [p for length in lengths for p in range(length)]
        groups: list[AttentionGroup] = []
        first = row = 0
        for size in group_sizes:
            members = lengths[first : first + size]
            groups.append(AttentionGroup.of(row, members))
            first, row = first + size, row + sum(members)
        as_long = torch.tensor
        return cls(
            as_long(flat_ids, dtype=torch.long),
            as_long(flat_types, dtype=torch.long),
            as_long(positions, dtype=torch.long),
            lengths,
            groups,
        )


# --------------------------------------------------------------------------- the skeleton


_M = TypeVar("_M", bound=nn.Module)


def _tree(module: _M, **children: nn.Module) -> _M:
    """``module``, fresh from ``nn.Module.__init__``, made inference-only and holding ``children``:
    written straight into its tables, without ``nn.Module.__setattr__``'s checks per attribute,
    which cost more than building the whole skeleton otherwise (every warm load builds one)."""
    module.__dict__["training"] = False
    module._modules.update(children)
    return module


def _linear(in_features: int, out_features: int) -> nn.Linear:
    """An ``nn.Linear`` with ``meta`` parameters, built without running its initialisation.

    ``nn.Linear.__init__`` runs ``reset_parameters`` (kaiming init) even on ``meta``: a third of a
    warm load's time for nothing, since :func:`~packcache.torch.convert` replaces every weight.
    """
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.__dict__.update(in_features=in_features, out_features=out_features, training=False)
    layer._parameters["weight"] = nn.Parameter(torch.empty(out_features, in_features, device="meta"), False)
    layer._parameters["bias"] = nn.Parameter(torch.empty(out_features, device="meta"), False)
    return layer


def _layer_norm(width: int, eps: float) -> nn.LayerNorm:
    """An ``nn.LayerNorm`` with ``meta`` parameters, built without running its initialisation."""
    norm = nn.LayerNorm.__new__(nn.LayerNorm)
    nn.Module.__init__(norm)
    norm.__dict__.update(normalized_shape=(width,), eps=eps, elementwise_affine=True, training=False)
    norm._parameters["weight"] = nn.Parameter(torch.empty(width, device="meta"), False)
    norm._parameters["bias"] = nn.Parameter(torch.empty(width, device="meta"), False)
    return norm


def _embedding(count: int, width: int) -> nn.Embedding:
    # An explicit weight skips reset_parameters (in torch 2.13 the first normal_() on a large
    # meta tensor allocates ~70 MB of anonymous memory, for nothing).
    embedding = nn.Embedding(count, width, _weight=torch.empty(count, width, device="meta"), _freeze=True)
    embedding.training = False
    return embedding


class _SelfAttention(nn.Module):
    query: nn.Linear
    key: nn.Linear
    value: nn.Linear

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        width = config.hidden_size
        _tree(self, query=_linear(width, width), key=_linear(width, width), value=_linear(width, width))


class _DenseNorm(nn.Module):
    dense: nn.Linear
    LayerNorm: nn.LayerNorm

    def __init__(self, in_features: int, config: BertConfig) -> None:
        super().__init__()
        norm = _layer_norm(config.hidden_size, config.layer_norm_eps)
        _tree(self, dense=_linear(in_features, config.hidden_size), LayerNorm=norm)


class _Attention(nn.Module):
    output: _DenseNorm

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        _tree(self, self=_SelfAttention(config), output=_DenseNorm(config.hidden_size, config))


class _Intermediate(nn.Module):
    dense: nn.Linear

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        _tree(self, dense=_linear(config.hidden_size, config.intermediate_size))


class _Layer(nn.Module):
    attention: _Attention
    intermediate: _Intermediate
    output: _DenseNorm

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        _tree(
            self,
            attention=_Attention(config),
            intermediate=_Intermediate(config),
            output=_DenseNorm(config.intermediate_size, config),
        )


class _Embeddings(nn.Module):
    word_embeddings: nn.Embedding
    position_embeddings: nn.Embedding
    token_type_embeddings: nn.Embedding
    LayerNorm: nn.LayerNorm

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        _tree(
            self,
            word_embeddings=_embedding(config.vocab_size, config.hidden_size),
            position_embeddings=_embedding(config.max_position_embeddings, config.hidden_size),
            token_type_embeddings=_embedding(config.type_vocab_size, config.hidden_size),
            LayerNorm=_layer_norm(config.hidden_size, config.layer_norm_eps),
        )


class _Encoder(nn.Module):
    layer: nn.ModuleList

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        layers.training = False
        _tree(self, layer=layers)


class BertEncoder(nn.Module):
    """A BERT encoder whose parameter names match Hugging Face's ``BertModel`` checkpoints.

    Built on ``meta`` (see the module docstring). :meth:`encode` runs packed tokens;
    :meth:`forward` takes the usual padded ``[batch, tokens]`` inputs.

    Attributes:
        compute_dtype: the dtype of the activations between the layers: ``torch.float32``,
            or ``torch.bfloat16`` on the ``bf16`` kernel path (attention, GELU, residual adds
            and LayerNorm inputs then run in bf16; LayerNorm accumulates in float32, and the
            embedding sums and their LayerNorm stay float32).
    """

    embeddings: _Embeddings
    encoder: _Encoder

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.compute_dtype = torch.float32
        _tree(self, embeddings=_Embeddings(config), encoder=_Encoder(config))

    def encode(self, tokens: PackedTokens) -> torch.Tensor:
        """The last hidden states of every packed token, ``[tokens, hidden]`` in :attr:`compute_dtype`."""
        heads = self.config.num_attention_heads
        _check_ids(tokens, self.config)
        emb = self.embeddings
        hidden = emb.word_embeddings(tokens.ids) + emb.position_embeddings(tokens.positions)
        hidden = emb.LayerNorm(hidden + emb.token_type_embeddings(tokens.types)).to(self.compute_dtype)
        for layer in self.encoder.layer:
            assert isinstance(layer, _Layer)
            attention = layer.attention.get_submodule("self")
            assert isinstance(attention, _SelfAttention)
            q, k, v = attention.query(hidden), attention.key(hidden), attention.value(hidden)
            context = torch.empty_like(q)
            for group in tokens.groups:
                group.attend(q, k, v, heads, context)
            out = layer.attention.output
            # In place on the layers' fresh outputs: every large new tensor costs its page faults again.
            hidden = out.LayerNorm(out.dense(context).add_(hidden))
            inner = torch.ops.aten.gelu_(layer.intermediate.dense(hidden))
            hidden = layer.output.LayerNorm(layer.output.dense(inner).add_(hidden))
        result: torch.Tensor = hidden
        return result

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Padded inputs ``[batch, length]`` (``mask`` 1 at real tokens); returns ``[batch, length, hidden]``
        in :attr:`compute_dtype`, zeros at padded positions."""
        batch, length = input_ids.shape
        valid = mask.reshape(-1).bool()
        positions = torch.arange(length, dtype=torch.long).expand(batch, length).reshape(-1)[valid]
        counts = mask.bool().sum(dim=1)
        if bool((counts == 0).any()):
            raise ValueError("a row of the mask has no token")
        tokens = PackedTokens(
            input_ids.reshape(-1)[valid],
            token_type_ids.reshape(-1)[valid],
            positions,
            counts.tolist(),
            [_masked_group(mask.bool())],
        )
        packed = self.encode(tokens)
        out = packed.new_zeros(batch * length, packed.shape[1])
        out[valid] = packed
        return out.view(batch, length, -1)


def _check_ids(tokens: PackedTokens, config: BertConfig) -> None:
    """Refuse token or type ids past the embedding tables (a tokenizer that does not belong to the config)
    with a sentence naming the field, rather than an ``IndexError`` from deep inside the embedding lookup."""
    if not tokens.ids.numel():
        return
    for ids, field in ((tokens.ids, "vocab_size"), (tokens.types, "type_vocab_size")):
        limit, low, high = getattr(config, field), int(ids.min()), int(ids.max())
        # pinned by tests/test_bert.py::test_a_tokenizer_giving_ids_past_the_tables_is_one_line_not_an_index_error
        if low < 0 or high >= limit:
            raise ValueError(
                f"the tokenizer gave id {high if high >= limit else low}, outside config.json's {field} {limit}: "
                "the tokenizer and the config are not of one model"
            )


def _masked_group(mask: torch.Tensor) -> AttentionGroup:
    """The one attention group of a padded batch whose real tokens are ``mask`` (bool ``[batch, length]``)."""
    batch, length = mask.shape
    flat = mask.reshape(-1)
    total = int(flat.sum())
    if total == batch * length:
        return AttentionGroup(0, total, batch, length, None, None, None)
    scatter = flat.nonzero().view(-1)
    gather = torch.zeros(batch * length, dtype=torch.long)
    gather[scatter] = torch.arange(total)
    return AttentionGroup(0, total, batch, length, gather, scatter, mask[:, None, None, :])
