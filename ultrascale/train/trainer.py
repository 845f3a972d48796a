"""The training loop: data -> engine steps -> metrics, evals and atomic checkpoints, with auto-resume."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist
from omegaconf import DictConfig, OmegaConf

from ultrascale import dist
from ultrascale.config.compose import resolve_path
from ultrascale.config.deepspeed import build_ds_config
from ultrascale.config.topology import Topology
from ultrascale.data.loader import StepBatches, eval_batches
from ultrascale.data.prepare import ensure_prepared
from ultrascale.data.shards import load_manifest, open_split
from ultrascale.errors import DataError
from ultrascale.model import sequence
from ultrascale.model.build import build_hf_config
from ultrascale.model.moe import MoEStats, is_moe
from ultrascale.model.moe import shard_report as moe_shard_report
from ultrascale.plan.flops import train_flops_per_token
from ultrascale.train import checkpoint
from ultrascale.train.banner import banner, dry_run_report
from ultrascale.train.consistency import replicas_agree
from ultrascale.train.engine import build_engine
from ultrascale.train.loggers import MetricLogger, read_metrics
from ultrascale.train.metrics import StepTimer, device_peak_flops, memory_gb, throughput
from ultrascale.train.plot import plot_curves

log = logging.getLogger("ultrascale")

# Test hook: SIGKILL rank 0 at the start of this step, to prove kill-then-resume loses nothing.
FAULT_ENV = "ULTRASCALE_FAULT_AT_STEP"
# Test hook: this global rank raises at its first step while its peers wait in a collective, to prove a
# failing rank brings the whole job down with a message naming it (and that no rank hangs).
RAISE_ENV = "ULTRASCALE_RAISE_ON_RANK"


def _mean_across_ranks(value: torch.Tensor) -> float:
    v = value.detach().float().reshape(1).clone()
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(v)
        v /= tdist.get_world_size()
    return float(v.item())


def _prepare_run_dir(cfg: DictConfig, out: Path, ds_config: dict) -> None:
    """Rank 0 alone creates and writes the run directory; the others wait for it."""
    if dist.is_rank0():
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints").mkdir(exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        (out / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    dist.barrier()


def _truncate_metrics(path: Path, step: int) -> None:
    """After a resume, drop rows logged past the checkpoint: they will be recomputed identically."""
    if path.exists():
        rows = [r for r in read_metrics(path) if r["step"] <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


class Trainer:
    def __init__(self, cfg: DictConfig, topo: Topology, out: Path):
        self.cfg = cfg
        self.topo = topo
        self.out = out
        self.ckpt_dir = out / "checkpoints"
        self.ds_config = build_ds_config(cfg, topo)
        self.rank = dist.rank()

    # ---- setup -----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        data_path = ensure_prepared(cfg.data)
        self.train_split = open_split(data_path, "train", verify=cfg.data.verify_checksums)
        self.val_split = open_split(data_path, "validation", verify=cfg.data.verify_checksums)
        if self.train_split.seq_len != cfg.data.seq_len:
            raise DataError(
                f"data.seq_len={cfg.data.seq_len} but {data_path} was packed with seq_len={self.train_split.seq_len}: "
                f"set data.seq_len={self.train_split.seq_len} or re-run data prep"
            )
        data_vocab, model_vocab = int(load_manifest(data_path)["vocab_size"]), build_hf_config(cfg.model).vocab_size
        if data_vocab > model_vocab:  # token ids past the embedding table would crash deep inside the forward
            raise DataError(
                f"{data_path} was tokenized with {data_vocab} tokens but model.config.vocab_size={model_vocab}: "
                f"set model.config.vocab_size={data_vocab} (or larger) or prepare the data with a smaller tokenizer"
            )
        self.engine, self.info = build_engine(cfg, self.topo, self.ds_config)
        self.dp_rank = tdist.get_rank(self.engine.data_parallel_group) if self.topo.dp > 1 else 0
        self.pipe = self.topo.pp > 1  # engine.train_batch() runs the whole 1F1B schedule per step
        self.sp_group = sequence.sp_group() if self.topo.sp > 1 else None
        if self.sp_group is not None:  # sp ranks of one replica read the same samples
            self.dp_rank = sequence.dp_rank(self.rank, self.topo)
        self.moe = MoEStats(self.engine.module, cfg.parallel.moe) if is_moe(self.engine.module) else None
        self.batches = StepBatches(
            self.train_split, cfg.data.micro_batch, cfg.data.global_batch, self.dp_rank, self.topo.dp, cfg.train.seed
        )
        self.tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
        self.flops_per_token = train_flops_per_token(self.info.hf_config, cfg.data.seq_len)
        self.peak, self.peak_src = device_peak_flops()
        self.start_step = 0
        tag_dir = checkpoint.find_resume(self.ckpt_dir, str(cfg.train.resume), cfg.train.universal_checkpoint)
        if tag_dir is not None:
            meta = json.loads((checkpoint._meta_dir(tag_dir) / checkpoint.META).read_text())
            self.start_step = checkpoint.load(
                self.engine, tag_dir, same_world=meta.get("world_size") == self.topo.world
            )
            if dist.is_rank0():
                _truncate_metrics(self.out / "metrics.jsonl", self.start_step)
            log.info(f"resumed from {tag_dir} at step {self.start_step}")
        dist.barrier()
        self.metrics = MetricLogger(cfg, self.out, enabled=dist.is_rank0())
        log.info(banner(cfg, self.topo, self.ds_config, self.info, self.tokens_per_step, self.peak_src, self.out))

    # ---- steps ------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        engine, timer = self.engine, StepTimer()
        lr = engine.get_lr()[0]
        losses = []
        if self.pipe:
            with timer.data():
                micro = [self.batches.get(step, m) for m in range(self.batches.grad_accum)]
            losses.append(engine.train_batch(data_iter=iter([(ids, ids) for ids in micro])).detach())
        for micro in range(0 if self.pipe else self.batches.grad_accum):
            with timer.data():
                ids = self.batches.get(step, micro)
            loss, lm_loss = self._loss(ids)
            engine.backward(loss)
            engine.step()
            losses.append(lm_loss.detach())
        step_s, data_wait = timer.finish()
        gn = engine.get_global_grad_norm()
        return {
            "loss": _mean_across_ranks(torch.stack(losses).mean()),
            "lr": lr,
            "grad_norm": float(gn) if gn is not None else None,
            "step_time": step_s,
            "data_wait": data_wait,
            **throughput(self.tokens_per_step, step_s, self.flops_per_token, self.topo.world, self.peak),
            "mem_gb": memory_gb(),
            "epoch": self.batches.epoch(step + 1),
            **(self.moe.flush() if self.moe else {}),
        }

    def _loss(self, ids: torch.Tensor, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, LM loss to log) for one micro-batch (non-pipeline path)."""
        if self.sp_group is not None:
            return sequence.sp_loss(self.engine, ids, self.sp_group, self.topo.sp)
        out = self.engine(input_ids=ids, labels=ids)
        if self.moe is not None:
            return out.loss, self.moe.observe(out, record=train)
        return out.loss, out.loss

    @torch.no_grad()
    def evaluate(self) -> float:
        self.engine.eval()
        total, n = torch.zeros(1), torch.zeros(1)
        for ids in eval_batches(
            self.val_split, self.cfg.data.micro_batch, self.cfg.data.eval_batches, self.dp_rank, self.topo.dp
        ):
            if self.pipe:
                loss = self.engine.eval_batch(iter([(ids, ids)]), num_micro_batches=1)
            else:
                loss = self._loss(ids, train=False)[1]
            total += loss.float().cpu()
            n += 1
        self.engine.train()
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            tdist.all_reduce(total)
            tdist.all_reduce(n)
        return float(total / n) if n.item() else float("nan")

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        meta = {
            "world_size": self.topo.world,
            "topology": self.topo.as_dict(),
            "precision": self.cfg.precision.dtype,
            "zero_stage": int(self.cfg.zero.stage),
        }
        checkpoint.save(self.engine, self.ckpt_dir, step, meta, keep=self.cfg.train.keep_checkpoints)
        secs = time.perf_counter() - t0
        log.info(f"checkpoint {checkpoint.tag_for(step)} saved in {secs:.1f}s")
        self.metrics.log(step, {"checkpoint_s": secs}, console=False)

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
        for step in range(self.start_step, steps):
            if step == fault and dist.is_rank0():
                os.kill(os.getpid(), signal.SIGKILL)
            if step == self.start_step and self.rank == raise_on:
                raise RuntimeError(f"injected failure on rank {self.rank} at step {step} ({RAISE_ENV}={raise_on})")
            last = self.train_step(step)
            done = step + 1
            if done > self.start_step + 1:  # the first step includes one-off warm-up costs
                tps.append(last["tokens_per_s"])
            if cfg.eval_interval and done % cfg.eval_interval == 0 and done != steps:
                last["eval_loss"] = self.evaluate()
            if done % cfg.log_interval == 0 or done == steps or "eval_loss" in last:
                self.metrics.log(done, last)
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}")
            if cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0 and done != steps:
                self.save(done)
            if t_first is None:
                t_first = time.perf_counter()
        t_loop = time.perf_counter() - t_first if t_first else 0.0
        if bar:
            bar.close()
        summary = {"steps": steps, "resumed_from": self.start_step}
        agree, digests = replicas_agree(self.engine.module, int(self.cfg.zero.stage), self.engine.data_parallel_group)
        summary.update(replicas_agree=agree, param_digests=digests)
        if not agree:
            log.warning(f"data-parallel replicas hold different parameters: {digests}")
        if self.moe is not None:  # expert shards differ by design; the rest must agree
            summary.update(moe_shard_report(self.engine.module, self.engine.data_parallel_group))
        if self.start_step < steps:
            eval_loss = self.evaluate()
            self.metrics.log(steps, {"eval_loss": eval_loss})
            self.save(steps)
            summary.update(
                final_loss=last["loss"],
                eval_loss=eval_loss,
                tokens_per_s=sum(tps) / len(tps) if tps else last["tokens_per_s"],
                wall_tokens_per_s=self.tokens_per_step * (steps - self.start_step - 1) / t_loop if t_loop else None,
                mfu=last["mfu"],
                mem_gb=last["mem_gb"],
            )
        return summary

    def finish(self, summary: dict) -> None:
        if not dist.is_rank0():
            return
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.metrics.summary(summary)
        plot = None
        if self.cfg.logger.plot:
            plot = plot_curves(read_metrics(self.out / "metrics.jsonl"), self.out / "curves.png", title=self.out.name)
        wandb_dir = self.metrics.close()
        lines = [f"done: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})}"]
        lines.append(f"  run dir     {self.out}")
        lines.append(f"  metrics     {self.out / 'metrics.jsonl'}" + (f"  plot {plot}" if plot else ""))
        lines.append(f"  checkpoint  {self.ckpt_dir / (self.ckpt_dir / 'latest').read_text().strip()}")
        if self.cfg.logger.tensorboard:
            lines.append(f"  tensorboard tensorboard --logdir {self.out / 'tensorboard'}")
        if wandb_dir:
            lines.append(f"  wandb       {Path(wandb_dir).parent}  (wandb sync {Path(wandb_dir).parent})")
        log.info("\n".join(lines))


def run(cfg: DictConfig, topo: Topology) -> dict | None:
    """Train (or dry-run) with an already-validated config. Collective: every rank calls it."""
    out = resolve_path(cfg.output_dir)
    if cfg.dry_run:
        if dist.is_rank0():
            print(dry_run_report(cfg, topo, build_ds_config(cfg, topo)))
        return None
    dist.init_distributed()
    trainer = Trainer(cfg, topo, out)
    _prepare_run_dir(cfg, out, trainer.ds_config)
    dist.setup_logging(str(out / "logs" / f"rank{dist.rank():05d}.log"))
    trainer.setup()
    summary = trainer.fit()
    trainer.finish(summary)
    return summary
