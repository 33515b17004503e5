"""Attention over each sequence's own tokens: what a text gets does not depend on the texts beside it.

transformers runs an encoder's batch padded to its longest text, and its ``sdpa`` attention sums over that
padded length: the masked keys weigh zero, but how the sums are cut up depends on the length, so a text's
vector moves in its last bits with what shares its batch. :data:`NAME` is an attention function registered
with transformers' ``AttentionInterface`` (and its mask with ``AttentionMaskInterface``) that runs
``scaled_dot_product_attention`` once per sequence over its real tokens alone, the same call a text gets when
it is alone. :func:`per_sequence` switches a loaded encoder to it.

Only a padding mask is taken apart this way (every query row allows the same keys: a bidirectional encoder's
mask). Any other mask (causal, sliding, custom), or a term added to the scores (a position bias, a softcap), runs
transformers' ``sdpa`` function unchanged, so a model this is set on by mistake computes what it computed before.
A model whose attention is its own code, not transformers' attention functions (MPNet), is not switched.

Under continuous batching (a causal LM generating, :mod:`packcache.server.llm`) every step is one packed forward of
all running sequences, and transformers' ``sdpa`` runs one call over the whole pack with a block-diagonal mask: a
request's logits moved with its neighbours. There :data:`NAME` updates the paged KV cache exactly as transformers'
``sdpa`` does, then gives each query row of each sequence its own call: one row over the keys of its sequence up to
its own position, the call the row gets when it is decoded. One row, not one sequence: a prompt is read in one step
alone but may be split over steps among others (they share the step's token budget), and
``scaled_dot_product_attention`` gives a row other bits when the number of query rows or keys of its call changes
(fp32: calls of 1 to 3 rows against more; fp32 and bf16: masked keys appended). Each call reads the sequence's keys
token-major from a 64-byte aligned address (the cache's own read when it is laid out so, else a copy) and a copy of
the query row, so neither the sequence's place in the pack nor its length changes the call; several query heads
per key head go to ``sdpa``'s ``enable_gqa`` (transformers' choice on CPU without a mask).
:func:`per_sequence_generating` switches a model whose continuous batching is set up. A sliding window, attention
sinks, a softcap, a position bias, dropout or several layer types (more than one kind of key lengths) run
transformers' ``sdpa`` unchanged, as above.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["NAME", "per_sequence", "per_sequence_generating", "plain_sdpa"]

#: The name packcache's attention function is registered under.
NAME = "packcache_per_sequence"


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[batch, heads, q_len, dim]``, ``key`` and ``value``
    ``[batch, kv_heads, kv_len, dim]``; returns ``[batch, q_len, heads, dim]`` and no weights."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if kwargs.get("cache") is not None:  # continuous batching: a packed step of causal sequences
        if dropout or not _takes_apart(module, query, kwargs):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)  # fmt: skip
        return _per_row(module, query, key, value, scaling, kwargs), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    padding = _padding(attention_mask, query.shape[2], key.shape[2])
    changes_the_math = any(kwargs.get(name) is not None for name in _OTHER_TERMS)
    if causal or dropout or changes_the_math or padding is _OTHER:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    batch, heads, length, dim = query.shape
    out = query.new_zeros(batch, length, heads, dim)  # a padded position's output: zeros (nothing reads it)
    for b in range(batch):
        if padding is None:
            rows: slice | torch.Tensor = slice(None)
        else:
            real = padding[b]
            count = int(real.sum())
            if not count:
                continue
            # a right-padded sequence (the usual case) is a slice; any other pattern is gathered
            rows = slice(0, count) if bool(real[:count].all()) else real.nonzero().squeeze(1)
        # contiguous copies: the same call, on the same memory layout, as the sequence alone gets
        q, k, v = (t[b : b + 1, :, rows].contiguous() for t in (query, key, value))
        context = F.scaled_dot_product_attention(q, k, v, scale=scaling)
        out[b, rows] = context[0].transpose(0, 1)
    return out, None


def _takes_apart(module: torch.nn.Module, query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a continuous batching step's call is one :func:`_per_row` computes as transformers' ``sdpa`` would:
    causal full attention of a pack (batch 1), cache reads by index, one kind of key lengths, nothing added to the
    scores."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    lengths = kwargs.get("cu_seq_lens_k")
    return (
        isinstance(kwargs.get("cache"), PagedAttentionCache)
        and kwargs.get("block_table") is None  # the decode fast path: its kernel reads and writes the cache itself
        and kwargs.get("cu_seq_lens_q") is not None
        and isinstance(lengths, dict)
        and list(lengths) == ["full_attention"]  # a sliding layer keeps a window of keys, read otherwise
        and not any(kwargs.get(name) is not None for name in _OTHER_TERMS if name != "cache")
        and getattr(module, "sinks", None) is None
        and getattr(module, "is_causal", True) is not False
        and isinstance(getattr(module, "layer_idx", None), int)
        and query.shape[0] == 1
    )


def _per_row(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """A packed step's attention, one call per query row over its sequence's keys up to its position.

    ``query`` ``[1, heads, rows, dim]`` holds every sequence's new rows, one after another (``cu_seq_lens_q``);
    ``key`` and ``value`` ``[1, kv_heads, rows, dim]`` their new keys, which the cache stores before it hands back
    each sequence's keys, cached and new (``cu_seq_lens_k``). Returns ``[1, rows, heads, dim]``."""
    # transformers' sdpa path, unchanged: the cache writes the new keys and reads back each sequence's whole
    # keys (it also narrows kwargs["cu_seq_lens_k"] to this layer's kind)
    key, value = kwargs["cache"].update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    starts_q = [int(i) for i in kwargs["cu_seq_lens_q"].tolist()]
    starts_k = [int(i) for i in kwargs["cu_seq_lens_k"].tolist()]
    _, heads, rows, _ = query.shape
    grouped = key.shape[1] != heads  # several query heads per key head: sdpa reads each key head once for them
    out = query.new_zeros(1, rows, heads, value.shape[-1])  # rows of no sequence (padding): zeros, nothing reads them
    attend = F.scaled_dot_product_attention
    for first_q, end_q, first_k, end_k in zip(starts_q, starts_q[1:], starts_k, starts_k[1:], strict=False):
        if end_q == first_q:
            continue
        keys, values = _token_major(key[:, :, first_k:end_k]), _token_major(value[:, :, first_k:end_k])
        past = (end_k - first_k) - (end_q - first_q)  # the sequence's keys before this step's rows
        # row r attends to its own position and the ones before: the first past + r + 1 keys; its query is copied
        # (a new buffer: the same alignment whatever the row's place in the pack)
        contexts = [
            attend(query[:, :, first_q + r : first_q + r + 1].clone(memory_format=torch.contiguous_format),
                   keys[:, :, : past + r + 1], values[:, :, : past + r + 1], scale=scaling, enable_gqa=grouped)
            for r in range(end_q - first_q)
        ]  # fmt: skip
        context = contexts[0] if len(contexts) == 1 else torch.cat(contexts, dim=2)
        out[0, first_q:end_q] = context[0].transpose(0, 1)
    return out


#: Bytes torch's CPU allocator aligns a new buffer to.
_ALIGNMENT = 64


def _token_major(states: torch.Tensor) -> torch.Tensor:
    """``states`` ``[1, heads, tokens, dim]`` (one sequence's keys or values) laid out token-major (a token's heads
    side by side) from a 64-byte aligned address: ``states`` itself when it is (what the cache hands back is
    token-major; a sequence's start is aligned when a token's heads fill whole 64 bytes), else a copy in a new
    buffer. So every row's call reads one layout from one alignment, whatever the sequence's place in the pack or
    its length."""
    _, heads, tokens, dim = states.shape
    if states.stride()[1:] == (dim, heads * dim, 1) and states.data_ptr() % _ALIGNMENT == 0:
        return states
    buffer = torch.empty(tokens, heads, dim, dtype=states.dtype, device=states.device)
    buffer.copy_(states[0].transpose(0, 1))
    return buffer.permute(1, 0, 2).unsqueeze(0)


#: Arguments of transformers' attention functions that add to the scores or change the softmax: with any of them the
#: call is transformers' own ``sdpa`` (which knows them), not split per sequence.
_OTHER_TERMS = ("cache", "position_bias", "softcap", "sliding_window", "s_aux", "sinks")

#: :func:`_padding`'s answer for a mask that is not only padding.
_OTHER = torch.empty(0)


def _padding(mask: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
    """``[batch, kv_len]`` bool, True at real tokens, if ``mask`` is only a padding mask; ``None`` without a mask;
    :data:`_OTHER` for any other mask."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != q_len or mask.shape[3] != kv_len or q_len != kv_len:
        return _OTHER
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    real = allowed[:, 0, :]  # the keys the first query row may see
    if not torch.equal(allowed, real[:, None, :].expand_as(allowed)):
        return _OTHER
    return real


_registered = [False]


def register() -> None:
    """Register :data:`NAME` with transformers (once per process); its mask is transformers' ``sdpa`` mask."""
    if _registered[0]:
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered[0] = True


def per_sequence_generating(model: Any) -> bool:
    """Switch a causal LM on ``sdpa`` attention to :data:`NAME` for continuous batching; returns whether it was
    switched.

    Call it after transformers' continuous batching has made its batch processor: ``init_continuous_batching``
    refuses any attention but its own, and the processor builds the packed mask (which the calls :data:`NAME` hands
    back to ``sdpa`` need) only for a model on ``sdpa`` or ``eager`` when it is made. :func:`plain_sdpa` switches
    back before the next setup."""
    config = getattr(model, "config", None)
    if config is None or not getattr(model, "_supports_attention_backend", False):
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    model.set_attn_implementation(NAME)
    return True


def plain_sdpa(model: Any) -> None:
    """Switch a model :func:`per_sequence_generating` switched back to ``sdpa`` (continuous batching's setup takes no
    other); any other model is left alone."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME:
        model.set_attn_implementation("sdpa")


def per_sequence(model: Any) -> bool:
    """Switch a loaded transformers model to :data:`NAME` if it is an encoder on ``sdpa`` or ``eager`` attention (a
    model that generates text keeps its own); returns whether it was switched."""
    config = getattr(model, "config", None)
    if config is None or model.can_generate() or getattr(config, "is_decoder", False):
        return False
    if not getattr(model, "_supports_attention_backend", False):  # its attention is its own code (MPNet's)
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    register()
    model.set_attn_implementation(NAME)
    return True
