"""The static path: decoding over the static KV cache (:mod:`~ultrascale.generate.static_cache`), its step
replayed as CUDA graphs (:mod:`~ultrascale.generate.graphs`) where ``levers.decide.decide_static`` says so. Rows own
slots; a refill prefills the next prompts eagerly and loads their rows into free slots; the new tokens come back
to the host once every ``sync_every`` steps, where stops are checked. On CPU (no launches to save) the same step
runs eagerly over the columns in use."""

from __future__ import annotations

import logging
from collections import deque

import torch

from ultrascale.generate.forward import LM
from ultrascale.generate.graphs import DecodeGraphs
from ultrascale.generate.prefill import prefill
from ultrascale.generate.rows import Collector, Row
from ultrascale.generate.sampling import SamplingParams, pick_logps, sample_tokens
from ultrascale.generate.scheduler import groups, take
from ultrascale.generate.static_cache import StaticSlots, bucket, round_up

log = logging.getLogger("ultrascale")

SYNC_EVERY_CUDA = 8
"""Steps between host reads of the new tokens on a GPU: the host checks stop sequences while the next steps run.
A row that finished mid-window computes at most this many steps too many; its text is cut where it stopped."""


class StaticDecoder:
    """The static path of one sampler: its cache (kept across ``generate`` calls while large enough, so its
    captured graphs stay valid), its graphs, and whether they are on (``graphs``) and why (``why``)."""

    def __init__(self, lm: LM, graphs: bool, why: str, sync_every: int) -> None:
        self.lm, self.graphs, self.why = lm, graphs, why
        self.sync_every = int(sync_every) or (SYNC_EVERY_CUDA if lm.device.type == "cuda" else 1)
        """Decoding steps between host reads of the new tokens (a CPU reads its own memory: 1)."""
        self.slots: StaticSlots | None = None
        self.captured: DecodeGraphs | None = None

    def cache(self, slots: int, width: int) -> StaticSlots:
        """The static cache for ``slots`` rows of ``width`` columns: the one already allocated where it is large
        enough, else a new one (and new graphs)."""
        lm = self.lm
        if self.slots is None or not self.slots.fits(lm.layers, slots, width, lm.device):
            self.slots = StaticSlots(lm.layers, slots, width, lm.device)
            self.captured = None
        return self.slots

    def step(self, slots: StaticSlots, rows: int, width: int, stats) -> torch.Tensor:
        """The logits of one decoding step of the first ``rows`` slots: a CUDA graph's replay, or the same step
        run eagerly over the columns in use. A capture that fails falls back to eager steps, with a warning."""
        lm = self.lm
        if self.graphs:
            if self.captured is None:
                ctx = lm.autocast_ctx(cache_enabled=False) if lm.autocast else None
                self.captured = DecodeGraphs(lambda b: slots.forward(lm.base, lm.head_logits, b, slots.width), ctx)
            try:
                before = len(self.captured.graphs)
                out = self.captured(rows)
                stats.graphs += len(self.captured.graphs) - before
                return out
            except RuntimeError as e:  # a kernel or a host read inside HF's forward that a graph cannot hold
                log.warning(f"static decode: CUDA graph capture failed ({str(e).splitlines()[0]}); eager steps")
                self.graphs, self.why = False, f"static cache, eager steps (graph capture failed: {e})"
        with lm.autocast_ctx():
            return slots.forward(lm.base, lm.head_logits, rows, width)

    def run(self, ids: list[list[int]], pending: deque, params: SamplingParams, collect: Collector, cap: int,
            refill_at: float, prefill_tokens: int) -> None:  # fmt: skip
        """Decode every pending prompt with at most ``cap`` rows in slots. Once nothing is pending, live rows are
        compacted into the lowest slots whenever that shrinks the bucket the step runs for. A window of host reads
        never runs past a row's length limit."""
        st = collect.stats
        width = round_up(max(max(map(len, ids)) + params.max_new_tokens, self.sync_every) + 1, 64)
        slots = self.cache(bucket(cap), width)
        slots.free(list(range(slots.slots)))  # a reused cache: no slot keeps a column from the last call
        rows: list[Row | None] = [None] * slots.slots
        while pending or any(r is not None for r in rows):
            live = [s for s, r in enumerate(rows) if r is not None]
            if pending and len(live) <= min(refill_at * cap, cap - params.n):  # a prompt's n rows fit
                st.refills += int(bool(live))
                free = [s for s in range(cap) if rows[s] is None]
                for group in groups(take(pending, len(free), params.n), ids, prefill_tokens):
                    b = prefill(self.lm, group, ids, params, st)
                    collect.add_picks(b, b.last)
                    keep = [r for r, row in enumerate(b.rows) if not row.done]
                    if not keep:
                        continue
                    dst = [free.pop(0) for _ in keep]
                    kept = [b.rows[r] for r in keep]
                    slots.load(dst, b.cache, keep, [len(row.prompt_ids) for row in kept], b.last[keep],
                               [row.key for row in kept], [len(row.tokens) for row in kept])  # fmt: skip
                    for d, row in zip(dst, kept):
                        rows[d] = row
                continue
            if not pending and bucket(len(live)) < bucket(live[-1] + 1):
                slots.move(live, list(range(len(live))))
                rows = [rows[s] for s in live] + [None] * (slots.slots - len(live))
                live = list(range(len(live)))
                st.compactions += 1
            n = bucket(live[-1] + 1)
            window = min(self.sync_every, min(params.max_new_tokens - len(rows[s].tokens) for s in live))
            picks, logps = [], []
            for _ in range(window):
                cols = slots.width if self.graphs else max(slots.host_lens[:n]) + 1
                logits = self.step(slots, n, cols, st)
                picks.append(sample_tokens(logits, params, slots.keys[:n], slots.steps[:n]))
                if params.logprobs:  # read now: a captured graph's logits buffer is rewritten by the next step
                    logps.append(pick_logps(logits, picks[-1], params))
                st.decode_steps += 1
                st.row_steps += len(live)
                st.buckets[n] = st.buckets.get(n, 0) + 1
                st.cache_cells += n * cols
                st.cache_pad += sum(cols - 1 - slots.host_lens[s] for s in range(n))
                slots.advance(n, picks[-1])
            tokens = torch.stack(picks, dim=1).tolist()  # the window's one read back to the host
            st.host_reads += 1
            lps = torch.stack(logps, dim=1).tolist() if logps else None
            for s in live:
                for j, tok in enumerate(tokens[s]):
                    if collect.add(rows[s], tok, lps[s][j] if lps else None):
                        rows[s] = None
                        break
            if dead := [s for s in range(n) if rows[s] is None]:
                slots.free(dead)
