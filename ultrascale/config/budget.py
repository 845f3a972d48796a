"""``conf/budget/``: inference-aware model sizing on a fitted scaling law."""

from __future__ import annotations

from dataclasses import dataclass, field

from ultrascale.config.fields import num


@dataclass
class ScalingLawConfig:
    """A fitted Chinchilla loss surface L(N, D) = E + A/N^alpha + B/D^beta (N parameters, D training tokens).
    The fit decides the answer, so it is a config choice: ``budget=hoffmann`` or ``budget=besiroglu``."""

    name: str = "hoffmann"
    """Which fit, shown in the budget table."""
    E: float = num(1.6934, ge=0)
    """Irreducible loss (nats/token on the fit's data): no model reaches it."""
    A: float = num(406.4, gt=0)
    """Coefficient of the parameter term A/N^alpha."""
    B: float = num(410.7, gt=0)
    """Coefficient of the data term B/D^beta."""
    alpha: float = num(0.3392, gt=0)
    """Parameter exponent."""
    beta: float = num(0.2849, gt=0)
    """Data exponent."""


@dataclass
class BudgetConfig:
    """Inference-aware sizing (Sardana et al. 2024): the model size and training tokens that reach a loss for the
    least training + serving cost, printed beside the Chinchilla point. Give exactly one of ``train_flops``,
    ``train_gpu_hours`` or ``target_loss``; the first two set the loss bar as what Chinchilla would reach."""

    enabled: bool = False
    """Print the budget table instead of planning layouts (``budget=hoffmann|besiroglu`` turn it on)."""
    law: ScalingLawConfig = field(default_factory=ScalingLawConfig)
    """The loss surface both optima are read from."""
    train_flops: float | None = num(None, gt=0)
    """Training compute budget (FLOPs, 6·N·D): the bar is the loss of Chinchilla's model for it."""
    train_gpu_hours: float | None = num(None, gt=0)
    """Training budget in GPU-hours on ``cluster`` (at ``cluster.peak_tflops`` x the training MFU)."""
    target_loss: float | None = num(None, gt=0)
    """The loss to reach directly; must be above ``law.E``."""
    inference_tokens: float = num(0.0, ge=0)
    """Tokens served over the model's life (prompt + generated), each costing 2·N FLOPs."""
    train_mfu: float | None = num(None, gt=0, le=1)
    """Training MFU for GPU-hours; null = ``cluster.matmul_efficiency``."""
    inference_mfu: float | None = num(None, gt=0, le=1)
    """Serving MFU; null = the training MFU. Lower it (decoding is memory-bound) and inference FLOPs cost more,
    which shifts the optimum to smaller models: the optimum minimises GPU-hours, not FLOPs."""
    usd_per_gpu_hour: float | None = num(None, gt=0)
    """Price of one GPU-hour: adds a dollar row; null = no dollars."""
