"""The GRPO objective, token by token, as TRL 1.16's ``GRPOTrainer._compute_loss`` computes it.

Our completions are laid out flat (one entry per completion token, ``rows`` saying whose it is) rather than as
TRL's padded [completions, max_len] grid: the same sums, no padding. What is kept identical, and checked against a
fixture of TRL's own values (``tests/test_grpo_loss.py``, written by ``bench/grpo_trl_fixture.py``):

* log-probs of the sampled tokens under ``logits / temperature`` (the distribution sampled from, before top-k/p);
* the importance ratio ``exp(logp - old_logp)``, clipped to ``[1 - epsilon, 1 + epsilon_high]``, and the
  pessimistic ``-min(ratio * A, clip(ratio) * A)``;
* the k3 KL ``exp(ref - logp) - (ref - logp) - 1``, times the ratio (``use_bias_correction_kl``, TRL's default)
  and ``beta``, added per token;
* the reduction of ``loss_type``, over the whole step's batch: ``grpo`` the mean over completions of each one's
  token mean; ``dr_grpo`` the token sum over ``completions x max_completion_length``; ``dapo`` the token sum over
  the step's loss tokens. A micro-batch contributes its part of that global sum (:func:`micro_loss`), so the
  gradient of a step is the gradient of one objective however it is split over ranks and micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ultrascale.config.grpo import LossType, ScaleRewards

STD_EPS = 1e-4
"""Added to the std before dividing (TRL's constant)."""


def token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each ``ids`` token, entropy) under ``logits / temperature``, in fp32. ``logits`` [N, V], ``ids``
    [N]. The entropy is detached: it is logged, not optimised."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, ids[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected std ignoring NaNs (TRL's ``nanstd``)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    out = torch.sqrt(var * count / (count - 1))
    return out.squeeze(dim) if dim is not None else out.reshape(())


def advantages(rewards: torch.Tensor, group: int, scale: ScaleRewards | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, zero-std mask) of ``rewards`` [groups * group], grouped consecutively. A NaN reward (every
    reward function said "not applicable") stays out of its group's mean and std and gets advantage 0.

    ``scale`` ``group``: (r - mean(group)) / (std(group) + 1e-4); ``batch``: the std of the whole step (the caller
    passes every rank's rewards); ``none``: r - mean(group). The mask marks completions whose divisor was 0 (a
    group that all passed or all failed: no signal, reported as ``frac_reward_zero_std``)."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == ScaleRewards.batch:
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale != ScaleRewards.none:
        adv = adv / (std + STD_EPS)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass(frozen=True)
class Objective:
    loss_type: LossType
    epsilon: float
    epsilon_high: float
    beta: float
    max_completion_length: int
    bias_correction_kl: bool = True


@dataclass
class TokenTerms:
    """One micro-batch's per-token quantities, flat: ``rows[i]`` is the completion (0..n-1 in the micro-batch)
    token i belongs to; ``mask`` 0 for tokens that carry no loss (a masked truncated completion)."""

    logps: torch.Tensor
    old_logps: torch.Tensor
    advantages: torch.Tensor
    """Per completion [n]."""
    rows: torch.Tensor
    mask: torch.Tensor
    ref_logps: torch.Tensor | None = None


def per_token_loss(t: TokenTerms, obj: Objective) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate (+ beta * k3 KL) of every token, and its detached statistics as token sums."""
    adv = t.advantages[t.rows]
    ratio = torch.exp(t.logps - t.old_logps)
    clipped = torch.clamp(ratio, 1 - obj.epsilon, 1 + obj.epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    stats = {}
    if obj.beta != 0.0:
        assert t.ref_logps is not None, "beta > 0 needs the reference log-probs"
        delta = t.ref_logps - t.logps
        kl = torch.exp(delta) - delta - 1
        stats["kl"] = (kl.detach() * t.mask).sum()
        if obj.bias_correction_kl:  # DeepSeek-V3.2's unbiased reverse-KL gradient: the KL weighted by the ratio
            kl = kl * ratio
        loss = loss + obj.beta * kl
    with torch.no_grad():
        low = ((ratio < 1 - obj.epsilon) & (adv < 0)).float()
        high = ((ratio > 1 + obj.epsilon_high) & (adv > 0)).float()
        stats["clip_low"], stats["clip_high"] = (low * t.mask).sum(), (high * t.mask).sum()
        stats["clip_region"] = ((low + high) * t.mask).sum()
    return loss, stats


def micro_loss(
    t: TokenTerms, obj: Objective, n_rows: int, total_rows: int, total_tokens: float
) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of the step's objective: summed over every micro-batch of every rank it is the
    loss of ``obj.loss_type`` over the whole step (``total_rows`` completions, ``total_tokens`` loss tokens, both
    counted over every rank). The caller scales it for DeepSpeed's mean over micro-batches and ranks."""
    loss, stats = per_token_loss(t, obj)
    masked = loss * t.mask
    if obj.loss_type == LossType.grpo:  # each completion's token mean, then the mean over completions
        lengths = torch.zeros(n_rows, dtype=masked.dtype, device=masked.device).index_add_(0, t.rows, t.mask)
        sums = torch.zeros(n_rows, dtype=masked.dtype, device=masked.device).index_add_(0, t.rows, masked)
        value = (sums / lengths.clamp(min=1.0)).sum() / total_rows
    elif obj.loss_type == LossType.dr_grpo:
        value = masked.sum() / (total_rows * obj.max_completion_length)
    else:  # dapo: the token-level mean over the step
        value = masked.sum() / max(total_tokens, 1.0)
    return value, stats
