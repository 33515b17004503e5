"""Attention over each sequence's own tokens: what a text gets does not depend on the texts padded beside it.

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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["per_sequence"]

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
