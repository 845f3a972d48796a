"""The one training-FLOPs formula: the planner's time model and the trainer's MFU both use it.

Convention (PaLM appendix B / Megatron): per token, a forward+backward pass costs 6 FLOPs per matmul
weight the token touches, plus 12·L·(heads·head_dim)·s for the attention score and value matmuls.
The trainer's MFU counts causal attention over the lower triangle only (``causal=True``, MaxText's
convention): that is all a causal model needs and what a causal kernel computes, so MFU stays a fraction of
a calibrated peak. The planner's time model keeps the full count: its matmul efficiency is calibrated against
published figures made so. Adaptations: the input embedding is a lookup (no FLOPs); the LM head always counts
(tied or not); GQA is already in the parameter count and does not change the score matmuls; MoE counts routed
experts at top_k/experts of their size; a sliding window caps the attended span. Recompute is *not* included:
MFU counts model FLOPs, not hardware FLOPs.
"""

from __future__ import annotations

from typing import Any

from ultrascale.model.arch import Arch, arch_from_hf


def attention_span(arch: Arch, seq_len: int) -> int:
    """Keys each query attends to (the sliding window caps it)."""
    return min(seq_len, arch.sliding_window) if arch.sliding_window else seq_len


def causal_span(arch: Arch, seq_len: int) -> float:
    """Keys a query attends to on average under a causal mask: (s+1)/2, or less the window."""
    w = attention_span(arch, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def flops_per_token(arch: Arch, seq_len: int, causal: bool = False) -> float:
    """Model FLOPs per trained token (forward + backward) for an :class:`Arch`."""
    span = causal_span(arch, seq_len) if causal else attention_span(arch, seq_len)
    return 6.0 * arch.active_matmul_params + 12 * arch.layers * arch.heads * arch.head_dim * span


def train_flops_per_token(hf_config: Any, seq_len: int, causal: bool = False) -> float:
    """Model FLOPs per trained token for an HF config: ``6·N_active + 12·L·h·s`` (``s`` → (s+1)/2 if causal).

    ``tokens/s × train_flops_per_token(causal=True) / (peak FLOP/s × ranks)`` is the trainer's MFU.
    """
    return flops_per_token(arch_from_hf(hf_config), seq_len, causal)
