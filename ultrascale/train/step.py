"""One optimizer step's mechanics: ``grad_accum`` micro-steps of forward, backward and ``engine.step()`` (or the
pipeline engine's whole 1F1B schedule), the step's loss all-reduced and judged before its update is applied.

The judgement (:mod:`ultrascale.train.stability`) rides one all-gather that also carries a pending stop and the
newest checkpoint every rank has written, so a NaN or a spike is vetoed at the optimizer (the gate) on every rank
alike, and neither the stop protocol nor the background checkpoint costs a collective of its own. The trainer owns
the loop around it: what is logged, rolled back, evaluated and saved after the step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from ultrascale.data.loader import Batch
from ultrascale.levers import length
from ultrascale.runtime.device import coll_tensor
from ultrascale.train.optim import apply_lr
from ultrascale.train.stability import Verdict, agree, grads_finite_norm


@dataclass
class StepState:
    """One optimizer step as it happens: what its parts decide is written here, not passed through globals."""

    step: int
    fault: float | None
    loss: float = math.nan
    lr: float = 0.0
    verdict: Verdict = field(default_factory=Verdict)
    stop: int = 0
    """The stop every rank agreed on in this step (a signal number, the STOP file's code, or 0)."""
    written: int = -1
    """The newest checkpoint step every rank had finished writing in the background, as agreed in this step."""


class _LossReduce:
    """The mean of a loss over every rank, all-reduced asynchronously: started here, read with ``wait()``."""

    def __init__(self, local: torch.Tensor) -> None:
        self.value = coll_tensor(local, torch.float32).clone()
        multi = tdist.is_initialized() and tdist.get_world_size() > 1
        self.work = tdist.all_reduce(self.value, async_op=True) if multi else None

    def wait(self) -> float:
        if self.work is not None:
            self.work.wait()
            return float(self.value) / tdist.get_world_size()
        return float(self.value)


class OptimizerStep:
    """Runs one step on the trainer's parts (its engine, batches, gate, monitors), read through the trainer as the
    evaluator reads them, so whatever the trainer holds now (a resumed offset, a rebuilt schedule) is what runs."""

    def __init__(self, trainer: Any) -> None:
        self.t = trainer

    def run(self, st: StepState) -> None:
        (self._pipeline if self.t.decisions.pipeline else self._dense)(st)

    def _fetch(self, st: StepState, micro: int) -> Batch:
        """A micro-batch, timed as data wait (a planted ``slow_data`` stall lands here too)."""
        t, t0 = self.t, time.perf_counter()
        if micro == 0:
            t.injector.stall("slow_data", st.step + 1)
        batch = t.batches.get(st.step + t.data_offset, micro)
        if t.decisions.flat_batches:
            batch = batch.flattened()
        if t.device.type == "cuda":  # page-locked, so the copy in loss() runs asynchronously
            batch = batch.pinned()
        t.breakdown.add("data_wait_s", time.perf_counter() - t0)
        return batch

    def _dense(self, st: StepState) -> None:
        """``grad_accum`` micro-steps; the step is judged on its all-reduced loss and vetoed at the optimizer.

        With ``train.overlap_loss_reduce`` the loss all-reduce is started before the last backward and waited
        for after it, so the ranks' wait for each other hides behind the backward instead of preceding it;
        the verdict, the lr and the gate are all settled before ``engine.step()`` either way."""
        t = self.t
        engine, bd, gas, losses, overlap = (
            t.engine,
            t.breakdown,
            t.batches.grad_accum,
            [],
            t.decisions.overlap_loss_reduce.on,
        )
        for m in range(gas):
            batch = self._fetch(st, m)
            loss, lm_loss = bd.forward(t.loss, batch)
            if st.fault is not None:
                loss, lm_loss = loss * st.fault, lm_loss * st.fault
            losses.append(lm_loss.detach())
            last = m == gas - 1
            if last:
                t0 = time.perf_counter()
                pending = _LossReduce(torch.stack(losses).mean().reshape(1))
                if not overlap:
                    self.judge(st, pending.wait())
                bd.add("comm_s", time.perf_counter() - t0)
            bd.engine_call(engine.backward, loss)
            if last and overlap:
                t0 = time.perf_counter()
                mean = pending.wait()
                bd.add("comm_s", time.perf_counter() - t0)
                self.judge(st, mean)
            if last:
                # ZeRO-0 fp32 has no DeepSpeed wrapper to refuse a non-finite gradient: check it here
                if (
                    not st.verdict.bad
                    and t.raw_optimizer
                    and not math.isfinite(grads_finite_norm(engine.module.parameters()))
                ):
                    st.verdict = t.stability.nonfinite_grad()
                t.gate.arm(st.verdict.bad)
            bd.engine_call(engine.step)
            bd.after_micro_step()

    def judge(self, st: StepState, loss: float) -> None:
        """Agree on a verdict for the step's (all-reduced) loss, start an lr cut if that is it, set the lr.

        The same all-gather carries a pending stop (a signal on any rank, or rank 0's STOP file) and the newest
        checkpoint every rank has written in the background, so neither costs a collective of its own."""
        t, st.loss = self.t, loss
        agreed = agree(t.stability.judge(loss), t.stop.local(check_file=t.rank == 0), t.checkpointer.written())
        st.verdict, st.stop, st.written = agreed.verdict, agreed.stop, agreed.written
        if st.verdict.action == "lr_cut":
            t.stability.start_lr_cut(st.step)
        st.lr = self._apply_lr(st.step)

    def _apply_lr(self, step: int) -> float:
        t, train = self.t, self.t.cfg.train
        factor = t.stability.lr_factor(step) * t.mixture.lr_factor(step, train.steps)
        at = length.schedule_position(t.history, step, train.tokens is not None)  # tokens: on its curve
        return apply_lr(t.engine.optimizer, at, t.cfg.optim.sched, train.steps, factor)

    def _pipeline(self, st: StepState) -> None:
        """``engine.train_batch()`` runs the whole 1F1B schedule; the gate's ``pre_step`` judges the step
        inside it, right before the update, from the last stages' loss."""
        t = self.t
        micro = [self._fetch(st, m) for m in range(t.batches.grad_accum)]
        st.lr = self._apply_lr(st.step)
        t.gate.arm(False)
        t.gate.pre_step = lambda: self.judge_pipeline(st)
        t.engine.train_batch(data_iter=iter([t.pipe_inputs(b) for b in micro]))

    def judge_pipeline(self, st: StepState) -> bool:
        """On every rank: only last-stage ranks hold the loss (``engine.total_loss``, summed over micro-batches);
        one world all-reduce of (sum, count) gives every stage the mean. Returns True to veto the update."""
        t, engine = self.t, self.t.engine
        last = engine.is_last_stage() and engine.total_loss is not None
        local = float(engine.total_loss) / t.batches.grad_accum if last else 0.0
        if st.fault is not None and (last or math.isnan(st.fault)):
            local *= st.fault
        t0 = time.perf_counter()
        totals = coll_tensor([local, float(last)], torch.float64)
        if tdist.is_initialized():
            tdist.all_reduce(totals)
        t.breakdown.add("comm_s", time.perf_counter() - t0)
        self.judge(st, float(totals[0] / totals[1]))
        return st.verdict.bad
