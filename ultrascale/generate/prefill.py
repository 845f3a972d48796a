"""Prefill: a group of prompts of similar length through the model together (left-padded), once per prompt
however many samples it has; the n samples' KV rows are copies of its prefill, and each draws its first token
from the prefill's logits. Prefill is eager on both paths (its shapes change with every group), as in gpt-fast."""

from __future__ import annotations

import time

import torch

from ultrascale.generate.cache import new_cache
from ultrascale.generate.forward import LM
from ultrascale.generate.output import GenerationStats
from ultrascale.generate.rows import Batch, Row
from ultrascale.generate.sampling import SamplingParams, pick_logps, pick_tokens, row_key


def prefill(lm: LM, group: list[int], ids: list[list[int]], params: SamplingParams, stats: GenerationStats) -> Batch:
    """Prefill ``group``'s prompts (indices into ``ids``) into a new :class:`Batch` of one row per sample, each
    row's ``last`` its first token."""
    t0 = time.perf_counter()
    longest = max(len(ids[i]) for i in group)
    tokens = torch.full((len(group), longest), lm.pad, dtype=torch.long)
    mask = torch.zeros((len(group), longest), dtype=torch.long)
    for r, i in enumerate(group):
        tokens[r, longest - len(ids[i]) :] = torch.tensor(ids[i])
        mask[r, longest - len(ids[i]) :] = 1
    tokens, mask = tokens.to(lm.device), mask.to(lm.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = new_cache(lm.layers)
    for layer in cache.layers:
        layer.reserve(params.max_new_tokens + 1)
    logits = lm.logits(tokens, mask, pos, cache)
    stats.prefill_tokens += tokens.numel()
    stats.prefill_pad += int((mask == 0).sum())
    if params.n > 1:  # the samples of a prompt share its prefill: copy its rows, not its compute
        rep = torch.arange(len(group), device=lm.device).repeat_interleave(params.n)
        for layer in cache.layers:
            layer.rebuild(layer.keys[rep], layer.values[rep])
        mask, pos, logits = mask[rep], pos[rep], logits[rep]
    rows = [Row(i, s, row_key(params.seed, i, s), prompt_ids=ids[i]) for i in group for s in range(params.n)]
    b = Batch(cache, mask, pos[:, -1] + 1, None, rows)
    b.last = pick_tokens(logits, rows, params, lm.pad)
    b.last_logps = pick_logps(logits, b.last, params)
    stats.prefill_s += time.perf_counter() - t0
    return b
