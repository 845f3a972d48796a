"""The trainer with problems for data: :class:`GRPOTrainer` is :class:`~ultrascale.train.trainer.Trainer` whose
data is a pool of problems read in a seeded, step-addressed order and whose step is :class:`GRPOStep`.

Everything else is the trainer's own: the engine under any ZeRO stage (with LoRA), checkpoints with the data
position (here: the problems drawn) and RNG, resume at a step boundary, the stop protocol (Ctrl-C saves and
stops), rollbacks, metrics to ``metrics.jsonl``, wandb and TensorBoard, the comb report. Each step's completions
are written to ``rollouts/step_NNNNNNNN.jsonl``.
"""

from __future__ import annotations

import logging

from ultrascale.jsonio import write_jsonl
from ultrascale.model.flops import train_flops_per_token
from ultrascale.runtime import dist
from ultrascale.train.checkpoint import tag_for
from ultrascale.train.grpo.rollout import ProblemOrder
from ultrascale.train.grpo.step import GRPOStep
from ultrascale.train.metrics import peak_flops, throughput
from ultrascale.train.step import OptimizerStep, StepState
from ultrascale.train.trainer import Trainer

log = logging.getLogger("ultrascale")

ROLLOUTS = "rollouts"


class _Problems:
    """Stands where a pretraining run's mixture stands: one source (the problem pool), no lr factor, its cursor."""

    names = ("problems",)

    def __init__(self, order: ProblemOrder) -> None:
        self.order = order

    def lr_factor(self, step: int, steps: int) -> float:
        return 1.0

    def cursors(self, data_step: int) -> list[int]:
        return [self.order.cursor(data_step)]


class _Batches:
    """What the stepper and the loop read of the batches: micro-steps per optimizer step and the epoch."""

    def __init__(self, grad_accum: int, order: ProblemOrder) -> None:
        self.grad_accum, self.order = grad_accum, order

    def epoch(self, data_step: int) -> float:
        return self.order.epoch(data_step)


class GRPOTrainer(Trainer):
    def _open_data(self) -> None:
        """The tokenizer (the pretrained model's) and the problem pool, built on rank 0 and broadcast (mining
        runs references in the sandbox: once, not once per rank)."""
        from transformers import AutoTokenizer

        from ultrascale.eval.problems import build

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.pretrained_path)
        pool = build(self.cfg.problems) if dist.is_rank0() else None
        self.problems, self.pool_report = dist.broadcast_object(pool)
        if dist.is_rank0():
            log.info(f"grpo: {len(self.problems)} problems ({self.pool_report})")
        self.data_path, self.manifest = None, None
        self.train_splits, self.val_splits = {}, {}
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos

    def _build_data(self) -> None:
        cfg, g = self.cfg, self.cfg.grpo
        self.order = ProblemOrder(len(self.problems), g.prompts_per_step, self.topo.dp, cfg.train.seed)
        self.mixture, self.mixed = _Problems(self.order), False
        local = g.prompts_per_step // self.topo.dp * g.num_generations
        self.batches = _Batches(-(-local // cfg.data.micro_batch), self.order)
        self.tokens_per_step = g.prompts_per_step * g.num_generations * g.max_completion_length
        self.flops_per_token = train_flops_per_token(self.decisions.hf_config, cfg.data.seq_len, causal=True)
        self.peak, self.peak_src = peak_flops(str(cfg.precision.dtype), self.decisions.autocast.on, self.decisions.gpu)
        self.reference = None
        if g.beta > 0 and not self.decisions.finetune.on:  # full fine-tuning: a frozen copy of the start
            from ultrascale.train.engine import build_reference

            self.reference, how = build_reference(cfg, self.decisions, self.ds_config, self.engine.module)
            log.info(f"grpo: reference for the KL: {how}")
        self.grpo = GRPOStep(self)
        self.judger = OptimizerStep(self)

    def stepper_judge(self, st: StepState, loss: float) -> None:
        """The pretraining step's judgement (stability verdict, stop, written checkpoint, lr) on the step's loss."""
        self.judger.judge(st, loss)

    def data_cursors(self, data_step: int) -> dict[str, int]:
        return {"problems": self.order.cursor(data_step)}

    def train_step(self, step: int) -> tuple[dict, StepState]:
        st = StepState(step, self.injector.factor(step + 1))
        self.breakdown.start()
        self.grpo.run(st)
        applied = self.engine.was_step_applied() and not self.gate.vetoed
        if not applied and not st.verdict.bad:
            st.verdict = self.stability.nonfinite_grad()
        logged = self._logs(step + 1, st.verdict)
        gn = self.engine.get_global_grad_norm() if logged else None
        data_step = step + self.data_offset + 1
        row = {"loss": st.loss, "lr": st.lr, "grad_norm": float(gn) if gn is not None else None,
               **self.breakdown.finish(read=logged), "mem_gb": self.memory.peak_gb() if logged else None,
               "epoch": self.batches.epoch(data_step), **self.grpo.row}  # fmt: skip
        # tokens/s: the step's sampled tokens over its wall time (what the step produced and trained on)
        row.update(throughput(self.grpo.row["generated_tokens"], row["step_s"], self.flops_per_token,
                              self.topo.world, self.peak))  # fmt: skip
        self._write_rollouts(step + 1)
        return row, st

    def _write_rollouts(self, done: int) -> None:
        """Rank 0: the step's completions, every rank's, one line each (a rerun of the step rewrites the file)."""
        if not (dist.is_rank0() and self.cfg.grpo.log_completions):
            return
        path = self.out / ROLLOUTS / f"{tag_for(done)}.jsonl"
        path.parent.mkdir(exist_ok=True)
        write_jsonl(path, [{**r, "step": done} for r in self.grpo.records])

    def grpo_summary(self, end_step: int) -> dict:
        """The summary's GRPO lines: the pool, and the problems drawn by the step the run ended at."""
        return {
            "problems": len(self.problems),
            "problem_pool": self.pool_report,
            "problems_drawn": self.order.cursor(end_step + self.data_offset),
        }
