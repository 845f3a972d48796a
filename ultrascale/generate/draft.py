"""Prompt-lookup drafting (greedy only): each row proposes the tokens that followed the last occurrence of its
latest n-gram in its prompt or completion (:func:`lookup`), one forward verifies them all, and the row keeps the
drafted tokens greedy decoding would have chosen plus the model's next one (:func:`draft_step`). Code repeats its
names and lines, so on the long-tailed rows that hold a batch open most drafts are kept."""

from __future__ import annotations

import torch

from ultrascale.generate.forward import LM
from ultrascale.generate.rows import Batch, Collector
from ultrascale.generate.sampling import SamplingParams


def lookup(prompt: list[int], tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt-lookup drafting (Saxena, 2023; HF's ``prompt_lookup_num_tokens``): the up-to-``k`` tokens that
    followed the most recent earlier occurrence of the sequence's last n-gram (longest n first), in the prompt and
    the completion so far. Code repeats its names and its lines, so the copy is often what the model writes."""
    seq = prompt + tokens
    end = len(seq)
    for n in range(min(max_ngram, end - 1), 0, -1):
        tail = seq[end - n :]
        for start in range(end - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


def draft_step(lm: LM, b: Batch, params: SamplingParams, collect: Collector, draft: int, budget: int) -> bool:
    """One forward that verifies each row's draft of up to ``draft`` tokens (rows x (1 + drafts) within
    ``budget`` positions, where a forward still costs about what one token does): the row keeps the drafted
    tokens up to the first one greedy decoding would not have chosen, plus the model's own token after them, so
    the output is greedy decoding's. Rejected drafts stay in the cache as masked columns (holes) until
    compaction. False (nothing done) when no row has a draft or the batch is too full for drafts to pay."""
    alive = b.alive()
    k = min(draft, budget // max(alive, 1) - 1)
    if k < 1:
        return False
    drafts = [[] if row.done else lookup(row.prompt_ids, row.tokens, k) for row in b.rows]
    q = 1 + max(len(d) for d in drafts)
    if q == 1:
        return False
    rows, width = len(b.rows), b.mask.shape[1]
    ids = torch.full((rows, q), lm.pad, dtype=torch.long)
    new = torch.zeros((rows, q), dtype=b.mask.dtype)
    ids[:, 0], new[:, 0] = b.last.cpu(), 1
    for r, d in enumerate(drafts):
        if d:
            ids[r, 1 : 1 + len(d)] = torch.tensor(d)
            new[r, 1 : 1 + len(d)] = 1
    st = collect.stats
    st.decode_steps += 1
    st.row_steps += alive
    st.cache_cells += b.mask.numel() + (q - 1) * rows
    st.cache_pad += int((b.mask == 0).sum())
    b.mask = torch.cat([b.mask, new.to(lm.device)], dim=1)
    pos = b.pos[:, None] + torch.arange(q, device=lm.device)
    targets = lm.logits(ids.to(lm.device), b.mask, pos, b.cache, keep=q).argmax(dim=-1).tolist()
    st.host_reads += 1
    step_pos, last = b.pos.tolist(), b.last.tolist()
    for r, (row, d) in enumerate(zip(b.rows, drafts)):
        if row.done:
            step_pos[r] += 1
            continue
        m = next((j for j, tok in enumerate(d) if tok != targets[r][j]), len(d))
        st.drafted += len(d)
        st.accepted += m
        if q - 1 > m:  # the rejected drafts' columns (and a shorter draft's padding) are holes from now on
            b.mask[r, width + 1 + m :] = 0
            b.holes_by_row[r] += q - 1 - m
        step_pos[r] += m + 1
        last[r] = targets[r][m]
        for tok in [*d[:m], targets[r][m]]:
            if collect.add(row, tok):
                break
    b.pos = torch.tensor(step_pos, device=lm.device)
    b.last = torch.tensor(last, device=lm.device)
    return True
