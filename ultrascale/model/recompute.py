"""Activation recompute of an HF decoder: full (each layer recomputed from its input) or selective per-op.

Selective is torchtitan's op-level selective activation checkpointing (``torchtitan/distributed/
activation_checkpoint.py``, ``selective_ac_option="op"``), on ``torch.utils.checkpoint``'s
``create_selective_checkpoint_contexts``: inside each checkpointed decoder layer, the outputs of the matmuls and
of the attention kernel are kept from the forward (they cost FLOPs to recompute) and everything else (norms,
RoPE, the MLP's activation and product, residual adds, dtype casts) is recomputed in the backward (cheap,
memory-bound kernels). Per token and layer that keeps the layer input, q/k/v, the attention output and its
log-sum-exp, and the o/gate/up/down projections' outputs: about half of what an unchecked layer saves on a
Llama-shaped model, for a recompute of a few elementwise kernels instead of a whole forward. Why every matmul
output is kept: :func:`selective_policy`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch


def _aten(*names: str) -> set:
    """The ``aten`` ops of ``names`` (``op.overload``) that this torch has."""
    out = set()
    for name in names:
        op, overload = name.split(".")
        packet = getattr(torch.ops.aten, op, None)
        if packet is not None and overload in packet.overloads():
            out.add(getattr(packet, overload))
    return out


SAVE_OPS = frozenset(
    {
        *_aten(
            "mm.default",
            "addmm.default",
            "_grouped_mm.default",
            "_scaled_dot_product_flash_attention.default",
            "_scaled_dot_product_efficient_attention.default",
            "_scaled_dot_product_cudnn_attention.default",
            "_scaled_dot_product_flash_attention_for_cpu.default",
        ),
        torch.ops.higher_order.flex_attention,
    }
)
"""Ops whose outputs selective checkpointing keeps: the matmuls, including ``nn.Linear`` with a bias and the MoE
experts' grouped GEMMs, and the fused attention kernels, whose outputs include the log-sum-exp their backward
needs; FlexAttention is a higher-order op (``torch.ops.higher_order.flex_attention``: output, log-sum-exp, row
maxima), which recomputed would run its forward again in every backward. The policy compares these op objects,
never their printed names (a name it does not spell exactly is silently recomputed)."""
FLASH_ATTN_OPS = ("_flash_attn_forward", "_flash_attn_varlen_forward")
"""flash-attn's forward ops (``torch.ops.flash_attn``), kept as well once the package has registered them."""
_SAVED: list = [SAVE_OPS, False]
"""(the ops kept, flash-attn's found): flash-attn may load after this module (with the model), so it is looked up
once it is in ``sys.modules``."""


def save_ops() -> frozenset:
    """:data:`SAVE_OPS`, plus flash-attn's forward ops where flash-attn is loaded."""
    if not _SAVED[1] and "flash_attn" in sys.modules:
        flash = {getattr(torch.ops.flash_attn, n).default for n in FLASH_ATTN_OPS if hasattr(torch.ops.flash_attn, n)}
        if flash:
            _SAVED[:] = [SAVE_OPS | flash, True]
    return _SAVED[0]


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep what costs FLOPs to recompute; recompute the rest.

    torchtitan's classic policy also recomputes every second matmul to save more memory; here every matmul
    output is kept, because ``auto`` (``ultrascale/levers/``) already falls back to full recompute when selective
    does not fit, and ``ultrascale/cost/memory.py`` counts exactly what this policy keeps."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in save_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context(policy: Callable = selective_policy) -> Any:
    """A fresh pair of checkpoint contexts for one checkpointed call (``context_fn``)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs(mode: str) -> dict:
    """``gradient_checkpointing_kwargs`` for HF's ``gradient_checkpointing_enable`` in ``mode`` (full/selective).

    HF passes ``context_fn`` through to ``torch.utils.checkpoint.checkpoint``, which takes it only with
    ``use_reentrant=False``."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use full or selective")
    kwargs: dict = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(selective_context, selective_policy)
    return kwargs


def enable_checkpointing(model: torch.nn.Module, mode: str, compiled_layers: bool = False) -> None:
    """Checkpoint every decoder layer of an HF model in ``mode`` (``none``: leave it alone).

    HF checkpoints a layer around its call (``GradientCheckpointingLayer.__call__``), which is outside what
    ``layer.compile()`` (``train.compile_scope=layers``) compiles. Full checkpointing does not mind: it recomputes
    the compiled layer. The selective policy does: inside a compiled layer the matmuls are Inductor's calls
    (``mm.out`` into its own buffers), which the policy cannot keep, so every matmul would be recomputed and only
    the attention kept. ``compiled_layers``: checkpoint inside each layer's forward instead, where the compile
    traces it and its partitioner applies the policy to the graph (torch.compile's selective checkpointing)."""
    if mode == "none":
        return
    if not (compiled_layers and mode == "selective"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(mode))
        return
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers to checkpoint inside")
    for layer in layers:
        layer.forward = _checkpointed(layer, layer.forward, checkpoint_kwargs(mode))


def _checkpointed(layer: torch.nn.Module, forward: Callable, kwargs: dict) -> Callable:
    """``forward`` run under ``torch.utils.checkpoint`` while the layer trains with gradients (not in eval or
    generation, where there is no backward and the KV cache must be written once)."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed(*args: Any, **kw: Any) -> Any:
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kw)
        for key in ("past_key_values", "layer_past"):  # as HF's own checkpointing: the replay must not write twice
            if kw.get(key) is not None:
                kw[key] = None
        return checkpoint(forward, *args, **kwargs, **kw)

    return checkpointed
