"""``conf/grpo/``: reinforcement learning from execution feedback (GRPO), keys named as TRL's ``GRPOConfig`` names
them, so a user moves between the two without a dictionary.

A GRPO step: ``prompts_per_step`` problems (counted across all ranks), ``num_generations`` completions each from
the project's sampler on the weights the optimizer just produced, each completion scored by ``reward_funcs`` (the
sandboxed execution of its problem's tests by default), the rewards normalised within each problem's group into
advantages, and the clipped policy-gradient loss of ``loss_type`` over the sampled token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ultrascale.config.fields import num


class LossType(StrEnum):
    """How the per-token loss is reduced (TRL's ``loss_type``): ``grpo`` the mean of each completion's token mean
    (DeepSeekMath: a long completion's tokens count less); ``dr_grpo`` the token sum over ``completions x
    max_completion_length`` (Dr. GRPO: no length bias); ``dapo`` the token sum over the step's completion tokens
    (DAPO's token-level mean; TRL's default since 1.0)."""

    grpo = "grpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"


class RolloutGather(StrEnum):
    """ZeRO-3: how the sampler's replica is refreshed from the partitions each step (once a step either way)."""

    auto = "auto"
    whole = "whole"
    layer = "layer"


class ScaleRewards(StrEnum):
    """What divides ``reward - mean(group)``: the group's std, the whole step's std, or nothing (Dr. GRPO)."""

    group = "group"
    batch = "batch"
    none = "none"


@dataclass
class GRPOConfig:
    # ---- sampling ----
    num_generations: int = num(8, ge=2)
    """Completions per prompt (G): the group whose rewards are normalised against each other."""
    max_completion_length: int = num(512, ge=1)
    """Tokens a completion may run to; one that reaches it is truncated (``finish=length``)."""
    temperature: float = num(1.0, gt=0)
    """Sampling temperature; the log-probs the loss uses are of the logits divided by it, as TRL's are."""
    top_p: float = num(1.0, gt=0, le=1)
    top_k: int = num(0, ge=0)
    """0: off."""
    # ---- the loss ----
    loss_type: LossType = LossType.dapo
    beta: float = num(0.0, ge=0)
    """KL coefficient against the reference model (k3 estimator, as TRL). 0: no reference model is kept or run.
    With ``finetune=lora`` the reference is the base with the adapter switched off (no second copy); with full
    fine-tuning a frozen copy, sharded as the policy is."""
    use_bias_correction_kl: bool = True
    """Weight the KL by the importance ratio (DeepSeek-V3.2: the unbiased reverse-KL gradient; TRL's default)."""
    epsilon: float = num(0.2, gt=0, lt=1)
    """Lower clip of the importance ratio: ``1 - epsilon``."""
    epsilon_high: float | None = num(None, gt=0)
    """Upper clip ``1 + epsilon_high`` (DAPO's clip-higher: 0.28); null: ``epsilon``."""
    scale_rewards: ScaleRewards = ScaleRewards.group
    mask_truncated_completions: bool = False
    """Truncated completions (no EOS and no stop sequence within ``max_completion_length``) get no loss (DAPO)."""
    num_iterations: int = num(1, ge=1)
    """Optimizer updates per generation batch (PPO epochs, TRL's mu). Above 1 the old log-probs are recomputed by
    a forward before the first update, and the clip acts; at 1 the ratio is 1 and old = current, detached."""
    # ---- rewards ----
    reward_funcs: list[str] = field(default_factory=lambda: ["execution"])
    """Built-in names (``execution``: 1 when the problem's tests pass in the sandbox; ``format``: 1 for a
    completion that parses as Python with the prompt; ``length``: minus the share of ``max_completion_length``
    used) or dotted paths ``pkg.module.fn`` to ``f(prompts, completions, **columns) -> list[float | None]``, TRL's
    convention (``columns``: each problem's fields, ``task_id``, ``tests``, ``entry_point``, repeated per
    completion, and ``completion_ids``). A ``None`` is "not applicable" and counts as nothing."""
    reward_weights: list[float] | None = None
    """One weight per reward function; null: 1 each. The reward is their weighted sum."""
    reward_timeout_s: float = num(10.0, gt=0)
    """Wall-clock limit of one sandboxed program: a completion that runs longer scores 0 and is counted."""
    reward_workers: int = num(2, ge=1)
    """Sandboxed programs run at once on each rank."""
    # ---- the step ----
    prompts_per_step: int = num(4, ge=1)
    """Problems per optimizer step, across all ranks (a multiple of the data-parallel size): the step makes
    ``prompts_per_step x num_generations`` completions in all. ``data.global_batch`` must equal that product."""
    sampler_batch_size: int = num(32, ge=1)
    """Rows the sampler keeps in flight on each rank (its KV cache holds them)."""
    rollout_gather: RolloutGather = RolloutGather.auto
    """ZeRO-3 only: ``whole`` gathers the whole model at once into the sampler's replica (one collective; the
    gathered model and the replica are both held for that moment); ``layer`` a decoder layer at a time (the moment
    holds one layer); ``auto``: whole when the planner's memory model fits it beside the training state, else layer.
    Once a step either way, never per generated token (TRL's ``ds3_gather_for_generation=false`` gathers every layer
    for every token)."""
    log_completions: bool = True
    """Write every completion of a step to ``OUTPUT_DIR/rollouts/step_NNNNNNNN.jsonl`` (rank 0 gathers them)."""

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
