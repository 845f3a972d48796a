"""Parameter groups and learning-rate schedules.

Weight decay pulls weights toward zero; on norm gains and biases that only fights the model (a norm
gain of 0 zeroes its layer), so they go in a no-decay group. Schedules are plain functions of the step
so they are testable, resumable (the step is in the checkpoint) and identical on every rank. The trainer
sets each step's lr itself (:func:`apply_lr`) instead of handing DeepSpeed a scheduler object: a skipped
step, an lr cut after a loss spike and a rollback then cannot knock the schedule off the step count.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def param_groups(model: torch.nn.Module, weight_decay: float, decay_embeddings: bool = True) -> list[dict]:
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_embedding = "embed" in name or "lm_head" in name
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partitioned parameter's data is an empty 1-D tensor
        if ndim < 2 or "norm" in name.lower() or name.endswith(".bias") or (is_embedding and not decay_embeddings):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return groups


def lr_multiplier(step: int, sched: Any, total_steps: int) -> float:
    """Multiplier on the peak lr at optimizer step ``step`` (0-based: the first update uses step 0)."""
    total = int(sched.total_steps or total_steps)
    warmup = min(int(sched.warmup_steps), max(total - 1, 0))
    floor = float(sched.min_lr_ratio)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if sched.name == "constant":
        return 1.0
    if sched.name == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if sched.name == "wsd":
        decay_steps = max(1, round(total * float(sched.decay_fraction)))
        decay_start = total - decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / decay_steps)
        return floor + (1 - floor) * (1 - progress)
    raise ValueError(f"unknown schedule {sched.name!r}")


def build_optimizer(model: torch.nn.Module, optim: Any) -> torch.optim.Optimizer:
    """Torch AdamW with decay groups (when the run's decisions say we own the optimizer)."""
    return torch.optim.AdamW(
        param_groups(model, optim.weight_decay, optim.decay_embeddings),
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=bool(optim.fused) or None,  # None lets torch pick its default (foreach) when fused is off
    )


BASE_LR = "ultrascale_base_lr"
"""Param-group key holding the group's peak lr (groups may differ, e.g. Muon's matrices vs its Adam half)."""


def apply_lr(optimizer: torch.optim.Optimizer, step: int, sched: Any, total_steps: int, factor: float = 1.0) -> float:
    """Set every param group's lr for optimizer step ``step``; returns the first group's (for logging)."""
    mult = lr_multiplier(step, sched, total_steps) * factor
    for g in optimizer.param_groups:
        g.setdefault(BASE_LR, g["lr"])
        g["lr"] = g[BASE_LR] * mult
    return optimizer.param_groups[0]["lr"]
