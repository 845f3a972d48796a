"""The one training-FLOPs formula: the planner's time model and the trainer's MFU both use it.

Convention (PaLM appendix B / Megatron): per token, a forward+backward pass costs 6 FLOPs per matmul
weight the token touches, plus 12·L·(heads·head_dim)·s for the attention score and value matmuls.
Causal masking is not halved (the usual MFU convention, so numbers compare with published MFU).
Adaptations: the input embedding is a lookup (no FLOPs); the LM head always counts (tied or not);
GQA is already in the parameter count (smaller k/v projections) and does not change the score matmuls;
MoE counts routed experts at top_k/experts of their size; a sliding window caps the attended span.
Recomputation (activation checkpointing) is *not* included: MFU counts model FLOPs, not hardware FLOPs.
"""

from __future__ import annotations

from typing import Any

from ultrascale.model.arch import Arch, arch_from_hf


def attention_span(arch: Arch, seq_len: int) -> int:
    """Keys each query attends to (the sliding window caps it)."""
    return min(seq_len, arch.sliding_window) if arch.sliding_window else seq_len


def flops_per_token(arch: Arch, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward) for an :class:`Arch`."""
    attn = 12 * arch.layers * arch.heads * arch.head_dim * attention_span(arch, seq_len)
    return 6.0 * arch.active_matmul_params + attn


def train_flops_per_token(hf_config: Any, seq_len: int) -> float:
    """Model FLOPs per trained token for an HF config: ``6·N_active + 12·L·h·s``.

    ``tokens/s × train_flops_per_token / (peak FLOP/s × ranks)`` is MFU.
    """
    return flops_per_token(arch_from_hf(hf_config), seq_len)
