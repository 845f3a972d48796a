"""The training loop: data -> engine steps -> metrics, evals, stability policies and atomic checkpoints.

Each optimizer step (:mod:`ultrascale.train.step`) is judged on its all-reduced loss before its update, so a NaN
or a spike can be skipped, rolled back to the last checkpoint, or answered with an lr cut. The data a step reads
is addressed by ``step + data_offset``: a rollback moves the offset past the data window that caused it; the
move is recorded beside the checkpoints when it happens and travels in every later checkpoint, so a run killed
after a rollback resumes without re-reading the window.

What the run does was decided once (:mod:`ultrascale.levers.decide`); the trainer reads that record and the typed
config, and the checkpointer (saves, commits, the stop's save) and evaluator decide when they are due.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as tdist

from ultrascale.config.root import RootConfig
from ultrascale.config.train import AUTO
from ultrascale.data import sources as data_sources
from ultrascale.data.loader import TRACE_ENV, Batch, StepBatches
from ultrascale.data.prepare import check_prepared, ensure_prepared
from ultrascale.data.shards import load_manifest, open_split
from ultrascale.levers import length
from ultrascale.levers.decide import Decisions
from ultrascale.levers.deepspeed import build_ds_config
from ultrascale.model import sequence
from ultrascale.model.flops import train_flops_per_token
from ultrascale.model.moe import MoEStats
from ultrascale.runtime import dist
from ultrascale.runtime.device import to_device
from ultrascale.train import checkpoint
from ultrascale.train.banner import banner
from ultrascale.train.breakdown import StepBreakdown
from ultrascale.train.consistency import param_digest
from ultrascale.train.engine import build_engine
from ultrascale.train.evaluate import Evaluator, eval_tokenizer
from ultrascale.train.hooks import step_hook
from ultrascale.train.loggers import MetricLogger, data_row, progress_bar, truncate_metrics
from ultrascale.train.metrics import MemoryMeter, peak_flops, throughput
from ultrascale.train.preflight import Preflight
from ultrascale.train.profiler import StepProfiler
from ultrascale.train.resume import checkpoint_meta
from ultrascale.train.rundir import METRICS, STOPPED
from ultrascale.train.stability import FaultInjector, StabilityMonitor, TrainingHealthError, Verdict, agree
from ultrascale.train.step import OptimizerStep, StepState
from ultrascale.train.stop import StopRequest
from ultrascale.train.summary import FitResult

log = logging.getLogger("ultrascale")


class Trainer:
    def __init__(self, cfg: RootConfig, d: Decisions, out: Path, config_dict: dict, found: Preflight,
                 stop: StopRequest | None = None):  # fmt: skip
        self.cfg, self.decisions, self.topo, self.out = cfg, d, d.topo, out
        self.config_dict, self.found, self.data_checked = config_dict, found, found.data_checked
        self.ds_config = build_ds_config(cfg, d)
        self.rank = dist.rank()
        self.stop = stop or StopRequest(self.rank)
        every = cfg.train.checkpoint_interval  # a number of steps, or `auto` (measured on the first save)
        auto = checkpoint.AutoInterval.for_run(cfg) if every == AUTO else None
        self.checkpointer = checkpoint.Checkpointer(
            out / "checkpoints", 0 if auto else every, cfg.train.keep_checkpoints, checkpoint_meta(cfg, d),
            background=cfg.train.checkpoint_async, staging=d.checkpoint_staging.value, auto=auto,
        )  # fmt: skip
        self.checkpointer.beat = self.stop.beat
        self.stepper = OptimizerStep(self)
        self.at_step = step_hook()

    # ---- setup: each job a named step ------------------------------------------------------------
    def setup(self, restarts: dict[str, int] | None = None) -> None:
        """Data, engine, resumed state, logger, evaluator; ``restarts``: the launcher's restart counts, for the
        resume event."""
        self._open_data()
        self._build()
        self.start_step, self.data_offset = 0, 0
        self._set_history(length.continued([], 0, self.cfg.data))
        resumed_from = self._resume()
        lost_steps, lost_s = truncate_metrics(self.out / METRICS, self.start_step) if dist.is_rank0() else (0, 0.0)
        self.metrics = MetricLogger(self.cfg.logger, self.out, dist.is_rank0(), self.config_dict, self.ds_config)
        self.checkpointer.metrics = self.metrics
        if resumed_from is not None or lost_steps or restarts:
            self.metrics.event(self.start_step, "resume", from_step=self.start_step,
                               checkpoint=str(resumed_from) if resumed_from else None, steps_lost=lost_steps,
                               lost_s=lost_s, **(restarts or {}), changes="; ".join(self.found.changes) or None,
                               skipped="; ".join(self.found.skipped) or None)  # fmt: skip
        if dist.is_rank0():
            (self.out / STOPPED).unlink(missing_ok=True)  # an earlier attempt's stop is answered by this one
        dist.barrier()
        train = self.cfg.train
        self.evaluator = Evaluator(self, train.eval_interval, train.eval_humaneval, eval_tokenizer(train, self.data_path),
                                   self.out)  # fmt: skip
        log.info(banner(self.cfg, self.decisions, self.ds_config, self.info, self.peak_src, self.out))
        if self.checkpointer.auto is not None:
            log.info(self.checkpointer.auto.plan())

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
        held_out = data_sources.eval_path(data)  # one held-out split for every arm of an ablation, when set
        val = {"eval": held_out} if held_out is not None else dict(zip(names, paths))
        self.val_splits = {n: open_split(p, "validation", verify=False) for n, p in val.items()}
        self.eos = int(self.manifest["eos_token_id"])

    def _build(self) -> None:
        """The engine, and everything that reads its groups: data-parallel rank, batches, timers, monitors."""
        self._build_engine()
        self._build_data()
        self._build_monitors()

    def _build_engine(self) -> None:
        """The DeepSpeed engine and what its groups decide: the data-parallel rank, the sequence group, MoE stats."""
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

    def _build_data(self) -> None:
        """The step-addressed batches over the mixture, and the step's token and FLOP counts."""
        cfg, d = self.cfg, self.decisions
        sizes, self.mixed = [len(r) for r in self.train_splits.values()], data_sources.is_mixture(cfg.data)
        self.mixture = data_sources.mixture(cfg.data, sizes, cfg.train.seed, cfg.train.steps)
        for name, e in zip(self.mixture.names, self.mixture.epochs(cfg.train.steps)):
            if e > 1 and self.mixed:  # repeats are the plan, not an accident: say so
                log.warning(f"data: source {name!r} repeats: {e:.2f} epochs over train.steps={cfg.train.steps} "
                            f"({len(self.train_splits[name]):,} samples for its share)")  # fmt: skip
        self.batches = StepBatches(list(self.train_splits.values()), cfg.data.micro_batch, cfg.data.global_batch,
                                   self.dp_rank, self.topo.dp, cfg.train.seed, eos_id=self.eos,
                                   document_masking=d.document_masking.on, mixture=self.mixture)  # fmt: skip
        if os.environ.get(TRACE_ENV):
            self.batches.trace_to(os.environ[TRACE_ENV], self.rank)
        self.tokens_per_step = length.tokens_per_step(cfg.data)
        self.flops_per_token = train_flops_per_token(d.hf_config, cfg.data.seq_len, causal=True)
        self.peak, self.peak_src = peak_flops(str(cfg.precision.dtype), d.autocast.on, d.gpu)

    def _build_monitors(self) -> None:
        """Memory, stability, planted faults, the step's breakdown and the frozen base's digest."""
        cfg, d = self.cfg, self.decisions
        self.memory = MemoryMeter()
        self.stability = StabilityMonitor(cfg.stability)
        self.injector = FaultInjector(self.rank)
        self.breakdown = StepBreakdown(self.engine, d.step_breakdown.on, d.pipeline, d.step_breakdown.value == "events",
                                       rl=cfg.grpo is not None)  # fmt: skip
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
        self.start_step = self._load(tag_dir, checkpoint.read_meta(tag_dir).get("world_size") == self.topo.world)
        log.info(f"resumed from {tag_dir} at step {self.start_step} (data offset {self.data_offset})")
        for change in self.found.changes:
            log.info(f"resume: {change}")
        return tag_dir

    def _load(self, tag_dir: Path, same_world: bool) -> int:
        """Restore engine, RNG, data offset and stability state from a checkpoint; returns its step."""
        step, self.data_offset, history, stability = self.checkpointer.restore(self.engine, tag_dir, self.cfg,
                                                                               same_world)  # fmt: skip
        self._set_history(history)
        self.stability.load_state(stability)
        return step

    def _set_history(self, history: list[length.Segment]) -> None:
        """The run's batch history (the step each global batch started at), recorded in every later checkpoint."""
        self.history = history
        self.checkpointer.meta["length"] = length.record(self.cfg, history)

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
        self.stepper.run(st)
        applied = self.engine.was_step_applied() and not self.gate.vetoed
        if not applied and not st.verdict.bad:  # DeepSpeed refused a non-finite gradient norm on every rank
            st.verdict = self.stability.nonfinite_grad()
        # A row that is not logged reads nothing off the device: the gradient norm (a tensor on the GPU under ZeRO),
        # the memory peak and the routing counts wait for the next logged row (the loss and the agreement, read
        # every step, are the protocol's: a bad step is judged and vetoed before its update).
        logged = self._logs(step + 1, st.verdict)
        gn = self.engine.get_global_grad_norm() if logged else None
        data_step = step + self.data_offset + 1
        row = {"loss": st.loss, "lr": st.lr, "grad_norm": float(gn) if gn is not None else None,
               **self.breakdown.finish(read=logged), "mem_gb": self.memory.peak_gb() if logged else None,
               "epoch": self.batches.epoch(data_step), **(self.moe.flush() if self.moe and logged else {}),
               **(data_row(self.mixture, data_step, self.cfg.data.seq_len) if self.mixed else {})}  # fmt: skip
        row.update(throughput(self.tokens_per_step, row["step_s"], self.flops_per_token, self.topo.world, self.peak))
        return row, st

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
        """Save step ``step`` with the trainer state that travels with it (:meth:`Checkpointer.save_step`)."""
        client = {"data_offset": self.data_offset, "stability": self.stability.state(),
                  "data_cursors": self.data_cursors(step + self.data_offset),
                  "global_batch": self.cfg.data.global_batch}  # fmt: skip
        self.checkpointer.save_step(self.engine, step, client, delay=self.injector.take("slow_ckpt", step))

    def data_cursors(self, data_step: int) -> dict[str, int]:
        """Samples read from every source before ``data_step``: recorded in each checkpoint, and checked at a
        resume against what this run's mixture puts there (:func:`ultrascale.train.resume.check_resume`)."""
        return {n: int(c) for n, c in zip(self.mixture.names, self.mixture.cursors(data_step))}

    def _rollback(self, step: int, verdict: Verdict) -> int:
        """Reload the newest checkpoint and skip the data window from it through the bad step; returns its step."""
        self.checkpointer.drain(step)  # roll back to the newest checkpoint, written or in flight
        tag_dir = self.checkpointer.latest()
        if tag_dir is None:
            raise TrainingHealthError(
                f"stability: {verdict.reason} at step {step} calls for a rollback but no checkpoint exists yet: "
                f"set train.checkpoint_interval below {step + 1} or use stability.{verdict.reason}=skip"
            )
        old_offset, counters = self.data_offset, self.stability.state()
        to_step = self._load(tag_dir, same_world=True)
        self.stability.load_state(counters)  # the checkpoint's counters predate this rollback
        self.data_offset = old_offset + step + 1 - to_step  # step `to_step` now reads what step+1 would have
        window = (to_step + old_offset, step + 1 + old_offset)  # the data indices never to be read again
        if dist.is_rank0():  # durable now: a crash before the next checkpoint must not re-read the window
            checkpoint.record_rollback(self.checkpointer.ckpt_dir, tag_dir,
                                       {"data_offset": self.data_offset, "stability": self.stability.state(),
                                        "global_batch": self.cfg.data.global_batch}, window)  # fmt: skip
        self.metrics.event(step + 1, "rollback", reason=verdict.reason, to_step=to_step, zscore=verdict.zscore,
                           skip_from=window[0], skip_to=window[1])  # fmt: skip
        return to_step

    # ---- the loop -------------------------------------------------------------------------------------
    def fit(self) -> FitResult:
        """Run the steps from ``start_step`` to ``train.steps`` (a rollback steps back, a stop ends early); each
        step's row is logged, then what is due after it runs and a background checkpoint every rank has written
        becomes ``latest``."""
        steps, res = self.cfg.train.steps, FitResult()
        bar = progress_bar(dist.is_rank0(), steps, self.start_step)
        profiler = StepProfiler(self.out, self.rank, self.cfg.train.profile_start, self.cfg.train.profile_steps,
                                self.start_step)  # fmt: skip
        step, t_first, t_last = self._before_first_step(res), None, None
        while step < steps:
            st = self._run_step(step, res, profiler)
            done = step + 1
            stopping = bool(st.stop) and done < steps
            if stopping:  # the views wait until the stop's checkpoint is `latest`: no dashboard may cost the step
                self.metrics.hold()
            self._record(done, st.verdict, res.last)
            if st.verdict.action == "rollback":
                step = self._rollback(step, st.verdict)
                continue
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{res.last['loss']:.3f}")
            # The steady-state window ends with the last step's update: the run's closing eval and checkpoint
            # are its exit, not its speed (evals and checkpoints between steps stay inside the window).
            t_last = time.perf_counter()
            if not stopping:  # a stop saves at once (the launcher's kill timer runs): an eval due now is skipped
                self._after_step(done, steps, res)
            self.checkpointer.commit_agreed(done, st.written)
            if t_first is None:
                t_first, res.first_step_unix = time.perf_counter(), time.time()
            step = done
            if stopping:  # save this step (unless just saved), then the stop's commit; the run ends as if finished
                if not self.checkpointer.saved(done):
                    self.save(done)
                res.stopped = self.checkpointer.commit_stop(done, st.stop, self.stop, self.out)
                break
        self.checkpointer.drain(step)
        self.metrics.release()
        res.end_step = step if res.steps_run else self.start_step  # a stop before the first step read nothing
        res.loop_s = t_last - t_first if t_first and t_last and res.steps_run > 1 else 0.0
        profiler.close(res.steps_run)
        if bar:
            bar.close()
        return res

    def _before_first_step(self, res: FitResult) -> int:
        """The step the loop starts at: ``train.steps`` when a stop came during setup (nothing to run; the
        checkpoint resumed from is current), else ``start_step``, after the eval of ``train.eval_at_start``."""
        if self._stop_before_training():
            res.stopped = self.stop.describe(self.stop.code)
            return self.cfg.train.steps
        if self.cfg.train.eval_at_start and self.start_step == 0 < self.cfg.train.steps:
            with self.stop.unguarded():
                res.last_eval = self.evaluator.run(0)
            self.metrics.event(0, "eval", **res.last_eval)
        return self.start_step

    def _run_step(self, step: int, res: FitResult, profiler: StepProfiler) -> StepState:
        """Step ``step`` (0-based) with what surrounds it: the test hook, the profiler window, the stop watchdog's
        heartbeat and the run's counts; its row is ``res.last``."""
        self.at_step(self, step)  # the one hook point tests plant failures through (a no-op otherwise)
        t_step = time.perf_counter()
        profiler.before(res.steps_run)
        res.last, st = self.train_step(step)
        self.stop.beat(res.last["step_s"])
        self.checkpointer.observe_step(res.last["step_s"])
        profiler.after(res.steps_run)
        self.injector.fired(step + 1)
        if res.steps_run == 0 and self.decisions.compile.on:
            log.info(f"compile: first step (compile included) took {time.perf_counter() - t_step:.1f}s")
        res.steps_run += 1
        if res.steps_run > 1:  # the first step includes one-off warm-up costs
            res.tokens_per_s.append(res.last["tokens_per_s"])
        return st

    def _logs(self, done: int, verdict: Verdict) -> bool:
        """Whether step ``done``'s row is logged: every ``train.log_interval`` steps, the last, and a bad step."""
        return done % self.cfg.train.log_interval == 0 or done == self.cfg.train.steps or verdict.action != "ok"

    def _record(self, done: int, verdict: Verdict, row: dict) -> None:
        if self._logs(done, verdict):
            self.metrics.log(done, row)
            self.memory.reset()  # the next row's mem_gb is the next interval's peak
        if verdict.action not in ("ok", "rollback"):  # a rollback is logged once it has happened
            cut = {"factor": self.cfg.stability.lr_cut_factor, "until_step": self.stability.lr_cut_until + 1}
            self.metrics.verdict(done, verdict, row, **(cut if verdict.action == "lr_cut" else {}))
        self.stability.record(verdict, row["loss"], done)

    def _after_step(self, done: int, last_step: int, res: FitResult) -> None:
        """What is due after a step: the evaluator's run, then the checkpointer's save."""
        self.checkpointer.prestage(self.engine)  # pinned staging: allocated after the first step, not in the first save
        if self.evaluator.due(done, last_step if self.cfg.train.final_eval else -1):
            with self.stop.unguarded():
                res.last_eval = self.evaluator.run(done, final=done == last_step)
            self.metrics.event(done, "eval", **res.last_eval)
        if self.checkpointer.due(done, last_step if self.cfg.train.final_save else -1):
            self.save(done)

    def _stop_before_training(self) -> bool:
        """A stop asked for during setup (model build, resume, compile of nothing yet) ends the run before its
        first step: every rank agrees on it in one all-gather, and the checkpoint it resumed from is current."""
        code = agree(Verdict(), self.stop.local(check_file=self.rank == 0)).stop
        if code:
            self.stop.code = self.stop.code or code
            self.checkpointer.record_stop(self.start_step, code, self.stop, self.out)
        return bool(code)

    # ---- the end of the run ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release the engine now: ZeRO-3's gradient hooks form a cycle through C++ autograd nodes that the
        garbage collector cannot see, which would keep the engine and its process groups alive until exit."""
        self.engine.destroy()
        self.engine = self.gate = self.evaluator = None
