"""The training loop: data -> engine steps -> metrics, evals, stability policies and atomic checkpoints.

One optimizer step is ``grad_accum`` micro-steps of forward, backward and ``engine.step()``. Before the
last micro-step's backward the step's loss is all-reduced and judged (:mod:`ultrascale.train.stability`),
so a NaN or a spike can be skipped before its update is applied, rolled back to the last checkpoint, or
answered with an lr cut. The data a step reads is addressed by ``step + data_offset``: a rollback moves
the offset past the data window that caused it; the move is recorded beside the checkpoints when it happens
and travels in every later checkpoint, so a run killed after a rollback resumes without re-reading the window.

What the run does (layout, ZeRO stage, every feature) was decided once (:mod:`ultrascale.levers.decide`);
the trainer reads that record and the typed config, and the checkpointer and evaluator decide when they
are due.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as tdist
from omegaconf import DictConfig, OmegaConf

from ultrascale.config.schema import RootConfig
from ultrascale.data import sources as data_sources
from ultrascale.data.loader import TRACE_ENV, Batch, StepBatches
from ultrascale.data.prepare import check_prepared, ensure_prepared
from ultrascale.data.shards import load_manifest, open_split
from ultrascale.jsonio import write_json, write_jsonl
from ultrascale.levers import length
from ultrascale.levers.decide import Decisions
from ultrascale.levers.deepspeed import build_ds_config
from ultrascale.levers.rules import agree_across_ranks
from ultrascale.model import sequence
from ultrascale.model.flops import train_flops_per_token
from ultrascale.model.moe import MoEStats
from ultrascale.model.moe import shard_report as moe_shard_report
from ultrascale.paths import resolve_path
from ultrascale.rundir import ATTEMPTS, CONFIG, DS_CONFIG, METRICS, STOP_REQUEST, STOPPED, SUMMARY
from ultrascale.runtime import dist
from ultrascale.runtime.device import coll_tensor, to_device
from ultrascale.runtime.peak import device_peak_flops
from ultrascale.train import checkpoint
from ultrascale.train.banner import banner
from ultrascale.train.breakdown import StepBreakdown
from ultrascale.train.consistency import param_digest, replicas_agree
from ultrascale.train.engine import build_engine
from ultrascale.train.evaluate import Evaluator
from ultrascale.train.loggers import MetricLogger, read_metrics
from ultrascale.train.metrics import MemoryMeter, throughput
from ultrascale.train.optim import apply_lr
from ultrascale.train.plot import plot_curves
from ultrascale.train.preflight import Preflight, humaneval_tokenizer, preflight
from ultrascale.train.profiler import StepProfiler
from ultrascale.train.resume import checkpoint_meta
from ultrascale.train.stability import (
    FaultInjector,
    StabilityMonitor,
    TrainingHealthError,
    Verdict,
    agree,
    grads_finite_norm,
)
from ultrascale.train.stop import StopRequest

log = logging.getLogger("ultrascale")

# Test hook: SIGKILL a rank at the start of this step (``STEP`` or ``STEP:RANK``, rank 0 by default), once per
# run directory, to prove kill-then-resume (and kill-then-restart) loses nothing.
FAULT_ENV = "ULTRASCALE_FAULT_AT_STEP"
# Test hook: SIGKILL rank 0 right after a rollback, before any later checkpoint could record it.
FAULT_ROLLBACK_ENV = "ULTRASCALE_FAULT_AFTER_ROLLBACK"
# Test hook: this global rank raises at its first step while its peers wait in a collective, to prove a
# failing rank brings the whole job down with a message naming it (and that no rank hangs).
RAISE_ENV = "ULTRASCALE_RAISE_ON_RANK"


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


def _truncate_metrics(path: Path, step: int) -> tuple[int, float]:
    """At a start, drop rows logged past the checkpoint (step 0 for a fresh start): they will be recomputed
    identically. Returns what the interrupted attempt lost: the steps it had run past the checkpoint and
    their logged seconds (the cost of the interval between checkpoints, which the report books as "lost").

    Rollback events stay: a rollback after the checkpoint still holds (it is recorded beside the checkpoints).
    """
    if not path.exists():
        return 0, 0.0
    rows = read_metrics(path)
    lost = [r for r in rows if r["step"] > step and "event" not in r]
    write_jsonl(path, [r for r in rows if r["step"] <= step or r.get("event") == "rollback"])
    steps = max((r["step"] for r in lost), default=step) - step
    return steps, sum(float(r.get("step_s") or 0.0) for r in lost)


def restart_count() -> dict[str, int]:
    """How many times the launcher restarted this job after a lost rank (torchrun's ``--max-restarts``, our
    deepspeed driver's and the sbatch script's loop) and how often Slurm requeued it."""
    out = {}
    for key, names in (("restart", ("TORCHELASTIC_RESTART_COUNT", dist.RESTART_ENV)),
                       ("requeue", ("SLURM_RESTART_COUNT",))):  # fmt: skip
        n = max((int(os.environ[v]) for v in names if os.environ.get(v, "").isdigit()), default=0)
        if n:
            out[key] = n
    return out


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


@dataclass
class FitResult:
    """What the loop measured, for the end-of-run summary."""

    steps_run: int = 0
    last: dict = field(default_factory=dict)
    last_eval: dict | None = None
    tokens_per_s: list[float] = field(default_factory=list)
    loop_s: float = 0.0
    first_step_unix: float | None = None
    """Wall clock at the end of the first step (start-up, compile included, is what users wait through)."""
    end_step: int = 0
    """The optimizer step the loop ended at (the data step is this plus the data offset)."""
    stopped: str | None = None
    """What stopped the run before its last step (a signal's name or the STOP file), None when it finished."""


class Trainer:
    def __init__(self, cfg: RootConfig, d: Decisions, out: Path, config_dict: dict, found: Preflight,
                 stop: StopRequest | None = None):  # fmt: skip
        self.cfg, self.decisions, self.topo, self.out = cfg, d, d.topo, out
        self.config_dict, self.found, self.data_checked = config_dict, found, found.data_checked
        self.ds_config = build_ds_config(cfg, d)
        self.rank = dist.rank()
        self.stop = stop or StopRequest(self.rank)
        self.checkpointer = checkpoint.Checkpointer(
            out / "checkpoints", cfg.train.checkpoint_interval, cfg.train.keep_checkpoints, checkpoint_meta(cfg, d),
            background=cfg.train.checkpoint_async, staging=d.checkpoint_staging.value,
        )  # fmt: skip
        self.checkpointer.beat = self.stop.beat

    # ---- setup: each job a named step ------------------------------------------------------------
    def setup(self) -> None:
        self._open_data()
        self._build()
        self.start_step, self.data_offset = 0, 0
        self._set_history(length.continued([], 0, self.cfg))
        resumed_from = self._resume()
        lost_steps, lost_s = _truncate_metrics(self.out / METRICS, self.start_step) if dist.is_rank0() else (0, 0.0)
        self.metrics = MetricLogger(self.cfg.logger, self.out, dist.is_rank0(), self.config_dict, self.ds_config)
        restarts = restart_count()
        if resumed_from is not None or lost_steps or restarts:
            self.metrics.event(self.start_step, "resume", from_step=self.start_step,
                               checkpoint=str(resumed_from) if resumed_from else None, steps_lost=lost_steps,
                               lost_s=lost_s, **restarts, changes="; ".join(self.found.changes) or None,
                               skipped="; ".join(self.found.skipped) or None)  # fmt: skip
        if dist.is_rank0():
            (self.out / STOPPED).unlink(missing_ok=True)  # an earlier attempt's stop is answered by this one
        dist.barrier()
        tokenizer = self._humaneval_tokenizer()
        self.evaluator = Evaluator(
            self, self.cfg.train.eval_interval, self.cfg.train.eval_humaneval, tokenizer, self.out
        )
        log.info(banner(self.cfg, self.decisions, self.ds_config, self.info, self.peak_src, self.out))

    def _open_data(self) -> None:
        """The prepared sources (the built-in corpus built on rank 0 if missing), checked against the run, and
        their two splits each (one source: ``data.path``)."""
        data = self.cfg.data
        paths = ensure_prepared(data)
        if not self.data_checked:  # prepared just now, after the preflight
            check_prepared(data, self.decisions.hf_config.vocab_size)
        self.data_path = paths[0]
        self.manifest = load_manifest(self.data_path)
        names = [s.name for s in data_sources.sources(data)]
        # verify=False: hashed by check_prepared
        self.train_splits = {n: open_split(p, "train", verify=False) for n, p in zip(names, paths)}
        self.val_splits = {n: open_split(p, "validation", verify=False) for n, p in zip(names, paths)}
        self.train_split, self.val_split = self.train_splits[names[0]], self.val_splits[names[0]]
        self.eos = int(self.manifest["eos_token_id"])

    def _build(self) -> None:
        """The engine, and everything that reads its groups: data-parallel rank, batches, timers, monitors."""
        cfg, d = self.cfg, self.decisions
        self.engine, self.info = build_engine(cfg, d, self.ds_config)
        self.checkpointer.attach(self.engine)
        self.gate = self.info.gate
        self.raw_optimizer = self.engine.optimizer is self.engine.basic_optimizer  # ZeRO-0 fp32: nothing checks
        self.dp_rank = tdist.get_rank(self.engine.data_parallel_group) if self.topo.dp > 1 else 0
        self.sp_group = sequence.sp_group() if self.topo.sp > 1 else None
        if self.sp_group is not None:  # sp ranks of one replica read the same samples
            self.dp_rank = sequence.dp_rank(self.rank, self.topo)
        self.moe = MoEStats(self.engine.module, cfg.parallel.moe) if d.moe.on else None
        sizes = [len(r) for r in self.train_splits.values()]
        self.mixture = data_sources.mixture(cfg.data, sizes, cfg.train.seed, cfg.train.steps)
        for name, e in zip(self.mixture.names, self.mixture.epochs(cfg.train.steps)):
            if e > 1 and data_sources.is_mixture(cfg.data):  # repeats are the plan, not an accident: say so
                log.warning(f"data: source {name!r} repeats: {e:.2f} epochs over train.steps={cfg.train.steps} "
                            f"({len(self.train_splits[name]):,} samples for its share)")  # fmt: skip
        self.batches = StepBatches(list(self.train_splits.values()), cfg.data.micro_batch, cfg.data.global_batch,
                                   self.dp_rank, self.topo.dp, cfg.train.seed, eos_id=self.eos,
                                   document_masking=d.document_masking.on, mixture=self.mixture)  # fmt: skip
        if os.environ.get(TRACE_ENV):
            self.batches.trace_to(os.environ[TRACE_ENV], self.rank)
        self.tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
        self.flops_per_token = train_flops_per_token(d.hf_config, cfg.data.seq_len, causal=True)
        # the matmuls' dtype picks the peak's column: autocast's reach the bf16 peak, fp16 weights the fp16 one
        mm = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(cfg.precision.dtype), torch.float32)
        mm = torch.bfloat16 if d.autocast.on else mm
        self.peak, self.peak_src = device_peak_flops(mm, d.gpu)
        self.memory = MemoryMeter()
        self.stability = StabilityMonitor(cfg.stability)
        self.injector = FaultInjector(self.rank)
        self.breakdown = StepBreakdown(self.engine, d.step_breakdown.on, d.pipeline, d.step_breakdown.value == "events")
        # finetune=lora: the frozen base as built, to prove at the end that training left it bit for bit alone
        self.frozen_digest = param_digest(self.engine.module, trainable=False) if d.finetune.on else None

    def _resume(self) -> Path | None:
        """Load the checkpoint preflight chose and checked (the newest that verifies), if any. Returns its
        directory."""
        tag_dir = self.found.resume_from
        for why in self.found.skipped:
            log.warning(f"resume: skipped a newer checkpoint: {why}; resuming from {tag_dir or 'scratch'}")
        if tag_dir is None:
            return None
        self.start_step = self._load(tag_dir, checkpoint.read_meta(tag_dir).get("world_size"))
        log.info(f"resumed from {tag_dir} at step {self.start_step} (data offset {self.data_offset})")
        for change in self.found.changes:
            log.info(f"resume: {change}")
        return tag_dir

    def _load(self, tag_dir: Path, saved_world: int | None) -> int:
        """Restore engine, RNG, data offset and stability state from a checkpoint; returns its step."""
        step, client = checkpoint.load(self.engine, tag_dir, same_world=saved_world == self.topo.world)
        client.update(checkpoint.rollback_since(tag_dir) or {})  # a rollback after this checkpoint was saved
        meta = checkpoint.read_meta(tag_dir)
        history = length.history_for(meta, self.cfg)
        # the offset counts steps of the batch that wrote it: another global batch goes on from the same sample
        from_gb = int(client.get("global_batch") or history[-1].global_batch)
        self.data_offset = length.convert_offset(step, int(client.get("data_offset", 0)), from_gb, self.cfg,
                                                 tag_dir.name)  # fmt: skip
        self._set_history(length.continued(history, step, self.cfg))
        self.stability.load_state(client.get("stability", {}))
        return step

    def _set_history(self, history: list[length.Segment]) -> None:
        """The run's batch history (the step each global batch started at), recorded in every later checkpoint."""
        self.history = history
        self.checkpointer.meta["length"] = length.record(self.cfg, history)

    def _humaneval_tokenizer(self):
        """The tokenizer for in-training HumanEval and FIM on rank 0 (None elsewhere or when off). Collective."""
        n = self.cfg.train.eval_humaneval or self.cfg.train.eval_fim
        if not n:
            return None
        tokenizer, error = None, None
        if dist.is_rank0():
            from transformers import AutoTokenizer

            from ultrascale.errors import UltrascaleError

            try:  # the sandbox was checked before the run started; the data may have been prepared since
                tokenizer = AutoTokenizer.from_pretrained(str(humaneval_tokenizer(self.data_path, n)))
            except UltrascaleError as e:
                error = e
        error = dist.broadcast_object(error)
        if error is not None:
            raise error
        return tokenizer

    # ---- one optimizer step ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where every micro-batch goes: the engine's device (``cuda:LOCAL_RANK`` on a GPU run)."""
        return self.engine.device

    def pipe_inputs(self, b: Batch):
        """A micro-batch as the pipeline engine's data iterator yields it, on the engine's device."""
        b = to_device(b, self.device)
        inputs = (b.input_ids, b.position_ids) if b.position_ids is not None else b.input_ids
        return inputs, b.labels

    def train_step(self, step: int) -> tuple[dict, StepState]:
        """One optimizer step; returns its metrics row and what the ranks agreed in it (verdict, stop, writes)."""
        st = StepState(step, self.injector.factor(step + 1))  # planted faults name steps as logged (1-based)
        self.breakdown.start()
        (self._pipeline_step if self.decisions.pipeline else self._dense_step)(st)
        applied = self.engine.was_step_applied() and not self.gate.vetoed
        if not applied and not st.verdict.bad:  # DeepSpeed refused a non-finite gradient norm on every rank
            st.verdict = self.stability.nonfinite_grad()
        # A row that is not logged reads nothing off the device: the gradient norm (a tensor on the GPU under ZeRO),
        # the memory peak and the routing counts wait for the next logged row (the loss and the agreement, read
        # every step, are the protocol's: a bad step is judged and vetoed before its update).
        logged = self._logs(step + 1, st.verdict)
        gn = self.engine.get_global_grad_norm() if logged else None
        row = {"loss": st.loss, "lr": st.lr, "grad_norm": float(gn) if gn is not None else None,
               **self.breakdown.finish(read=logged), "mem_gb": self.memory.peak_gb() if logged else None,
               "epoch": self.batches.epoch(step + self.data_offset + 1),
               **(self.moe.flush() if self.moe and logged else {}), **self._data_row(step + self.data_offset + 1)}  # fmt: skip
        row.update(throughput(self.tokens_per_step, row["step_s"], self.flops_per_token, self.topo.world, self.peak))
        return row, st

    def _data_row(self, data_step: int) -> dict:
        """The mixture as read so far (nothing for one source): per source, tokens read, the share read in this
        stage against the share asked, and epochs; plus the stage. The dashboards' ``data/`` group."""
        if not data_sources.is_mixture(self.cfg.data):
            return {}
        r, s = self.mixture.realized(data_step), self.cfg.data.seq_len
        row = {"data/stage": r["stage"]}
        for i, n in enumerate(self.mixture.names):
            row.update({f"data/{n}/tokens": int(r["samples"][i]) * s, f"data/{n}/share": float(r["share"][i]),
                        f"data/{n}/asked": float(r["asked"][i]),
                        f"data/{n}/epoch": float(r["samples"][i]) / self.mixture.sizes[i]})  # fmt: skip
        return row

    def _fetch(self, st: StepState, micro: int) -> Batch:
        """A micro-batch, timed as data wait (a planted ``slow_data`` stall lands here too)."""
        t = time.perf_counter()
        if micro == 0:
            self.injector.stall("slow_data", st.step + 1)
        batch = self.batches.get(st.step + self.data_offset, micro)
        if self.decisions.flat_batches:
            batch = batch.flattened()
        if self.device.type == "cuda":  # page-locked, so the copy in loss() runs asynchronously
            batch = batch.pinned()
        self.breakdown.add("data_wait_s", time.perf_counter() - t)
        return batch

    def _dense_step(self, st: StepState) -> None:
        """``grad_accum`` micro-steps; the step is judged on its all-reduced loss and vetoed at the optimizer.

        With ``train.overlap_loss_reduce`` the loss all-reduce is started before the last backward and waited
        for after it, so the ranks' wait for each other hides behind the backward instead of preceding it;
        the verdict, the lr and the gate are all settled before ``engine.step()`` either way."""
        engine, gas, losses = self.engine, self.batches.grad_accum, []
        for m in range(gas):
            batch = self._fetch(st, m)
            loss, lm_loss = self.breakdown.forward(self.loss, batch)
            if st.fault is not None:
                loss, lm_loss = loss * st.fault, lm_loss * st.fault
            losses.append(lm_loss.detach())
            last = m == gas - 1
            if last:
                t = time.perf_counter()
                pending = _LossReduce(torch.stack(losses).mean().reshape(1))
                if not self.decisions.overlap_loss_reduce.on:
                    self._judge(st, pending.wait())
                self.breakdown.add("comm_s", time.perf_counter() - t)
            self.breakdown.engine_call(engine.backward, loss)
            if last and self.decisions.overlap_loss_reduce.on:
                t = time.perf_counter()
                mean = pending.wait()
                self.breakdown.add("comm_s", time.perf_counter() - t)
                self._judge(st, mean)
            if last:
                # ZeRO-0 fp32 has no DeepSpeed wrapper to refuse a non-finite gradient: check it here
                if (
                    not st.verdict.bad
                    and self.raw_optimizer
                    and not math.isfinite(grads_finite_norm(engine.module.parameters()))
                ):
                    st.verdict = self.stability.nonfinite_grad()
                self.gate.arm(st.verdict.bad)
            self.breakdown.engine_call(engine.step)
            self.breakdown.after_micro_step()

    def _judge(self, st: StepState, loss: float) -> None:
        """Agree on a verdict for the step's (all-reduced) loss, start an lr cut if that is it, set the lr.

        The same all-gather carries a pending stop (a signal on any rank, or rank 0's STOP file) and the newest
        checkpoint every rank has written in the background, so neither costs a collective of its own."""
        st.loss = loss
        agreed = agree(self.stability.judge(loss), self.stop.local(check_file=self.rank == 0),
                       self.checkpointer.written())  # fmt: skip
        st.verdict, st.stop, st.written = agreed.verdict, agreed.stop, agreed.written
        if st.verdict.action == "lr_cut":
            self.stability.start_lr_cut(st.step)
        st.lr = self._apply_lr(st.step)

    def _apply_lr(self, step: int) -> float:
        factor = self.stability.lr_factor(step) * self.mixture.lr_factor(step, self.cfg.train.steps)
        at = length.schedule_position(self.history, step, self.cfg.train.tokens is not None)  # tokens: on its curve
        return apply_lr(self.engine.optimizer, at, self.cfg.optim.sched, self.cfg.train.steps, factor)

    def _pipeline_step(self, st: StepState) -> None:
        """``engine.train_batch()`` runs the whole 1F1B schedule; the gate's ``pre_step`` judges the step
        inside it, right before the update, from the last stages' loss."""
        micro = [self._fetch(st, m) for m in range(self.batches.grad_accum)]
        st.lr = self._apply_lr(st.step)
        self.gate.arm(False)
        self.gate.pre_step = lambda: self._judge_pipeline(st)
        self.engine.train_batch(data_iter=iter([self.pipe_inputs(b) for b in micro]))

    def _judge_pipeline(self, st: StepState) -> bool:
        """On every rank: only last-stage ranks hold the loss (``engine.total_loss``, summed over micro-batches);
        one world all-reduce of (sum, count) gives every stage the mean. Returns True to veto the update."""
        engine = self.engine
        last = engine.is_last_stage() and engine.total_loss is not None
        local = float(engine.total_loss) / self.batches.grad_accum if last else 0.0
        if st.fault is not None and (last or math.isnan(st.fault)):
            local *= st.fault
        t = time.perf_counter()
        totals = coll_tensor([local, float(last)], torch.float64)
        if tdist.is_initialized():
            tdist.all_reduce(totals)
        self.breakdown.add("comm_s", time.perf_counter() - t)
        self._judge(st, float(totals[0] / totals[1]))
        return st.verdict.bad

    def loss(self, batch: Batch, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, LM loss to log) for one micro-batch (non-pipeline path), moved to the engine's
        device first: training and evaluation both come through here."""
        batch = to_device(batch, self.device)
        if self.sp_group is not None:
            return sequence.sp_loss(self.engine, batch, self.sp_group, self.topo.sp)
        out = self.engine(**batch.model_inputs())
        if self.moe is not None:
            return out.loss, self.moe.observe(out, record=train)
        return out.loss, out.loss

    # ---- checkpoints and rollbacks ----------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Save step ``step``: whole (``latest`` moves before this returns), or with ``train.checkpoint_async`` a
        snapshot that is written in the background and becomes ``latest`` once every rank has written it.
        ``checkpoint_s`` is what training waited either way (the stall the comb report shows)."""
        t0 = time.perf_counter()
        delay = self.injector.take("slow_ckpt", step)  # a planted slow disk
        if not self.checkpointer.background:
            time.sleep(delay)
        client = {"data_offset": self.data_offset, "stability": self.stability.state(),
                  "data_cursors": self.data_cursors(step + self.data_offset),
                  "global_batch": self.cfg.data.global_batch}  # fmt: skip
        waited = self.checkpointer.save(self.engine, step, client, write_delay=delay)
        secs = time.perf_counter() - t0
        how = "snapshot taken, writing in the background" if self.checkpointer.background else "saved"
        log.info(f"checkpoint {checkpoint.tag_for(step)} {how} in {secs:.1f}s")
        self.metrics.event(step, "checkpoint", checkpoint_s=secs, wait_s=waited or None, console=False,
                           background=self.checkpointer.background or None,
                           **self.checkpointer.staging_record())  # fmt: skip

    def data_cursors(self, data_step: int) -> dict[str, int]:
        """Samples read from every source before ``data_step``: recorded in each checkpoint, and checked at a
        resume against what this run's mixture puts there (:func:`ultrascale.train.resume.check_resume`)."""
        return {n: int(c) for n, c in zip(self.mixture.names, self.mixture.cursors(data_step))}

    def _commit_written(self, step: int, written: int) -> None:
        """A background checkpoint every rank has written becomes ``latest`` (rank 0 writes the pointer)."""
        done = self.checkpointer.commit_written(written)
        if done is not None:
            self.metrics.event(step, "checkpoint_written", checkpoint=done.name, write_s=self.checkpointer.write_s,
                               console=False)  # fmt: skip

    def _rollback(self, step: int, verdict: Verdict) -> int:
        """Reload the newest checkpoint and skip the data window from it through the bad step; returns its step."""
        self._flush_checkpoint(step)  # roll back to the newest checkpoint, written or in flight
        tag_dir = self.checkpointer.latest()
        if tag_dir is None:
            raise TrainingHealthError(
                f"stability: {verdict.reason} at step {step} calls for a rollback but no checkpoint exists yet: "
                f"set train.checkpoint_interval below {step + 1} or use stability.{verdict.reason}=skip"
            )
        old_offset, counters = self.data_offset, self.stability.state()
        to_step = self._load(tag_dir, self.topo.world)
        self.stability.load_state(counters)  # the checkpoint's counters predate this rollback
        self.data_offset = old_offset + step + 1 - to_step  # step `to_step` now reads what step+1 would have
        window = (to_step + old_offset, step + 1 + old_offset)  # the data indices never to be read again
        if dist.is_rank0():  # durable now: a crash before the next checkpoint must not re-read the window
            checkpoint.record_rollback(self.checkpointer.ckpt_dir, tag_dir,
                                       {"data_offset": self.data_offset, "stability": self.stability.state(),
                                        "global_batch": self.cfg.data.global_batch}, window)  # fmt: skip
        self.metrics.event(step + 1, "rollback", reason=verdict.reason, to_step=to_step, zscore=verdict.zscore,
                           skip_from=window[0], skip_to=window[1])  # fmt: skip
        if os.environ.get(FAULT_ROLLBACK_ENV) and dist.is_rank0():
            os.kill(os.getpid(), signal.SIGKILL)
        return to_step

    # ---- the loop -------------------------------------------------------------------------------------
    def fit(self) -> FitResult:
        steps, res = self.cfg.train.steps, FitResult()
        bar = self._progress_bar(steps)
        profiler = StepProfiler(self.out, self.rank, self.cfg.train.profile_start, self.cfg.train.profile_steps,
                                self.start_step)  # fmt: skip
        step, t_first, t_last = self.start_step, None, None
        if self._stop_before_training():
            res.stopped = self.stop.describe(self.stop.code)
            step = steps  # nothing to run; the checkpoint resumed from is current
        while step < steps:
            self._planted_failures(step)
            t_step = time.perf_counter()
            profiler.before(res.steps_run)
            res.last, st = self.train_step(step)
            verdict = st.verdict
            self.stop.beat(res.last["step_s"])
            profiler.after(res.steps_run)
            self.injector.fired(step + 1)
            done = step + 1
            if res.steps_run == 0 and self.decisions.compile.on:
                log.info(f"compile: first step (compile included) took {time.perf_counter() - t_step:.1f}s")
            res.steps_run += 1
            if res.steps_run > 1:  # the first step includes one-off warm-up costs
                res.tokens_per_s.append(res.last["tokens_per_s"])
            stopping = bool(st.stop) and done < steps
            if stopping:  # the views wait until the stop's checkpoint is `latest`: no dashboard may cost the step
                self.metrics.hold()
            self._record(done, verdict, res.last)
            if verdict.action == "rollback":
                step = self._rollback(step, verdict)
                continue
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{res.last['loss']:.3f}")
            # The steady-state window ends with the last step's update: the run's closing eval and checkpoint
            # are its exit, not its speed (evals and checkpoints between steps stay inside the window).
            t_last = time.perf_counter()
            if not stopping:  # a stop saves at once (the launcher's kill timer runs): an eval due now is skipped
                self._after_step(done, steps, res)
            self._commit_written(done, st.written)
            if t_first is None:
                t_first, res.first_step_unix = time.perf_counter(), time.time()
            step = done
            if stopping:
                res.stopped = self._stop_after(done, st.stop)
                break
        self._flush_checkpoint(step)
        self.metrics.release()
        res.end_step = step if res.steps_run else self.start_step  # a stop before the first step read nothing
        res.loop_s = t_last - t_first if t_first and t_last and res.steps_run > 1 else 0.0
        profiler.close(res.steps_run)
        if bar:
            bar.close()
        return res

    def _logs(self, done: int, verdict: Verdict) -> bool:
        """Whether step ``done``'s row is logged: every ``train.log_interval`` steps, the last, and a bad step."""
        return done % self.cfg.train.log_interval == 0 or done == self.cfg.train.steps or verdict.action != "ok"

    def _record(self, done: int, verdict: Verdict, row: dict) -> None:
        if self._logs(done, verdict):
            self.metrics.log(done, row)
            self.memory.reset()  # the next row's mem_gb is the next interval's peak
        self._report_verdict(done, verdict, row)
        self.stability.record(verdict, row["loss"], done)

    def _after_step(self, done: int, last_step: int, res: FitResult) -> None:
        """What is due after a step: the evaluator's run, then the checkpointer's save."""
        self.checkpointer.prestage(self.engine)  # pinned staging: allocated after the first step, not in the first save
        if self.evaluator.due(done, last_step if self.cfg.train.final_eval else -1):
            with self.stop.unguarded():
                res.last_eval = self.evaluator.run(done)
            self.metrics.event(done, "eval", **res.last_eval)
        if self.checkpointer.due(done, last_step if self.cfg.train.final_save else -1):
            self.save(done)

    def _stop_before_training(self) -> bool:
        """A stop asked for during setup (model build, resume, compile of nothing yet) ends the run before its
        first step: every rank agrees on it in one all-gather, and the checkpoint it resumed from is current."""
        code = agree(Verdict(), self.stop.local(check_file=self.rank == 0)).stop
        if code:
            self.stop.code = self.stop.code or code
            self._record_stop(self.start_step, code, self.checkpointer.latest())
        return bool(code)

    def _stop_after(self, done: int, code: int) -> str:
        """Every rank agreed to stop after step ``done``: save it (unless just saved), wait for the write, record
        the stop. The run then ends like a finished one (summary, report, exit code 0)."""
        if not self.checkpointer.saved(done):
            self.save(done)
        self._flush_checkpoint(done)
        self.metrics.release()  # `latest` is step `done` now; the views may fail or stall without losing it
        self._record_stop(done, code, self.checkpointer.latest())
        self.stop.settle()
        return self.stop.describe(code)

    def _record_stop(self, step: int, code: int, tag_dir: Path | None) -> None:
        name = self.stop.describe(code)
        self.metrics.event(step, "stop", signal=name, checkpoint=tag_dir.name if tag_dir else None)
        if dist.is_rank0():
            from ultrascale.atomic import atomic_write_text

            record = {"signal": name, "step": step, "checkpoint": str(tag_dir) if tag_dir else None,
                      "time": time.time()}  # fmt: skip
            atomic_write_text(self.out / STOPPED, json.dumps(record) + "\n")
            self.stop.consume_file()
        log.info(f"stopped by {name} after step {step}: checkpoint {tag_dir}; run the same command again to resume")

    def _flush_checkpoint(self, step: int) -> None:
        """Collective: wait for a background write in flight and make it ``latest`` (before a rollback reads
        ``latest``, and when the run ends). The wait is booked as checkpoint time."""
        t0 = time.perf_counter()
        done = self.checkpointer.flush()
        if done is not None:
            self.metrics.event(step, "checkpoint_written", checkpoint=done.name, write_s=self.checkpointer.write_s,
                               wait_s=time.perf_counter() - t0, console=False)  # fmt: skip

    def _planted_failures(self, step: int) -> None:
        at, _, who = os.environ.get(FAULT_ENV, "").partition(":")
        if at and step == int(at) and self.rank == int(who or 0):
            marker = self.out / f".fault_fired_{at}_{self.rank}"  # once per run directory: a restart runs clean
            if not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        raise_on = int(os.environ.get(RAISE_ENV, -1))
        if step == self.start_step and self.rank == raise_on:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {step} ({RAISE_ENV}={raise_on})")

    def _progress_bar(self, steps: int):
        if not (dist.is_rank0() and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(total=steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True)

    def _report_verdict(self, done: int, verdict: Verdict, row: dict) -> None:
        if verdict.action in ("ok", "rollback"):  # a rollback is logged once it has happened
            return
        fields = {"reason": verdict.reason, "loss": row["loss"], "zscore": verdict.zscore,
                  "grad_norm": row["grad_norm"]}  # fmt: skip
        if verdict.action == "lr_cut":
            fields.update(factor=self.cfg.stability.lr_cut_factor, until_step=self.stability.lr_cut_until + 1)
        self.metrics.event(done, verdict.action, **fields)

    # ---- the end of the run ---------------------------------------------------------------------------
    def summary(self, res: FitResult) -> dict:
        """The end-of-run record: layout, replica agreement, stability counters and, if it trained, the numbers."""
        steps = self.cfg.train.steps
        out = {"steps": steps, "resumed_from": self.start_step, "world_size": self.topo.world,
               "topology": self.topo.as_dict(), "total_params": self.info.n_params,
               "trainable_params": self.info.n_params if self.info.n_trainable is None else self.info.n_trainable,
               "finetune": self.decisions.finetune.value}  # fmt: skip
        agree_, digests, groups = (replicas_agree(self.engine.module, self.engine.data_parallel_group)
                                   if self.cfg.train.param_digest else (None, None, None))  # fmt: skip
        out.update(replicas_agree=agree_, param_digests=digests, replica_groups=groups)
        if agree_ is False:
            log.warning(f"data-parallel replicas hold different parameters: {digests}")
        if self.frozen_digest is not None:
            end = param_digest(self.engine.module, trainable=False)
            out.update(frozen_digest_start=self.frozen_digest, frozen_digest_end=end)
            if end != self.frozen_digest:
                log.warning(f"the frozen base changed during training ({self.frozen_digest} -> {end})")
        if self.moe is not None:  # expert shards differ by design; the rest must agree
            out.update(moe_shard_report(self.engine.module, self.engine.data_parallel_group))
        out.update(tokens=length.tokens_at(self.history, res.end_step), asked_tokens=length.record(self.cfg)["tokens"])
        out.update(self.stability.counters(), data_offset=self.data_offset, mfu_peak=self.peak_src,
                   mem_gb_is=self.memory.kind, complete=res.stopped is None)  # fmt: skip
        data_step = res.end_step + self.data_offset
        if data_sources.is_mixture(self.cfg.data):  # realized shares over every sample read, from step 0
            out.update(data_mix=self.mixture.mix(data_step), data_cursors=self.data_cursors(data_step),
                       data_epochs={n: round(float(e), 4) for n, e in zip(self.mixture.names,
                                                                          self.mixture.epochs(data_step))})  # fmt: skip
        if res.stopped:
            out["stopped_by"] = res.stopped
        if res.first_step_unix is not None:  # from the process's creation, as the launcher started it
            started = psutil.Process().create_time()
            out.update(first_step_unix=res.first_step_unix, time_to_first_step_s=res.first_step_unix - started)
        if res.steps_run and res.last_eval is not None:
            tps = res.tokens_per_s
            out.update(final_loss=res.last["loss"], eval_loss=res.last_eval["eval_loss"],
                       eval_perplexity=res.last_eval["eval_perplexity"],
                       tokens_per_s=sum(tps) / len(tps) if tps else res.last["tokens_per_s"],
                       wall_tokens_per_s=self.tokens_per_step * (res.steps_run - 1) / res.loop_s if res.loop_s else None,
                       mfu=res.last["mfu"], mem_gb=max(self.memory.run_peak_gb, self.memory.peak_gb()))  # fmt: skip
        return out

    def close(self) -> None:
        """Release the engine now: ZeRO-3's gradient hooks form a cycle through C++ autograd nodes that the
        garbage collector cannot see, which would keep the engine and its process groups alive until exit."""
        self.engine.destroy()
        self.engine = self.gate = self.evaluator = None

    def finish(self, summary: dict) -> None:
        """Rank 0: summary.json, the plot, the comb report, the loggers closed, and where everything is."""
        if not dist.is_rank0():
            return
        write_json(self.out / SUMMARY, summary)
        self.metrics.summary(summary)
        plot = None
        if self.cfg.logger.plot:
            plot = plot_curves(read_metrics(self.out / METRICS), self.out / "curves.png", title=self.out.name)
        report = _write_report(self.out)
        wandb_dir = self.metrics.close()
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}
        lines = [f"done: {json.dumps(shown)}", f"  run dir     {self.out}",
                 f"  metrics     {self.out / METRICS}" + (f"  plot {plot}" if plot else "")]  # fmt: skip
        if report:
            lines.append(f"  report      {report}  (python -m ultrascale.report run_dir={self.out})")
        lines.append(f"  checkpoint  {self.checkpointer.latest()}")
        if summary.get("stopped_by"):
            lines.insert(
                1,
                f"  stopped     by {summary['stopped_by']} before step {self.cfg.train.steps}: run the "
                "same command again to resume from the checkpoint",
            )
        if self.cfg.logger.tensorboard:
            lines.append(f"  tensorboard tensorboard --logdir {self.out / 'tensorboard'}")
        if wandb_dir:
            lines.append(f"  wandb       {Path(wandb_dir).parent}  (wandb sync {Path(wandb_dir).parent})")
        log.info("\n".join(lines))


def _write_report(out: Path) -> Path | None:
    """The comb report (report.md + report.png); a failure to draw it never fails a finished run."""
    try:
        from ultrascale.report import write_report

        md, _ = write_report([out])
        return md
    except Exception as e:
        log.warning(f"report not written: {type(e).__name__}: {e}")
        return None


def _prepare_run_dir(cfg: DictConfig, out: Path, ds_config: dict) -> Path | None:
    """Rank 0 alone creates the run directory and writes this attempt's resolved config and DeepSpeed JSON to
    ``attempts/NNN/``; the others wait. Returns that directory on rank 0.

    The run's own ``config.yaml`` and ``ds_config.json`` are replaced only by :func:`_promote_attempt`, once the
    checkpoint has loaded: an attempt that fails (a resume DeepSpeed refuses, a crash while building) leaves
    them describing the run that made the checkpoints, and its own config beside them."""
    attempt = None
    if dist.is_rank0():
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints").mkdir(exist_ok=True)
        n = 1 + max((int(p.name) for p in (out / ATTEMPTS).glob("[0-9]*") if p.name.isdigit()), default=0)
        attempt = out / ATTEMPTS / f"{n:03d}"
        attempt.mkdir(parents=True)
        (attempt / CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
        write_json(attempt / DS_CONFIG, ds_config)
    dist.barrier()
    return attempt


def _promote_attempt(attempt: Path | None, out: Path) -> None:
    """Rank 0: this attempt is the run now (its checkpoint loaded, or it started fresh): its config becomes the
    run's, each file replaced atomically."""
    if attempt is not None:
        from ultrascale.atomic import atomic_write_bytes

        for name in (CONFIG, DS_CONFIG):
            atomic_write_bytes(out / name, (attempt / name).read_bytes())


def run(cfg: DictConfig, d: Decisions) -> dict | None:
    """Train with an already-validated config and its decisions. Collective: every rank calls it."""
    out = resolve_path(cfg.output_dir)
    found = preflight(cfg, d)  # read-only, on every rank: nothing is written for a run that cannot start
    dist.init_distributed()
    d = agree_across_ranks(d)  # each rank decided from its own GPU; every rank runs rank 0's decisions
    stop = StopRequest(dist.rank(), out / STOP_REQUEST).install()  # from here a signal is a stop, not a kill
    typed: Any = OmegaConf.to_object(cfg)  # typed settings from here on: components get their sub-configs
    trainer = Trainer(typed, d, out, OmegaConf.to_container(cfg, resolve=True), found, stop)
    attempt = _prepare_run_dir(cfg, out, trainer.ds_config)
    dist.setup_logging(str(out / "logs" / f"rank{dist.rank():05d}.log"))
    trainer.setup()
    _promote_attempt(attempt, out)
    result = trainer.fit()
    stop.settle()  # training is over: nothing left for the stop watchdog to guard
    summary = trainer.summary(result)
    trainer.finish(summary)
    trainer.close()
    stop.restore()
    return summary
