"""The training loop: data -> engine steps -> metrics, evals, stability policies and atomic checkpoints.

One optimizer step is ``grad_accum`` micro-steps of forward, backward and ``engine.step()``. Before the
last micro-step's backward the step's loss is all-reduced and judged (:mod:`ultrascale.train.stability`),
so a NaN or a spike can be skipped before its update is applied, rolled back to the last checkpoint, or
answered with an lr cut. The data a step reads is addressed by ``step + data_offset``: a rollback moves
the offset past the data window that caused it, and the offset is saved in every checkpoint, so a run that
is killed after a rollback resumes without re-reading the skipped window.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist
from omegaconf import DictConfig, OmegaConf

from ultrascale import dist
from ultrascale.atomic import atomic_write_text
from ultrascale.config.compose import resolve_path
from ultrascale.config.deepspeed import build_ds_config
from ultrascale.config.topology import Topology
from ultrascale.data.loader import TRACE_ENV, Batch, StepBatches, eval_batches
from ultrascale.data.prepare import check_prepared, ensure_prepared
from ultrascale.data.shards import load_manifest, open_split
from ultrascale.model import sequence
from ultrascale.model.build import build_hf_config
from ultrascale.model.moe import MoEStats, is_moe
from ultrascale.model.moe import shard_report as moe_shard_report
from ultrascale.plan.flops import train_flops_per_token
from ultrascale.train import checkpoint
from ultrascale.train.banner import banner, document_masking, dry_run_report
from ultrascale.train.breakdown import StepBreakdown
from ultrascale.train.consistency import replicas_agree
from ultrascale.train.engine import build_engine
from ultrascale.train.loggers import MetricLogger, read_metrics
from ultrascale.train.metrics import device_peak_flops, memory_gb, throughput
from ultrascale.train.optim import apply_lr
from ultrascale.train.plot import plot_curves
from ultrascale.train.preflight import humaneval_tokenizer, preflight
from ultrascale.train.profiler import StepProfiler
from ultrascale.train.stability import (
    FaultInjector,
    StabilityMonitor,
    TrainingHealthError,
    Verdict,
    agree,
    grads_finite_norm,
)

log = logging.getLogger("ultrascale")

# Test hook: SIGKILL rank 0 at the start of this step, to prove kill-then-resume loses nothing.
FAULT_ENV = "ULTRASCALE_FAULT_AT_STEP"
# Test hook: SIGKILL rank 0 right after a rollback, before any later checkpoint could record it.
FAULT_ROLLBACK_ENV = "ULTRASCALE_FAULT_AFTER_ROLLBACK"
# Test hook: this global rank raises at its first step while its peers wait in a collective, to prove a
# failing rank brings the whole job down with a message naming it (and that no rank hangs).
RAISE_ENV = "ULTRASCALE_RAISE_ON_RANK"


def _all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    v = values.detach().float().clone()
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(v)
        v /= tdist.get_world_size()
    return v


def _prepare_run_dir(cfg: DictConfig, out: Path, ds_config: dict) -> None:
    """Rank 0 alone creates and writes the run directory; the others wait for it."""
    if dist.is_rank0():
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints").mkdir(exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        (out / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    dist.barrier()


def _truncate_metrics(path: Path, step: int) -> None:
    """After a resume, drop rows logged past the checkpoint: they will be recomputed identically.

    Rollback events stay: a rollback after the checkpoint still holds (it is recorded beside the checkpoints).
    """
    if path.exists():
        rows = [r for r in read_metrics(path) if r["step"] <= step or r.get("event") == "rollback"]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


class Trainer:
    def __init__(self, cfg: DictConfig, topo: Topology, out: Path, data_checked: bool = False):
        self.cfg = cfg
        self.data_checked = data_checked
        self.topo = topo
        self.out = out
        self.ckpt_dir = out / "checkpoints"
        self.ds_config = build_ds_config(cfg, topo)
        self.rank = dist.rank()

    # ---- setup -----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.data_path = ensure_prepared(cfg.data)
        if not self.data_checked:  # prepared just now, after the preflight
            check_prepared(cfg.data, build_hf_config(cfg.model).vocab_size)
        self.manifest = load_manifest(self.data_path)
        self.train_split = open_split(self.data_path, "train", verify=False)  # hashed by check_prepared
        self.val_split = open_split(self.data_path, "validation", verify=False)
        self.engine, self.info = build_engine(cfg, self.topo, self.ds_config)
        self.gate = self.info.gate
        # A plain torch optimizer under ZeRO-0 fp32 has no DeepSpeed wrapper to refuse a non-finite update.
        self.raw_optimizer = self.engine.optimizer is self.engine.basic_optimizer
        self.dp_rank = tdist.get_rank(self.engine.data_parallel_group) if self.topo.dp > 1 else 0
        self.pipe = self.topo.pp > 1  # engine.train_batch() runs the whole 1F1B schedule per step
        self.sp_group = sequence.sp_group() if self.topo.sp > 1 else None
        if self.sp_group is not None:  # sp ranks of one replica read the same samples
            self.dp_rank = sequence.dp_rank(self.rank, self.topo)
        self.moe = MoEStats(self.engine.module, cfg.parallel.moe) if is_moe(self.engine.module) else None
        self.doc_mask, _ = document_masking(cfg, self.topo)
        self.flat = self.doc_mask and str(cfg.model.attn_implementation).startswith("flash")
        self.eos = int(self.manifest["eos_token_id"])
        self.batches = StepBatches(
            self.train_split, cfg.data.micro_batch, cfg.data.global_batch, self.dp_rank, self.topo.dp,
            cfg.train.seed, eos_id=self.eos, document_masking=self.doc_mask,
        )  # fmt: skip
        if os.environ.get(TRACE_ENV):
            self.batches.trace_to(os.environ[TRACE_ENV], self.rank)
        self.tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
        self.flops_per_token = train_flops_per_token(self.info.hf_config, cfg.data.seq_len)
        self.peak, self.peak_src = device_peak_flops()
        self.stability = StabilityMonitor(cfg.stability)
        self.injector = FaultInjector(self.rank)
        self.breakdown = StepBreakdown(self.engine, bool(self.ds_config["wall_clock_breakdown"]), self.pipe)
        self.start_step, self.data_offset = 0, 0
        self.metrics = MetricLogger(cfg, self.out, enabled=dist.is_rank0(), ds_config=self.ds_config)
        tag_dir = checkpoint.find_resume(self.ckpt_dir, str(cfg.train.resume), cfg.train.universal_checkpoint)
        if tag_dir is not None:
            self.start_step = self._load(tag_dir, checkpoint.read_meta(tag_dir).get("world_size"))
            log.info(f"resumed from {tag_dir} at step {self.start_step} (data offset {self.data_offset})")
            if dist.is_rank0():
                self.metrics.jsonl.flush()
                _truncate_metrics(self.out / "metrics.jsonl", self.start_step)
            self.metrics.event(self.start_step, "resume", from_step=self.start_step, checkpoint=str(tag_dir))
        dist.barrier()
        self.humaneval = self._humaneval_setup()
        log.info(banner(cfg, self.topo, self.ds_config, self.info, self.tokens_per_step, self.peak_src, self.out))

    def _load(self, tag_dir: Path, saved_world: int | None) -> int:
        """Restore engine, RNG, data offset and stability state from a checkpoint; returns its step."""
        step, client = checkpoint.load(self.engine, tag_dir, same_world=saved_world == self.topo.world)
        client.update(checkpoint.rollback_since(tag_dir) or {})  # a rollback after this checkpoint was saved
        self.data_offset = int(client.get("data_offset", 0))
        self.stability.load_state(client.get("stability", {}))
        return step

    def _humaneval_setup(self):
        """The tokenizer for in-training HumanEval on rank 0 (None elsewhere or when off). Collective."""
        n = int(self.cfg.train.eval_humaneval)
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

    # ---- steps ------------------------------------------------------------------------------------
    def _pipe_inputs(self, b: Batch):
        inputs = (b.input_ids, b.position_ids) if b.position_ids is not None else b.input_ids
        return inputs, b.labels

    def train_step(self, step: int) -> tuple[dict, Verdict]:
        """One optimizer step; returns its metrics row and the (all-ranks) stability verdict."""
        engine, bd = self.engine, self.breakdown
        data_step = step + self.data_offset
        fault = self.injector.factor(step + 1)  # planted faults name steps as logged (1-based)
        bd.start()
        if self.pipe:
            t = time.perf_counter()
            self.injector.stall("slow_data", step + 1)
            micro = [self.batches.get(data_step, m) for m in range(self.batches.grad_accum)]
            bd.add("data_wait_s", time.perf_counter() - t)
            lr = apply_lr(engine.optimizer, step, self.cfg, self.stability.lr_factor(step))
            self.gate.arm(False)
            self._pipe = {"step": step, "fault": fault}  # the gate's pre_step judges the step before the update
            self.gate.pre_step = self._pipe_judge
            loss = engine.train_batch(data_iter=iter([self._pipe_inputs(b) for b in micro])).detach()
            verdict = self._pipe.get("verdict", Verdict())
            loss_mean = self._pipe.get("loss", float(loss))
            lr = self._pipe.get("lr", lr)
        else:
            losses = []
            gas = self.batches.grad_accum
            for m in range(gas):
                t = time.perf_counter()
                if m == 0:
                    self.injector.stall("slow_data", step + 1)
                batch = self.batches.get(data_step, m)
                if self.flat:
                    batch = batch.flattened()
                bd.add("data_wait_s", time.perf_counter() - t)
                loss, lm_loss = bd.forward(self._loss, batch)
                if fault is not None:
                    loss, lm_loss = loss * fault, lm_loss * fault
                losses.append(lm_loss.detach())
                last = m == gas - 1
                if last:  # judge the step before its update can be applied
                    t = time.perf_counter()
                    loss_mean = float(_all_reduce_mean(torch.stack(losses).mean().reshape(1)))
                    bd.add("comm_s", time.perf_counter() - t)
                    verdict = agree(self.stability.judge(loss_mean))
                engine.backward(loss)
                if last:
                    if verdict.action == "lr_cut":
                        self.stability.start_lr_cut(step)
                    lr = apply_lr(engine.optimizer, step, self.cfg, self.stability.lr_factor(step))
                    skip = verdict.bad
                    if self.raw_optimizer and not skip:  # ZeRO-0 fp32: nothing else checks the gradients
                        norm = grads_finite_norm(self.engine.module.parameters())
                        skip = not math.isfinite(norm)
                        if skip:
                            verdict = self.stability.nonfinite_grad()
                    self.gate.arm(skip)
                engine.step()
                bd.after_micro_step()
        applied = engine.was_step_applied() and not self.gate.vetoed
        if not applied and not verdict.bad:  # DeepSpeed refused a non-finite gradient norm on every rank
            verdict = self.stability.nonfinite_grad()
        gn = engine.get_global_grad_norm()
        row = {
            "loss": loss_mean,
            "lr": lr,
            "grad_norm": float(gn) if gn is not None else None,
            **bd.finish(),
            "mem_gb": memory_gb(),
            "epoch": self.batches.epoch(data_step + 1),
            **(self.moe.flush() if self.moe else {}),
        }
        row.update(throughput(self.tokens_per_step, row["step_s"], self.flops_per_token, self.topo.world, self.peak))
        return row, verdict

    def _pipe_judge(self) -> bool:
        """Inside the pipeline's optimizer step, on every rank: the step's loss from the last stages, judged.

        Only last-stage ranks hold the loss (``engine.total_loss``, summed over micro-batches); one world
        all-reduce of (sum, count) gives every stage the mean. Returns True to veto this update.
        """
        engine, p = self.engine, self._pipe
        t = time.perf_counter()
        last = engine.is_last_stage() and engine.total_loss is not None
        local = float(engine.total_loss) / self.batches.grad_accum if last else 0.0
        if p["fault"] is not None and (last or math.isnan(p["fault"])):
            local *= p["fault"]
        totals = torch.tensor([local, float(last)], dtype=torch.float64)
        if tdist.is_initialized():
            tdist.all_reduce(totals)
        p["loss"] = float(totals[0] / totals[1])
        verdict = agree(self.stability.judge(p["loss"]))
        if verdict.action == "lr_cut":
            self.stability.start_lr_cut(p["step"])
            p["lr"] = apply_lr(engine.optimizer, p["step"], self.cfg, self.stability.lr_factor(p["step"]))
        p["verdict"] = verdict
        self.breakdown.add("comm_s", time.perf_counter() - t)
        return verdict.bad

    def _loss(self, batch: Batch, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, LM loss to log) for one micro-batch (non-pipeline path)."""
        if self.sp_group is not None:
            return sequence.sp_loss(self.engine, batch, self.sp_group, self.topo.sp)
        out = self.engine(**batch.model_inputs())
        if self.moe is not None:
            return out.loss, self.moe.observe(out, record=train)
        return out.loss, out.loss

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """Held-out loss over every rank's share of the validation split (token-weighted), plus HumanEval."""
        t0 = time.perf_counter()
        self.engine.eval()
        total = torch.zeros(2, dtype=torch.float64)  # sum of per-token losses, number of targets
        with _eager(self.cfg):
            for b in eval_batches(self.val_split, self.cfg.data.micro_batch, self.cfg.data.eval_batches,
                                  self.dp_rank, self.topo.dp, self.eos, self.doc_mask):  # fmt: skip
                if self.pipe:
                    loss = self.engine.eval_batch(iter([self._pipe_inputs(b)]), num_micro_batches=1)
                else:
                    loss = self._loss(b.flattened() if self.flat else b, train=False)[1]
                total += torch.tensor([float(loss) * b.num_targets, b.num_targets], dtype=torch.float64)
        self.engine.train()
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            tdist.all_reduce(total)
        loss = float(total[0] / total[1]) if total[1] else float("nan")
        result = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
        if int(self.cfg.train.eval_humaneval):
            result.update(self._eval_humaneval(step))
        self.breakdown.reset_engine_timers()
        result["eval_s"] = time.perf_counter() - t0
        return result

    def _eval_humaneval(self, step: int) -> dict:
        """Greedy pass@1 on the first train.eval_humaneval problems, generated on rank 0; others wait.

        Every completion and how it ended in the sandbox goes to ``humaneval/step_XXXXXXXX.jsonl``: what the
        model wrote at that step is worth more than the number.
        """
        score = None
        if self.humaneval is not None:
            from ultrascale.eval.humaneval import evaluate

            model = self.engine.module
            use_cache, model.config.use_cache = model.config.use_cache, True  # generation wants its KV cache
            try:
                with _eager(self.cfg):
                    res = evaluate(
                        model, self.humaneval, limit=int(self.cfg.train.eval_humaneval),
                        max_new_tokens=int(self.cfg.train.eval_humaneval_max_new_tokens),
                    )  # fmt: skip
                score = res["pass@1"]
                samples = self.out / "humaneval" / f"{checkpoint.tag_for(step)}.jsonl"
                samples.parent.mkdir(exist_ok=True)
                atomic_write_text(samples, "".join(json.dumps(r) + "\n" for r in res["samples"]))
            finally:
                model.config.use_cache = use_cache
                model.train()
        score = dist.broadcast_object(score)
        return {"humaneval_pass@1": score, "humaneval_problems": int(self.cfg.train.eval_humaneval)}

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        meta = {
            "world_size": self.topo.world,
            "topology": self.topo.as_dict(),
            "precision": self.cfg.precision.dtype,
            "zero_stage": int(self.cfg.zero.stage),
            "data_offset": self.data_offset,
        }
        client = {"data_offset": self.data_offset, "stability": self.stability.state()}
        self.injector.stall("slow_ckpt", step)
        checkpoint.save(self.engine, self.ckpt_dir, step, meta, keep=self.cfg.train.keep_checkpoints, client=client)
        secs = time.perf_counter() - t0
        log.info(f"checkpoint {checkpoint.tag_for(step)} saved in {secs:.1f}s")
        self.metrics.event(step, "checkpoint", checkpoint_s=secs, console=False)

    def _rollback(self, step: int, verdict: Verdict) -> int:
        """Reload the newest checkpoint and skip the data window from it through the bad step; returns its step."""
        latest = self.ckpt_dir / checkpoint.LATEST
        if not latest.exists():
            raise TrainingHealthError(
                f"stability: {verdict.reason} at step {step} calls for a rollback but no checkpoint exists yet: "
                f"set train.checkpoint_interval below {step + 1} or use stability.{verdict.reason}=skip"
            )
        tag_dir = self.ckpt_dir / latest.read_text().strip()
        old_offset, counters = self.data_offset, self.stability.state()
        to_step = self._load(tag_dir, self.topo.world)
        self.stability.load_state(counters)  # the checkpoint's counters predate this rollback
        self.data_offset = old_offset + step + 1 - to_step  # step `to_step` now reads what step+1 would have
        if dist.is_rank0():  # durable now: a crash before the next checkpoint must not re-read the window
            checkpoint.record_rollback(self.ckpt_dir, tag_dir, {"data_offset": self.data_offset,
                                                                "stability": self.stability.state()})  # fmt: skip
        self.metrics.event(
            step + 1, "rollback", reason=verdict.reason, to_step=to_step, zscore=verdict.zscore,
            skip_from=to_step + old_offset, skip_to=step + 1 + old_offset,
        )  # fmt: skip
        return to_step

    # ---- loop -------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, steps = self.cfg.train, int(self.cfg.train.steps)
        fault = int(os.environ.get(FAULT_ENV, -1))
        raise_on = int(os.environ.get(RAISE_ENV, -1))
        last: dict = {}
        bar = None
        if dist.is_rank0() and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True)
        tps = []
        t_first = None  # wall clock after the first step: the loop's true rate includes logging and evals
        steps_run = 0
        step = self.start_step
        profiler = StepProfiler(self.out, self.rank, cfg.profile_start, cfg.profile_steps, self.start_step)
        while step < steps:
            if step == fault and dist.is_rank0():
                os.kill(os.getpid(), signal.SIGKILL)
            if step == self.start_step and self.rank == raise_on:
                raise RuntimeError(f"injected failure on rank {self.rank} at step {step} ({RAISE_ENV}={raise_on})")
            if steps_run == 0 and cfg.compile:
                t_compile = time.perf_counter()
            profiler.before(steps_run)
            last, verdict = self.train_step(step)
            profiler.after(steps_run)
            self.injector.fired(step + 1)
            done = step + 1
            if steps_run == 0 and cfg.compile:
                log.info(f"compile: first step (compile included) took {time.perf_counter() - t_compile:.1f}s")
            steps_run += 1
            if steps_run > 1:  # the first step includes one-off warm-up costs
                tps.append(last["tokens_per_s"])
            if done % cfg.log_interval == 0 or done == steps or verdict.action != "ok":
                self.metrics.log(done, last)
            self._report_verdict(done, verdict, last)
            self.stability.record(verdict, last["loss"], done)
            if verdict.action == "rollback":
                step = self._rollback(step, verdict)
                if os.environ.get(FAULT_ROLLBACK_ENV) and dist.is_rank0():
                    os.kill(os.getpid(), signal.SIGKILL)
                continue
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}")
            if cfg.eval_interval and done % cfg.eval_interval == 0 and done != steps:
                self.metrics.event(done, "eval", **self.evaluate(done))
            if cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0 and done != steps:
                self.save(done)
            if t_first is None:
                t_first = time.perf_counter()
            step = done
        t_loop = time.perf_counter() - t_first if t_first else 0.0
        profiler.close(steps_run)
        if bar:
            bar.close()
        summary = {"steps": steps, "resumed_from": self.start_step, "world_size": self.topo.world,
                   "topology": self.topo.as_dict()}  # fmt: skip
        agree_, digests = replicas_agree(self.engine.module, int(self.cfg.zero.stage), self.engine.data_parallel_group)
        summary.update(replicas_agree=agree_, param_digests=digests)
        if not agree_:
            log.warning(f"data-parallel replicas hold different parameters: {digests}")
        if self.moe is not None:  # expert shards differ by design; the rest must agree
            summary.update(moe_shard_report(self.engine.module, self.engine.data_parallel_group))
        summary.update(self.stability.counters(), data_offset=self.data_offset)
        if self.start_step < steps:
            ev = self.evaluate(steps)
            self.metrics.event(steps, "eval", **ev)
            self.save(steps)
            summary.update(
                final_loss=last["loss"],
                eval_loss=ev["eval_loss"],
                eval_ppl=ev["eval_ppl"],
                tokens_per_s=sum(tps) / len(tps) if tps else last["tokens_per_s"],
                wall_tokens_per_s=self.tokens_per_step * (steps_run - 1) / t_loop if t_loop else None,
                mfu=last["mfu"],
                mem_gb=last["mem_gb"],
            )
        return summary

    def _report_verdict(self, done: int, verdict: Verdict, row: dict) -> None:
        if verdict.action in ("ok", "rollback"):  # a rollback is logged once it has happened
            return
        fields = {"reason": verdict.reason, "loss": row["loss"], "zscore": verdict.zscore,
                  "grad_norm": row["grad_norm"]}  # fmt: skip
        if verdict.action == "lr_cut":
            fields.update(factor=float(self.cfg.stability.lr_cut_factor), until_step=self.stability.lr_cut_until + 1)
        self.metrics.event(done, verdict.action, **fields)

    def close(self) -> None:
        """Release the engine now: ZeRO-3's gradient hooks form a cycle through C++ autograd nodes that the
        garbage collector cannot see, which would keep the engine and its process groups alive until exit."""
        self.engine.destroy()
        self.engine = self.gate = None

    def finish(self, summary: dict) -> None:
        if not dist.is_rank0():
            return
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.metrics.summary(summary)
        plot = None
        if self.cfg.logger.plot:
            plot = plot_curves(read_metrics(self.out / "metrics.jsonl"), self.out / "curves.png", title=self.out.name)
        report = _write_report(self.out)
        wandb_dir = self.metrics.close()
        lines = [f"done: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})}"]
        lines.append(f"  run dir     {self.out}")
        lines.append(f"  metrics     {self.out / 'metrics.jsonl'}" + (f"  plot {plot}" if plot else ""))
        if report:
            lines.append(f"  report      {report}  (python -m ultrascale.report run_dir={self.out})")
        lines.append(f"  checkpoint  {self.ckpt_dir / (self.ckpt_dir / 'latest').read_text().strip()}")
        if self.cfg.logger.tensorboard:
            lines.append(f"  tensorboard tensorboard --logdir {self.out / 'tensorboard'}")
        if wandb_dir:
            lines.append(f"  wandb       {Path(wandb_dir).parent}  (wandb sync {Path(wandb_dir).parent})")
        log.info("\n".join(lines))


def _eager(cfg: DictConfig):
    """Evaluation and generation run eagerly: their shapes differ from training's and would recompile."""
    return torch.compiler.set_stance("force_eager") if cfg.train.compile else contextlib.nullcontext()


def _write_report(out: Path) -> Path | None:
    """The comb report (report.md + report.png); a failure to draw it never fails a finished run."""
    try:
        from ultrascale.report import write_report

        md, _ = write_report([out])
        return md
    except Exception as e:
        log.warning(f"report not written: {type(e).__name__}: {e}")
        return None


def run(cfg: DictConfig, topo: Topology) -> dict | None:
    """Train (or dry-run) with an already-validated config. Collective: every rank calls it."""
    out = resolve_path(cfg.output_dir)
    found = preflight(cfg)  # read-only, on every rank: nothing is written for a run that cannot start
    if cfg.dry_run:
        if dist.is_rank0():
            print(dry_run_report(cfg, topo, build_ds_config(cfg, topo), found.notes))
        return None
    dist.init_distributed()
    trainer = Trainer(cfg, topo, out, data_checked=found.data_checked)
    _prepare_run_dir(cfg, out, trainer.ds_config)
    dist.setup_logging(str(out / "logs" / f"rank{dist.rank():05d}.log"))
    trainer.setup()
    summary = trainer.fit()
    trainer.finish(summary)
    trainer.close()
    return summary
