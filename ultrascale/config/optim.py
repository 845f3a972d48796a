"""``conf/optim/``: the optimizer and its learning-rate schedule (``optim.sched``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ultrascale.config.fields import num


class OptimizerName(StrEnum):
    adamw = "adamw"
    muon = "muon"


class ScheduleName(StrEnum):
    cosine = "cosine"
    wsd = "wsd"
    constant = "constant"


@dataclass
class SchedConfig:
    name: ScheduleName = ScheduleName.cosine
    """``cosine`` (linear warmup then cosine to min_lr), ``wsd`` (warmup-stable-decay: flat, then a short
    decay, so a run can be extended or branched from any stable-phase checkpoint), or ``constant``."""
    warmup_steps: int = num(100, ge=0)
    """Linear warmup from 0; protects Adam's early, badly estimated second moments."""
    warmup_tokens: str | None = None
    """The warmup in tokens (``50M``, ``20480``): sets ``warmup_steps`` to the steps that train this many, so the
    warmup keeps its length when the batch changes. Null: ``warmup_steps`` as given."""
    min_lr_ratio: float = num(0.1, ge=0, le=1)
    """Final lr as a fraction of optim.lr."""
    decay_fraction: float = num(0.2, ge=0, le=1)
    """WSD only: the last fraction of train.steps spent decaying."""
    total_steps: int | None = num(None, ge=1)
    """Schedule length; defaults to train.steps. Set it to keep the schedule fixed when extending a run."""


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    """``adamw`` or ``muon`` (DeepSpeed's MuonWithAuxAdam: Muon on 2-D hidden matrices, Adam on the rest;
    ZeRO stage <= 2 because Muon needs whole, unflattened matrices)."""
    lr: float = num(3e-4, gt=0)
    """Peak learning rate reached after warmup."""
    weight_decay: float = num(0.1, ge=0)
    """Decoupled weight decay, applied to matrices only: never to norms, biases or (optionally) embeddings."""
    decay_embeddings: bool = True
    """Whether embedding/unembedding matrices get weight decay."""
    betas: list[float] = num(default_factory=lambda: [0.9, 0.95], ge=0, lt=1)
    """Adam betas; 0.95 for beta2 is the usual LLM choice for stability."""
    eps: float = num(1e-8, gt=0)
    """Adam epsilon."""
    grad_clip: float = num(1.0, ge=0)
    """Global gradient-norm clip (DeepSpeed ``gradient_clipping``); 0 disables it."""
    torch_adam: bool = True
    """Use torch's AdamW inside DeepSpeed instead of JIT-compiling FusedAdam/CPUAdam (minutes on first use).
    Offload always uses DeepSpeedCPUAdam regardless, because that is what makes offload fast."""
    fused: bool = True
    """torch AdamW's fused kernel (``fused=True``: one kernel for all parameters instead of a loop of small
    ops); it exists on CPU and CUDA for fp32/bf16/fp16. Same math as the unfused step."""
    momentum: float = num(0.95, ge=0, lt=1)
    """Muon only: Nesterov momentum."""
    muon_lr: float | None = num(None, gt=0)
    """Muon only: lr for the Muon half (matrices); the Adam half uses optim.lr."""
    sched: SchedConfig = field(default_factory=SchedConfig)
