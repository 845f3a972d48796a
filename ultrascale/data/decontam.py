"""Decontamination of training prompts: one n-gram matcher (data prep's) for every source of SSD's and the
instruction set's prompts, against HumanEval and the held-out repositories' problems.

Its own module because both the problem miner (:mod:`ultrascale.eval.problems`) and the prompt builder
(:mod:`ultrascale.data.prompts`, which builds on the miner) drop contaminated records with it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from ultrascale.config.problems import ProblemsConfig

log = logging.getLogger("ultrascale")

HELD_OUT_PREFIX = "heldout/"
"""Item ids of held-out problems start with it; every other item is HumanEval's."""


def decontaminate(
    records: list[dict],
    cfg: ProblemsConfig,
    counts: Counter,
    held_out: Sequence[tuple[str, str]] = (),
    held_out_keys: AbstractSet[str] = frozenset(),
) -> list[dict]:
    """Drop prompts overlapping HumanEval or a held-out problem, with data prep's n-gram matcher and settings.

    The one matcher for every source of training prompts (mined, corpus, JSONL; RFT's problems too): each
    record's prompt plus its ``reference`` when it has one. The held-out problems are added to the same index
    as HumanEval's items, so one pass checks both. A body identical to a held-out one (``_body``, an AST key)
    is dropped too: a short function has fewer than ``decontam_ngram`` words and no n-grams at all.
    """
    from data_prep.decontam import Decontaminator, ngrams

    det = Decontaminator(["humaneval"], None, cfg.decontam_ngram, cfg.decontam_min_overlap)
    for item_id, text in held_out:
        k = len(det.item_ids)
        det.item_ids.append(item_id)
        grams = ngrams(text, det.n)
        det.item_size.append(len(grams))
        for g in grams:
            det.index[g].append(k)
    det.first = {g.split(" ", 1)[0] for g in det.index}
    det.last = {g.rsplit(" ", 1)[-1] for g in det.index}
    out = []
    for r in records:
        hit = det.match(r["prompt"] + r.get("reference", ""))
        if r.get("_body") in held_out_keys:
            hit = hit if hit and hit[0].startswith(HELD_OUT_PREFIX) else ("heldout/identical body", 1.0)
        if hit:
            reason = "validation_contaminated" if hit[0].startswith(HELD_OUT_PREFIX) else "humaneval_contaminated"
            counts[reason] += 1
            log.info(f"prompts: drop {r['task_id']} (matches {hit[0]}, overlap {hit[1]})")
            continue
        out.append(r)
    return out
