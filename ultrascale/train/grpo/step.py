"""One GRPO optimizer step on the trainer's engine: sample, score, normalise, and the clipped policy gradient over
the sampled ids, with every phase timed as a part of the step (``gen_s``, ``reward_s``, ``sync_s`` beside the
forward, backward and optimizer of a pretraining step).

Each rank samples whole groups (its ``prompts_per_step / dp`` problems x ``num_generations``), so a group's
normalisation is local; the rewards are all-gathered anyway, for ``scale_rewards=batch``, the logged statistics and
the rollout record. The step's loss is judged by the stability policy as a pretraining loss is (one all-gather that
also carries a stop and the newest written checkpoint), then applied or vetoed at the optimizer.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as tdist

from ultrascale.runtime.device import coll_tensor
from ultrascale.runtime.dist import world_size
from ultrascale.train.grpo import rewards as R
from ultrascale.train.grpo.batch import Packed, completion_logps, pack
from ultrascale.train.grpo.loss import Objective, TokenTerms, advantages, micro_loss
from ultrascale.train.grpo.rollout import Replica, Sample, generation_model, sample
from ultrascale.train.step import StepState


def _all_gather_floats(values: list[float]) -> list[float]:
    """Every rank's values (equal counts), rank order."""
    local = coll_tensor(values, torch.float64)
    if world_size() == 1:
        return local.tolist()
    out = [torch.zeros_like(local) for _ in range(world_size())]
    tdist.all_gather(out, local)
    return torch.cat(out).tolist()


def _sum(values: list[float]) -> list[float]:
    t = coll_tensor(values, torch.float64)
    if world_size() > 1:
        tdist.all_reduce(t)
    return t.tolist()


class GRPOStep:
    """The trainer's stepper for ``grpo``: :meth:`run` fills the :class:`StepState` and leaves the step's statistics
    in ``self.row`` for the metrics row."""

    def __init__(self, trainer: Any) -> None:
        self.t = trainer
        g = trainer.cfg.grpo
        self.g = g
        self.obj = Objective(g.loss_type, g.epsilon, g.clip_high, g.beta, g.max_completion_length,
                             g.use_bias_correction_kl)  # fmt: skip
        self.fns = R.load(g.reward_funcs, g)
        self.names = [R.metric_name(n) for n in g.reward_funcs]
        self.weights = list(g.reward_weights) if g.reward_weights is not None else [1.0] * len(self.fns)
        self.replica: Replica | None = None
        self.row: dict = {}
        self.records: list[dict] = []

    # ---- the phases -------------------------------------------------------------------------------------------
    def _generate(self, st: StepState, data_step: int) -> list[Sample]:
        t, bd = self.t, self.t.breakdown
        module = t.engine.module
        t0 = time.perf_counter()
        if t.decisions.zero_stage == 3:  # the partitions gathered once per step into the sampler's replica
            if self.replica is None:
                self.replica = Replica(module, layerwise=t.decisions.rollout_weights.value == "layer")
            else:
                self.replica.sync(module)
            model = self.replica.model
        else:
            model = generation_model(module)
        bd.add("sync_s", time.perf_counter() - t0)
        t0 = time.perf_counter()
        problems = [(grp, t.problems[i]) for grp, i in t.order.local(data_step, t.dp_rank)]
        seed = (t.cfg.train.seed * 1_000_003 + data_step) * 4099 + t.dp_rank
        try:
            samples, stats = sample(model, t.tokenizer, problems, self.g, seed)
        finally:
            module.train()
        bd.add("gen_s", time.perf_counter() - t0)
        self.gen_tokens = stats.tokens
        return samples

    def _score(self, samples: list[Sample]) -> tuple[list[float], list[list[float]], dict]:
        t0 = time.perf_counter()
        prompts = [s.problem["prompt"] for s in samples]
        completions = [s.completion for s in samples]
        columns = {"task_id": [s.problem["task_id"] for s in samples], "tests": [s.problem["tests"] for s in samples],
                   "entry_point": [s.problem["entry_point"] for s in samples],
                   "completion_ids": [s.ids for s in samples]}  # fmt: skip
        rewards, per_fn, counts = R.score(self.fns, self.weights, prompts, completions, columns)
        self.t.breakdown.add("reward_s", time.perf_counter() - t0)
        return rewards, per_fn, dict(counts)

    # ---- the step ------------------------------------------------------------------------------------------
    def run(self, st: StepState) -> None:
        t, g = self.t, self.g
        data_step = st.step + t.data_offset
        t.injector.stall("slow_data", st.step + 1)
        samples = self._generate(st, data_step)
        rewards, per_fn, counts = self._score(samples)
        n_local, world = len(samples), world_size()
        # every rank's rewards: the groups are local, the batch std, the statistics and the record are not
        all_rewards = torch.tensor(_all_gather_floats(rewards), dtype=torch.float32)
        adv_all, zero_std = advantages(all_rewards, g.num_generations, g.scale_rewards)
        rank = t.dp_rank
        adv = adv_all[rank * n_local : (rank + 1) * n_local]
        keep = [0.0 if (g.mask_truncated_completions and s.truncated) else 1.0 for s in samples]
        lengths = [len(s.ids) for s in samples]
        total_tokens = _sum([sum(n * k for n, k in zip(lengths, keep))])[0]
        total_rows = n_local * world

        old = ref = None
        micro = t.cfg.data.micro_batch
        chunks = [list(range(i, min(i + micro, n_local))) for i in range(0, n_local, micro)]
        packs = [pack([samples[i].prompt_ids for i in c], [samples[i].ids for i in c], t.pad).to(t.device)
                 for c in chunks]  # fmt: skip
        if g.num_iterations > 1:  # the policy that sampled, recomputed as the clip's anchor (TRL's old log-probs)
            old = [self._logps(p, grad=False)[0] for p in packs]
        if g.beta > 0:
            ref = [self._ref_logps(p) for p in packs]
        scale = t.batches.grad_accum * t.topo.dp  # DeepSpeed means over micro-steps and ranks; ours is a sum
        sums = {"loss": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "clip_region": 0.0, "entropy": 0.0}
        gap = 0.0  # the sampler's log-probs against the training forward's, same tokens (train/inference mismatch)
        updates = t.engine.global_steps
        for it in range(g.num_iterations):
            for m, (c, p) in enumerate(zip(chunks, packs)):
                logps, entropy = self._logps(p, grad=True)
                mask = torch.tensor([keep[i] for i in c], device=t.device)[p.rows]
                terms = TokenTerms(logps, old[m] if old else logps.detach(), adv[c].to(t.device), p.rows, mask,
                                   ref[m] if ref else None)  # fmt: skip
                loss, stats = micro_loss(terms, self.obj, len(c), total_rows, total_tokens)
                if st.fault is not None:
                    loss = loss * st.fault
                # the statistics average over the iterations, as TRL logs them (at the first the ratio is 1)
                sums["entropy"] += float((entropy * mask).sum()) / g.num_iterations
                for k, v in stats.items():
                    sums[k] += float(v) / g.num_iterations
                if it == 0:
                    sampled = torch.tensor([lp for i in c for lp in samples[i].logps], device=t.device)
                    gap = max(gap, float((logps.detach() - sampled).abs().max()))
                    sums["loss"] += float(loss.detach())
                last = m == len(chunks) - 1
                if last:
                    if it == 0:
                        t0 = time.perf_counter()
                        summed = _sum([sums["loss"]])[0]  # the step's objective: every rank's share
                        t.breakdown.add("comm_s", time.perf_counter() - t0)
                        t.stepper_judge(st, summed)
                    t.gate.arm(st.verdict.bad)
                t.breakdown.engine_call(t.engine.backward, loss * scale)
                t.breakdown.engine_call(t.engine.step)
                t.breakdown.after_micro_step()
        self.gap = gap
        self.updates = t.engine.global_steps - updates  # optimizer updates this step: num_iterations, read back
        self._stats(samples, rewards, per_fn, counts, adv, all_rewards, zero_std, sums, total_tokens)

    def _logps(self, p: Packed, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.t
        ctx = nullcontext() if grad else torch.no_grad()
        with ctx:
            return t.breakdown.forward(completion_logps, lambda **kw: t.engine(**kw).logits, p, self.g.temperature)

    @torch.no_grad()
    def _ref_logps(self, p: Packed) -> torch.Tensor:
        """The reference policy's log-probs: the adapter switched off (LoRA), or the frozen copy."""
        t = self.t
        module = t.engine.module
        if hasattr(module, "disable_adapter"):
            with module.disable_adapter():
                return completion_logps(lambda **kw: t.engine(**kw).logits, p, self.g.temperature)[0]
        return completion_logps(lambda **kw: t.reference(**kw).logits, p, self.g.temperature)[0]

    # ---- what the step shows ---------------------------------------------------------------------------------
    def _stats(self, samples, rewards, per_fn, counts, adv, all_rewards, zero_std, sums, total_tokens):
        """The step's row (every rank's numbers, summed in one all-reduce) and its rollout records (on rank 0)."""
        g, n = self.g, len(samples)
        fn_sums = [sum(v for v in f if v == v) for f in per_fn]
        fn_counts = [sum(1 for v in f if v == v) for f in per_fn]
        status = ["passed", "failed", "timeout", "crashed", "sandbox_error", "reward_error"]
        local = [float(n), sum(len(s.ids) for s in samples), float(sum(s.truncated for s in samples)),
                 sums["kl"], sums["clip_low"], sums["clip_high"], sums["clip_region"], sums["entropy"],
                 float(self.gen_tokens), *fn_sums, *fn_counts, *(float(counts.get(k, 0)) for k in status)]  # fmt: skip
        tot = _sum(local)
        longest = _max(float(max((len(s.ids) for s in samples), default=0)))
        gap = _max(self.gap)
        rows = tot[0]
        valid = all_rewards[~torch.isnan(all_rewards)]
        row = {
            "reward": float(valid.mean()) if valid.numel() else math.nan,
            "reward_std": _reward_std(valid),
            "frac_reward_zero_std": float(zero_std.float().mean()),
            "completion_length": tot[1] / rows,
            "completion_length_max": longest,
            "truncated_frac": tot[2] / rows,
            "clip_ratio_low": tot[4] / max(total_tokens, 1.0),
            "clip_ratio_high": tot[5] / max(total_tokens, 1.0),
            "clip_ratio_region": tot[6] / max(total_tokens, 1.0),
            "entropy": tot[7] / max(total_tokens, 1.0),
            "logp_gap_max": gap,
            "optimizer_updates": self.updates,
            "completions": int(rows),
            "generated_tokens": int(tot[8]),
        }
        if g.beta > 0:
            row["kl"] = tot[3] / max(total_tokens, 1.0)
        k = len(per_fn)
        for i, name in enumerate(self.names):
            c = tot[9 + k + i]
            row[f"rewards/{name}"] = tot[9 + i] / c if c else math.nan
        for j, s in enumerate(status):
            v = tot[9 + 2 * k + j]
            if v or s in ("timeout", "crashed"):
                row[f"reward_{s}"] = int(v)
        self.row = row
        local_records = [{"step": None, "task_id": s.problem["task_id"], "group": s.group, "completion": s.completion,
                          "reward": None if r != r else r, "advantage": float(a), "completion_tokens": len(s.ids),
                          "truncated": s.truncated} for s, r, a in zip(samples, rewards, adv)]  # fmt: skip
        self.records = _gather_records(local_records) if g.log_completions else []


def _reward_std(x: torch.Tensor) -> float:
    """The reward's std as TRL logs it (Bessel-corrected); 0 for a single value."""
    return float(x.std()) if x.numel() > 1 else 0.0


def _max(v: float) -> float:
    t = coll_tensor([v], torch.float64)
    if world_size() > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t[0])


def _gather_records(records: list[dict]) -> list[dict]:
    """Every rank's rollout records on rank 0 (others get an empty list). Collective."""
    if world_size() == 1:
        return records
    out = [None] * world_size() if tdist.get_rank() == 0 else None
    tdist.gather_object(records, out, dst=0)
    return [r for part in out for r in part] if out else []
