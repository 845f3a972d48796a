"""The dynamic path's batch scheduler (continuous batching, in the shape of vLLM's): prompts are taken in length
order and prefilled in groups of similar length into free slots (:func:`groups`, :func:`take`), a finished row
leaves the batch (:func:`compact`), new rows join the ones in flight left-padded (:func:`merge`), and
:func:`run_dynamic` decides at each step which of these to do before a decode or draft step."""

from __future__ import annotations

from collections import deque

import torch

from ultrascale.generate.decode import decode_step
from ultrascale.generate.draft import draft_step
from ultrascale.generate.forward import LM
from ultrascale.generate.output import GenerationStats
from ultrascale.generate.prefill import prefill
from ultrascale.generate.rows import Batch, Collector
from ultrascale.generate.sampling import SamplingParams


def groups(prompts: list[int], ids: list[list[int]], prefill_tokens: int) -> list[list[int]]:
    """Prefill groups of prompts in length order, each within ``prefill_tokens`` positions once left-padded
    to its longest: one group of 32 HumanEval prompts of 50 to 500 tokens would be half padding."""
    out: list[list[int]] = []
    for i in sorted(prompts, key=lambda i: len(ids[i])):
        if out and (len(out[-1]) + 1) * len(ids[i]) <= prefill_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def take(pending: deque, slots: int, n: int) -> list[int]:
    """The next prompts (in length order) whose n samples fit the free slots (at least one prompt)."""
    group = [pending.popleft()]
    while pending and (len(group) + 1) * n <= slots:
        group.append(pending.popleft())
    return group


def compact(b: Batch, params: SamplingParams, stats: GenerationStats) -> Batch | None:
    """Only the unfinished rows stay; key columns none of them attends to (left padding) are cut off, and
    rejected drafts' holes squeezed out (each row's kept columns, in order, left-padded to the longest)."""
    keep = [r for r, row in enumerate(b.rows) if not row.done]
    if not keep:
        return None
    stats.compactions += 1
    device = b.mask.device
    idx = torch.tensor(keep, device=device)
    mask = b.mask[idx]
    if any(b.holes_by_row[r] for r in keep):
        counts = mask.sum(dim=1)
        width = int(counts.max())
        # for each row, the kept columns in order, right-aligned: a stable sort puts the masked ones first
        order = torch.sort(mask, dim=1, stable=True).indices[:, -width:]
        for layer in b.cache.layers:
            layer.reserve(params.max_new_tokens + 1)
            gather = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.rebuild(layer.keys[idx].gather(2, gather), layer.values[idx].gather(2, gather))
        mask = (torch.arange(width, device=device)[None, :] >= (width - counts)[:, None]).to(mask.dtype)
        return Batch(b.cache, mask, b.pos[idx], b.last[idx], [b.rows[r] for r in keep])
    first = int(mask.any(dim=0).nonzero()[0])  # the first column a remaining row attends to
    for layer in b.cache.layers:
        layer.reserve(params.max_new_tokens + 1)
        layer.rebuild(layer.keys[idx, :, first:], layer.values[idx, :, first:])
    return Batch(b.cache, mask[:, first:], b.pos[idx], b.last[idx], [b.rows[r] for r in keep])


def merge(batches: list[Batch | None], params: SamplingParams, stats: GenerationStats) -> Batch | None:
    """The unfinished rows of several batches (the one in flight, freshly prefilled groups) as one batch: each
    side's keys are left-padded (masked) to the longest. One rebuild of the cache."""
    parts = [b if not (b.holes or any(r.done for r in b.rows)) else compact(b, params, stats)
             for b in batches if b is not None]  # fmt: skip
    parts = [b for b in parts if b is not None]
    if len(parts) < 2:
        return parts[0] if parts else None
    width = max(b.mask.shape[1] for b in parts)

    def padded(t: torch.Tensor) -> torch.Tensor:  # [rows, heads, n, dim] -> [rows, heads, width, dim]
        n = t.shape[2]
        return torch.cat([t.new_zeros((*t.shape[:2], width - n, t.shape[-1])), t], dim=2) if n < width else t

    cache = parts[0].cache
    for li, layer in enumerate(cache.layers):
        keys = torch.cat([padded(b.cache.layers[li].keys) for b in parts])
        values = torch.cat([padded(b.cache.layers[li].values) for b in parts])
        layer.reserve(params.max_new_tokens + 1)
        layer.rebuild(keys, values)
    pad = torch.nn.functional.pad
    mask = torch.cat([pad(b.mask, (width - b.mask.shape[1], 0)) for b in parts])
    return Batch(cache, mask, torch.cat([b.pos for b in parts]), torch.cat([b.last for b in parts]),
                 [r for b in parts for r in b.rows])  # fmt: skip


def run_dynamic(lm: LM, ids: list[list[int]], pending: deque, params: SamplingParams, collect: Collector, cap: int,
                refill_at: float, prefill_tokens: int, draft: int, draft_budget: int) -> None:  # fmt: skip
    """Decode every pending prompt with at most ``cap`` rows in flight. Refill when the rows in flight drop to
    ``refill_at`` of ``cap`` (a prefill is a rebuild of the cache: doing it for every single free slot would cost
    more than the slot is worth); compact when finished rows or rejected drafts' holes take a large share."""
    st = collect.stats
    batch: Batch | None = None
    while pending or (batch is not None and batch.alive()):
        alive = batch.alive() if batch is not None else 0
        if pending and alive <= refill_at * cap:  # free slots: prefill the next prompts into them
            st.refills += int(alive > 0)
            news = []
            for group in groups(take(pending, cap - alive, params.n), ids, prefill_tokens):
                news.append(prefill(lm, group, ids, params, st))
                collect.add_picks(news[-1], news[-1].last)
            batch = merge([batch, *news], params, st)
            continue
        if batch.dead() * 4 > len(batch.rows) or batch.holes * 2 > batch.mask.shape[1]:
            batch = compact(batch, params, st)  # finished rows and rejected drafts cost compute: drop them
        if not (params.greedy and draft and draft_step(lm, batch, params, collect, draft, draft_budget)):
            decode_step(lm, batch, params, collect)
