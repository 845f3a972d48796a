"""Causal SDPA by query blocks: each block of queries attends only to the keys up to its own end.

Why: a packed row holding several documents gives SDPA an explicit ``[b, 1, s, s]`` mask, and with a mask
PyTorch's fused CPU kernel computes every query x key tile, including the upper triangle that causality masks
out anyway. Cutting the queries into blocks of ``B`` and giving block ``i`` only keys ``[0, (i + 1) * B)`` skips
those tiles: with ``n`` blocks the attention does ``(n + 1) / 2n`` of the work (62.5 % at 4 blocks). Every key
dropped is one the causal mask forbids, so the output is the same function of the inputs (the test compares it
with HF's ``sdpa`` to float rounding). What it gains, per model and CPU: bench/README.md.

Registered as its own HF attention implementation and set by ``install_blocked_attention`` at train time (the
config still says ``sdpa``), with the block size the run decided (``ultrascale/levers/``). Calls that are not a
full causal square with a mask (a one-document row, a KV cache, a short prompt, position bias) go to ``sdpa``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

# Model types whose decoder layers take a causal (or causal sliding-window) mask from HF's mask builder in
# transformers 5.22: a subset of the lower triangle, which is what makes dropping the upper keys exact.
# (Models with bidirectional overlays, e.g. image tokens in Gemma 3, are left out.)
CAUSAL_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                                "starcoder2", "smollm3", "phi3", "olmo2"})  # fmt: skip
MAX_BLOCKS = 16
"""More blocks skip little more (the saving tends to 50 %) but add a kernel call each; longer rows get larger blocks."""


def block_size_for(q_len: int, block: int) -> int:
    """The query block for a row of ``q_len``: ``block``, grown so that there are at most MAX_BLOCKS."""
    return max(block, -(-q_len // MAX_BLOCKS))


def blocked_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    block: int,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface signature; query ``[b, h, s, d]``, key/value ``[b, h_kv, s, d]``."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    size = block_size_for(q_len, block)
    plain = (
        not causal
        or attention_mask is None  # one document a row: SDPA's causal kernel skips the upper tiles itself
        or q_len != kv_len
        or q_len <= size
        or kwargs.get("cache") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    n_rep = getattr(module, "num_key_value_groups", 1)
    if n_rep > 1:  # as HF's sdpa does with a mask (enable_gqa with a mask measured slower on CPU)
        key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    outs = []
    for start in range(0, q_len, size):
        end = min(start + size, q_len)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, :end],
                value[:, :, :end],
                attn_mask=attention_mask[..., start:end, :end],
                dropout_p=dropout,
                scale=scaling,
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def implementation_name(block: int) -> str:
    """Register (once per block size) and return the HF attention-implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = f"ultrascale_sdpa_blocks{block}"
    AttentionInterface.register(name, functools.partial(blocked_sdpa_forward, block=block))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def install_blocked_attention(model, block: int) -> None:
    """Switch the built model to the blocked implementation, as decided (``ultrascale.levers.decide``: a causal
    ``sdpa`` decoder, ``block`` >= 1; the decision says why not, this only acts on it)."""
    model.set_attn_implementation(implementation_name(block))
