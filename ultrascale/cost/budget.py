"""Inference-aware model sizing: the (N, D) that reaches a loss for the least lifetime cost, not training cost.

Chinchilla (Hoffmann et al. 2022) picks N and D to minimise loss for a training budget, ignoring what serving
the model costs. Sardana et al. 2024 ("Beyond Chinchilla-Optimal", arXiv:2401.00448) keep the same loss
surface L(N, D) = E + A/N^alpha + B/D^beta and minimise training plus inference instead:

    minimise   6·N·D_train + 2·N·D_inference     subject to  L(N, D_train) = target loss

A model served for many tokens should be smaller and trained longer. This module holds that arithmetic and
nothing else: no config, no I/O. ``budget_from_cfg`` turns the ``budget`` group into a :class:`BudgetPlan`;
how the optimum is solved is in :func:`inference_aware_optimal`, the fits and a worked example in
ultrascale/plan/README.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ultrascale.errors import ConfigError

if TYPE_CHECKING:
    from ultrascale.config.root import PlanRootConfig

TRAIN_FLOPS_PER_TOKEN = 6  # per parameter: forward 2 + backward 4 (the same convention as model/flops.py)
INFERENCE_FLOPS_PER_TOKEN = 2  # per parameter: forward only, prompt and generated tokens alike


@dataclass(frozen=True)
class ScalingLaw:
    """A fitted Chinchilla loss surface L(N, D) = E + A/N^alpha + B/D^beta (N params, D training tokens)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    name: str = "custom"

    def loss(self, params: float, tokens: float) -> float:
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    @property
    def G(self) -> float:
        """Hoffmann et al.'s constant: N_opt = G·(C/6)^(beta/(alpha+beta)), D_opt = (C/6)^(alpha/(alpha+beta))/G."""
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def describe(self) -> str:
        return f"{self.name}: L = {self.E:g} + {self.A:g}/N^{self.alpha:g} + {self.B:g}/D^{self.beta:g}"


@dataclass(frozen=True)
class Point:
    """One (N, D_train) choice and what it costs for a given inference volume."""

    params: float
    train_tokens: float
    inference_tokens: float
    loss: float

    @property
    def tokens_per_param(self) -> float:
        return self.train_tokens / self.params

    @property
    def train_flops(self) -> float:
        return TRAIN_FLOPS_PER_TOKEN * self.params * self.train_tokens

    @property
    def inference_flops(self) -> float:
        return INFERENCE_FLOPS_PER_TOKEN * self.params * self.inference_tokens

    @property
    def total_flops(self) -> float:
        return self.train_flops + self.inference_flops


@dataclass(frozen=True)
class Costing:
    """FLOPs -> GPU-hours (-> dollars) on one accelerator type. Serving runs at a different MFU than training
    (decoding is memory-bound), so an inference FLOP can cost more than a training FLOP; the optimum moves."""

    peak_flops: float
    """Dense peak per accelerator (FLOP/s)."""
    train_mfu: float
    inference_mfu: float
    usd_per_gpu_hour: float | None = None

    @property
    def inference_weight(self) -> float:
        """Cost of one inference FLOP in training FLOPs: the only thing about hardware the optimum depends on."""
        return self.train_mfu / self.inference_mfu

    def train_gpu_hours(self, p: Point) -> float:
        return p.train_flops / (self.peak_flops * self.train_mfu * 3600)

    def inference_gpu_hours(self, p: Point) -> float:
        return p.inference_flops / (self.peak_flops * self.inference_mfu * 3600)

    def gpu_hours(self, p: Point) -> float:
        return self.train_gpu_hours(p) + self.inference_gpu_hours(p)


def _bisect(f: Callable[[float], float], lo: float, hi: float) -> float:
    """Root of an increasing ``f`` with f(lo) < 0 < f(hi), to the last representable bit."""
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


def chinchilla_optimal(law: ScalingLaw, train_flops: float, inference_tokens: float = 0.0) -> Point:
    """Hoffmann et al.'s closed form: the (N, D) with 6·N·D = ``train_flops`` and the lowest loss."""
    if train_flops <= 0:
        raise ValueError(f"train_flops must be positive, got {train_flops}")
    x = train_flops / TRAIN_FLOPS_PER_TOKEN
    s = law.alpha + law.beta
    n, d = law.G * x ** (law.beta / s), x ** (law.alpha / s) / law.G
    return Point(n, d, inference_tokens, law.loss(n, d))


def _point_at_share(law: ScalingLaw, target_loss: float, t: float, inference_tokens: float) -> Point:
    """The (N, D) on the iso-loss curve whose parameter term holds share ``t`` of the reducible loss."""
    reducible = target_loss - law.E
    n = (law.A / (t * reducible)) ** (1 / law.alpha)
    d = (law.B / ((1 - t) * reducible)) ** (1 / law.beta)
    return Point(n, d, inference_tokens, target_loss)


def _check_loss(law: ScalingLaw, target_loss: float) -> None:
    if not target_loss > law.E:
        raise ValueError(f"target loss {target_loss} must exceed the fit's irreducible loss E={law.E}")


def chinchilla_for_loss(law: ScalingLaw, target_loss: float, inference_tokens: float = 0.0) -> Point:
    """The least-training-compute (N, D) that reaches ``target_loss``: parameter share beta/(alpha+beta)."""
    _check_loss(law, target_loss)
    return _point_at_share(law, target_loss, law.beta / (law.alpha + law.beta), inference_tokens)


def inference_aware_optimal(
    law: ScalingLaw, target_loss: float, inference_tokens: float, inference_weight: float = 1.0
) -> Point:
    """The (N, D) that reaches ``target_loss`` for the least 6·N·D + w·2·N·D_inf (Sardana et al. 2024).

    ``inference_weight`` w is what an inference FLOP costs in training FLOPs (1 for the FLOP count,
    train_mfu/inference_mfu for GPU-hours or dollars on one accelerator type).

    The optimum has an exact one-dimensional form. Write the reducible loss ``ell - E`` as shares ``t``
    (parameter term, ``A/N^alpha = t·(ell-E)``) and ``1-t`` (data term). Setting the derivative of the cost
    along that curve to zero gives ``alpha·t·r = beta·(1-t)``, where ``r = 6D / (6D + 2·w·D_inf)`` is
    training's share of the marginal cost. The left side increases in ``t``, the right side decreases, so there
    is exactly one root, found by bisection to machine precision. With no inference ``r = 1`` and
    ``t = beta/(alpha+beta)``: the Chinchilla point in closed form."""
    _check_loss(law, target_loss)
    if inference_tokens < 0 or inference_weight <= 0:
        raise ValueError(
            f"need inference_tokens >= 0 and inference_weight > 0, got {inference_tokens}, {inference_weight}"
        )
    if inference_tokens == 0:
        return chinchilla_for_loss(law, target_loss)
    k = inference_weight * inference_tokens / 3  # 2·w·D_inf / 6

    def stationarity(t: float) -> float:  # alpha·t·r(t) - beta·(1-t), increasing in t
        d = _point_at_share(law, target_loss, t, inference_tokens).train_tokens
        return law.alpha * t * d / (d + k) - law.beta * (1 - t)

    t = _bisect(stationarity, law.beta / (law.alpha + law.beta), 1.0)  # serving only ever shrinks the model
    return _point_at_share(law, target_loss, t, inference_tokens)


def min_loss_at_cost(
    law: ScalingLaw, total_flops: float, inference_tokens: float, inference_weight: float = 1.0
) -> Point:
    """The dual: the lowest loss whose 6·N·D + w·2·N·D_inf equals ``total_flops`` (weighted training FLOPs)."""
    if inference_tokens == 0:
        return chinchilla_optimal(law, total_flops)
    k = inference_weight * inference_tokens / 3
    n_max = total_flops / (TRAIN_FLOPS_PER_TOKEN * k)  # every FLOP spent serving, none left to train
    if n_max <= 1:
        raise ValueError(f"total {total_flops:.3g} FLOPs cannot even serve {inference_tokens:.3g} tokens")

    def tokens(log_n: float) -> float:
        return total_flops / (TRAIN_FLOPS_PER_TOKEN * math.exp(log_n)) - k

    def stationarity(log_n: float) -> float:  # beta·B/D^beta - alpha·r·A/N^alpha, increasing in N
        n, d = math.exp(log_n), tokens(log_n)
        if d <= 0:  # rounding at the upper end: no tokens left means infinite loss, the root is below
            return math.inf
        return law.beta * law.B / d**law.beta - law.alpha * d / (d + k) * law.A / n**law.alpha

    log_n = _bisect(stationarity, 0.0, math.log(n_max))
    n, d = math.exp(log_n), tokens(log_n)
    return Point(n, d, inference_tokens, law.loss(n, d))


@dataclass(frozen=True)
class BudgetPlan:
    """The comparison plan.py prints: Chinchilla, the same loss for less, and the best loss for the same cost."""

    law: ScalingLaw
    costing: Costing
    bar: str
    """What set the target loss, in words."""
    chinchilla: Point
    same_loss: Point
    same_cost: Point

    @property
    def saving(self) -> float:
        """Fraction of the Chinchilla point's total cost (GPU-hours) that the inference-aware point saves."""
        c = self.costing
        return 1 - c.gpu_hours(self.same_loss) / c.gpu_hours(self.chinchilla)


def plan_budget(law: ScalingLaw, costing: Costing, inference_tokens: float, *, train_flops: float | None = None,
                target_loss: float | None = None) -> BudgetPlan:  # fmt: skip
    """Chinchilla's point for a training budget (or a loss), then the inference-aware points beside it."""
    if (train_flops is None) == (target_loss is None):
        raise ValueError("give exactly one of train_flops or target_loss")
    if train_flops is not None:
        chin = chinchilla_optimal(law, train_flops, inference_tokens)
        bar = f"the Chinchilla-optimal model for {train_flops:.3g} training FLOPs"
    else:
        chin = chinchilla_for_loss(law, target_loss, inference_tokens)
        bar = f"target loss {target_loss:g}"
    w = costing.inference_weight
    same_loss = inference_aware_optimal(law, chin.loss, inference_tokens, w)
    weighted = chin.train_flops + w * chin.inference_flops  # the objective both points are measured in
    same_cost = min_loss_at_cost(law, weighted, inference_tokens, w)
    return BudgetPlan(law, costing, bar, chin, same_loss, same_cost)


def budget_from_cfg(cfg: PlanRootConfig) -> BudgetPlan:
    """Validate the ``budget`` group (one-line errors naming the key) and build the plan on ``cfg.cluster``."""
    b, c = cfg.budget, cfg.cluster
    if cfg.plot:
        raise ConfigError(f"plot={cfg.plot} draws layouts, and budget mode plans none: drop plot= (output_json= works)")
    law = ScalingLaw(b.law.E, b.law.A, b.law.B, b.law.alpha, b.law.beta, b.law.name)
    given = [k for k in ("train_flops", "train_gpu_hours", "target_loss") if getattr(b, k) is not None]
    if len(given) != 1:
        raise ConfigError(
            f"budget: set exactly one of budget.train_flops, budget.train_gpu_hours, budget.target_loss "
            f"(got {', '.join(given) or 'none'}), e.g. budget.train_flops=5.76e23"
        )
    # Each key's own range (mfu in (0, 1], positive constants and budgets) was checked at compose time.
    train_mfu = c.matmul_efficiency if b.train_mfu is None else b.train_mfu
    inference_mfu = train_mfu if b.inference_mfu is None else b.inference_mfu
    costing = Costing(c.peak_tflops * 1e12, train_mfu, inference_mfu, b.usd_per_gpu_hour)
    key = given[0]
    if key == "target_loss":
        if not b.target_loss > law.E:
            raise ConfigError(
                f"budget.target_loss={b.target_loss} is not above the fit's irreducible loss budget.law.E={law.E}: "
                f"no model reaches it; choose a loss above {law.E}"
            )
        return plan_budget(law, costing, b.inference_tokens, target_loss=b.target_loss)
    flops = b.train_flops if key == "train_flops" else b.train_gpu_hours * 3600 * costing.peak_flops * train_mfu
    return plan_budget(law, costing, b.inference_tokens, train_flops=flops)
