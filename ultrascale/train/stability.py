"""Bad-step policies: a NaN/inf or a loss spike is detected, judged alike on every rank, and acted on.

Why here and not in DeepSpeed: DeepSpeed's ZeRO and bf16/fp16 wrappers already refuse an update whose
gradient norm is not finite (and count it in ``skipped_steps``), but they know nothing of loss spikes,
never roll back, and a plain fp32 ZeRO-0 optimizer steps straight into NaN weights. This module adds the
policy layer on top: the decision is taken before the step's last backward from the step's loss all-reduced
over every rank; the verdict itself is agreed (:func:`agree`), so ranks cannot disagree; a skipped update is
skipped at the innermost optimizer (:class:`StepGate`), leaving the optimizer state and the parameters
bit-identical; consecutive bad steps and rollbacks are capped, ending the run with one clear error. A
fault-injection hook (``ULTRASCALE_INJECT``) plants a NaN or a spike at a chosen step on a chosen rank, so the
tests exercise the real path end to end.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as tdist

from ultrascale.errors import UltrascaleError

if TYPE_CHECKING:
    from ultrascale.config.stability import StabilityConfig

ACTIONS = ("ok", "lr_cut", "skip", "rollback", "stop")
"""Ordered by severity: when ranks are merged with MAX, the strongest action wins."""
REASONS = ("", "spike", "nonfinite")

INJECT_ENV = "ULTRASCALE_INJECT"
"""Test hook: comma-separated ``nan@STEP[:RANK]`` / ``spike@STEP[:RANK][xFACTOR]`` (loss faults), and
``slow_data@STEP[:RANK]xSECONDS`` / ``slow_ckpt@STEP[:RANK]xSECONDS`` (a stall planted inside that step's
data fetch, or inside the checkpoint saved after that step). STEP is the step number as logged (1 = the first
step); rank defaults to 0, factor to 20. Each fires once per process, so a rolled-back run does not replay it
(the data window that 'caused' it is skipped, as with a real spike)."""
FAULT_KINDS = ("nan", "spike", "slow_data", "slow_ckpt")


class TrainingHealthError(UltrascaleError):
    """The run kept producing bad steps: stopping is safer than burning compute on a broken run."""


@dataclass(frozen=True)
class Verdict:
    action: str = "ok"
    reason: str = ""
    zscore: float | None = None

    @property
    def bad(self) -> bool:
        return self.action in ("skip", "rollback", "stop")


class SpikeDetector:
    """One-sided z-score of the step loss against a moving window of accepted losses."""

    def __init__(self, window: int, min_history: int, min_rel_std: float):
        self.losses: deque[float] = deque(maxlen=window)
        self.min_history = min_history
        self.min_rel_std = min_rel_std

    def zscore(self, loss: float) -> float | None:
        if len(self.losses) < self.min_history:
            return None
        n = len(self.losses)
        mean = sum(self.losses) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / max(n - 1, 1))
        return (loss - mean) / max(std, self.min_rel_std * abs(mean), 1e-12)

    def accept(self, loss: float) -> None:
        self.losses.append(loss)


class StabilityMonitor:
    """Judges each step, tracks lr cuts and the consecutive-bad-step cap. Same state on every rank."""

    def __init__(self, cfg: StabilityConfig):
        self.cfg = cfg
        self.detector = SpikeDetector(cfg.spike_window, cfg.spike_min_history, cfg.spike_min_rel_std)
        self.consecutive = 0
        self.rollbacks = 0
        self.skips = 0
        self.lr_cut_from, self.lr_cut_until = 0, -1

    def judge(self, loss: float) -> Verdict:
        """This rank's verdict on a step whose all-reduced loss is ``loss`` (before its update is applied)."""
        if not math.isfinite(loss):
            return Verdict(str(self.cfg.nonfinite), "nonfinite")
        if self.cfg.spike == "none":
            return Verdict()
        z = self.detector.zscore(loss)
        if z is not None and z > self.cfg.spike_zscore:
            return Verdict(str(self.cfg.spike), "spike", z)
        return Verdict(zscore=z)

    def nonfinite_grad(self) -> Verdict:
        """The gradient norm was not finite (the update was already refused by the optimizer)."""
        return Verdict(str(self.cfg.nonfinite), "nonfinite")

    def lr_factor(self, step: int) -> float:
        return self.cfg.lr_cut_factor if self.lr_cut_from <= step <= self.lr_cut_until else 1.0

    def start_lr_cut(self, step: int) -> int:
        self.lr_cut_from, self.lr_cut_until = step, step + self.cfg.lr_cut_steps - 1
        return self.lr_cut_until

    def record(self, verdict: Verdict, loss: float, step: int) -> None:
        """Book-keeping after the step; raises TrainingHealthError when a cap is exceeded."""
        if verdict.action == "ok":
            self.consecutive = 0
            self.detector.accept(loss)
            return
        if verdict.action == "lr_cut":  # applied, but kept out of the window: it is not a baseline
            return
        self.consecutive += 1
        if verdict.action == "skip":
            self.skips += 1
        if verdict.action == "rollback":  # the window stays: the losses before the spike are still the baseline
            self.rollbacks += 1
        what = "non-finite loss/grad norm" if verdict.reason == "nonfinite" else f"loss spike (z={verdict.zscore:.1f})"
        if verdict.action == "stop":
            raise TrainingHealthError(
                f"stability.nonfinite=stop: {what} at step {step}: the run is stopped before applying it; "
                "resume from the last checkpoint after lowering optim.lr, or use stability.nonfinite=skip"
            )
        if self.consecutive >= self.cfg.max_consecutive:
            raise TrainingHealthError(
                f"stability: {self.consecutive} bad steps in a row (last: {what} at step {step}, action "
                f"{verdict.action}) reached stability.max_consecutive={self.cfg.max_consecutive}: the run is "
                "persistently unhealthy; check the data and optim.lr, or raise stability.max_consecutive"
            )
        if self.rollbacks > self.cfg.max_rollbacks:
            raise TrainingHealthError(
                f"stability: {self.rollbacks} rollbacks (last at step {step}) exceed "
                f"stability.max_rollbacks={self.cfg.max_rollbacks}: check the data and optim.lr"
            )

    def counters(self) -> dict:
        return {"consecutive": self.consecutive, "rollbacks": self.rollbacks, "skips": self.skips,
                "lr_cut_from": self.lr_cut_from, "lr_cut_until": self.lr_cut_until}  # fmt: skip

    def state(self) -> dict:
        """Counters and the spike window: a resumed run is armed against a spike from its first step."""
        return {**self.counters(), "window": list(self.detector.losses)}

    def load_state(self, state: dict) -> None:
        if "window" in state:
            self.detector.losses.clear()
            self.detector.losses.extend(float(x) for x in state["window"])
        self.rollbacks = int(state.get("rollbacks", 0))
        self.skips = int(state.get("skips", 0))
        self.lr_cut_from = int(state.get("lr_cut_from", 0))
        self.lr_cut_until = int(state.get("lr_cut_until", -1))


@dataclass(frozen=True)
class Agreement:
    """What every rank adopts at a step: the stability verdict, whether the run stops after this step (the
    first stopping rank's code, see :mod:`ultrascale.train.stop`), and the newest checkpoint step whose
    background write every rank has finished (-1: none)."""

    verdict: Verdict
    stop: int = 0
    written: int = -1


def agree(verdict: Verdict, stop: int = 0, written: int = -1) -> Agreement:
    """All ranks adopt the most severe verdict any rank reached, as one (action, reason, z-score) record, plus
    the stop request and the written checkpoint, in the same all-gather (a stop costs no extra collective).

    Action and reason travel as one code (action-major), so the reason every rank reports is the reason of
    the rank whose action won, never the worst reason of some other rank. Collective.
    """
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return Agreement(verdict, stop, written)
    code = ACTIONS.index(verdict.action) * len(REASONS) + REASONS.index(verdict.reason)
    z = math.nan if verdict.zscore is None else float(verdict.zscore)
    from ultrascale.runtime.device import coll_tensor

    mine = coll_tensor([float(code), z, float(stop), float(written)], torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(tdist.get_world_size())]
    tdist.all_gather(gathered, mine)
    # one device-to-host copy of every rank's record (under NCCL each element read alone is a sync of its own)
    rows = torch.stack(gathered).tolist()
    best = max(rows, key=lambda r: int(r[0]))  # the lowest rank among ties
    action, reason = divmod(int(best[0]), len(REASONS))
    zscore = None if math.isnan(best[1]) else best[1]
    stops = [int(r[2]) for r in rows if int(r[2])]
    return Agreement(Verdict(ACTIONS[action], REASONS[reason], zscore), stops[0] if stops else 0,
                     min(int(r[3]) for r in rows))  # fmt: skip


class StepGate:
    """Lets the trainer veto the next optimizer update at the innermost (basic) optimizer.

    DeepSpeed's wrappers (ZeRO 1-3, bf16/fp16) call the basic optimizer's ``step`` on the fp32 master
    partitions after reducing and clipping. Returning without stepping leaves master weights, moments and
    the step count untouched; the wrapper then copies the unchanged masters back, so the model is exactly
    as before. This works the same for torch AdamW, DeepSpeedCPUAdam (offload) and Muon (whose momentum
    DeepSpeed commits before calling the step, so a vetoed Muon step still moves its momentum buffer).

    The pipeline engine steps inside ``train_batch``, after its last backward; there ``pre_step`` (a
    collective the trainer installs) judges the step at that moment, so a spike can be skipped there too.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.skip_next = False
        self.vetoed = False
        self.pre_step = None  # callable -> bool (skip?), called on every rank right before the update
        original = optimizer.step

        def gated_step(*args, **kwargs):
            if self.pre_step is not None and self.pre_step():
                self.skip_next = True
            if self.skip_next:
                self.vetoed = True
                return None
            return original(*args, **kwargs)

        optimizer.step = gated_step

    def arm(self, skip: bool) -> None:
        self.skip_next, self.vetoed = skip, False


def grads_finite_norm(params) -> float:
    """Global L2 norm of ``.grad`` over ``params`` (full, already-reduced grads: ZeRO-0 only)."""
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    factor: float


def parse_faults(spec: str | None) -> list[Fault]:
    """``nan@5:1,spike@12:0x20`` -> faults (see INJECT_ENV)."""
    faults = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind, _, rest = item.partition("@")
        factor = 20.0
        if "x" in rest:
            rest, f = rest.split("x", 1)
            factor = float(f)
        step, _, rank = rest.partition(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"{INJECT_ENV}: unknown fault {kind!r} in {spec!r} (use one of {', '.join(FAULT_KINDS)})")
        faults.append(Fault(kind, int(step), int(rank or 0), factor))
    return faults


class FaultInjector:
    """Plants this rank's faults at their steps, once each: a NaN or spike factor on the loss, or a stall."""

    def __init__(self, rank: int):
        self.rank = rank
        self.pending = [f for f in parse_faults(os.environ.get(INJECT_ENV)) if f.rank == rank]

    def factor(self, step: int) -> float | None:
        for f in self.pending:
            if f.step == step and f.kind in ("nan", "spike"):
                return float("nan") if f.kind == "nan" else f.factor
        return None

    def stall(self, kind: str, step: int) -> None:
        """Sleep for a planted ``slow_data``/``slow_ckpt`` at ``step``: the caller's timer must book it."""
        time.sleep(self.take(kind, step))

    def take(self, kind: str, step: int) -> float:
        """The seconds of a planted stall at ``step`` (0 if none), for a caller that sleeps elsewhere (the
        background checkpoint writer plants a slow disk in its own thread)."""
        secs = 0.0
        for f in [f for f in self.pending if f.step == step and f.kind == kind]:
            self.pending.remove(f)
            secs += f.factor
        return secs

    def fired(self, step: int) -> None:
        """The step's loss faults have been applied (a rolled-back replay of the step runs clean)."""
        self.pending = [f for f in self.pending if f.step != step or f.kind not in ("nan", "spike")]
