"""The attention patch for decoding: while the sampler runs, a causal ``sdpa`` decoder's decoding steps share
the key/value heads inside the kernel (:func:`decode_attn_forward`) instead of HF's ``repeat_kv`` copy;
:func:`decode_attention` switches the model over and back (the in-training eval generates with the model being
trained)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

DECODE_QUERIES = 16
"""Calls with at most this many new positions per row (decoding, draft verification) take the GQA path."""

DECODE_ATTENTION = "ultrascale_decode"


def decode_attn_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
    """SDPA with the key/value heads shared in the kernel (``enable_gqa``) for decoding steps. HF's ``sdpa`` copies
    every layer's whole KV cache to the query heads' count (``repeat_kv``) when there is a mask, which is every
    step of a left-padded batch: 3x the cache read and a copy, 20x slower at 8 rows x 400 keys (bench/README.md).
    Prefill (many queries, HF's causal mask) goes to HF's own path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q = query.shape[2]
    if q > DECODE_QUERIES or (attention_mask is None and q > 1) or kw.get("position_bias") is not None or kw.get("softcap") is not None:  # fmt: skip
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kw)
    gqa = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                           enable_gqa=gqa)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def decode_attention_fits(model) -> bool:
    """Whether the patch applies: a causal decoder on ``sdpa`` (HF's, or training's blocked one)."""
    from ultrascale.model.attention import CAUSAL_MODEL_TYPES

    before = getattr(model.config, "_attn_implementation", None)
    ok = before == "sdpa" or str(before).startswith("ultrascale_sdpa_blocks")
    return ok and getattr(model.config, "model_type", None) in CAUSAL_MODEL_TYPES


@contextmanager
def decode_attention(model) -> Iterator[None]:
    """Run the block with ``model`` on :func:`decode_attn_forward` (where it fits), and put its implementation
    back afterwards, also after an error."""
    if not decode_attention_fits(model):
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    before = model.config._attn_implementation
    AttentionInterface.register(DECODE_ATTENTION, decode_attn_forward)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(DECODE_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
