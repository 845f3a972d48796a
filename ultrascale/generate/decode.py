"""The decoding step of the dynamic path (gpt-fast's ``decode_one_token``): one new position for every row of
the batch over its KV cache, the next tokens drawn on the device and read back once to check stops. Finished
rows are fed a pad token until the scheduler compacts them out."""

from __future__ import annotations

import torch

from ultrascale.generate.forward import LM
from ultrascale.generate.rows import Batch, Collector
from ultrascale.generate.sampling import SamplingParams, pick_logps, pick_tokens


def decode_step(lm: LM, b: Batch, params: SamplingParams, collect: Collector) -> None:
    """One decode step for every row of ``b``, in place: mask, position and last token move on one column."""
    st = collect.stats
    st.decode_steps += 1
    st.row_steps += b.alive()
    st.cache_cells += b.mask.numel()
    st.cache_pad += int((b.mask == 0).sum())
    b.mask = torch.cat([b.mask, b.mask.new_ones(len(b.rows), 1)], dim=1)
    logits = lm.logits(b.last[:, None], b.mask, b.pos[:, None], b.cache)
    b.pos = b.pos + 1
    b.last = pick_tokens(logits, b.rows, params, lm.pad)
    b.last_logps = pick_logps(logits, b.last, params)
    collect.add_picks(b, b.last)
