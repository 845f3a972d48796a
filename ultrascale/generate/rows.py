"""The rows in flight and where their tokens go: a :class:`Row` per sample, a :class:`Batch` of rows sharing a
KV cache (the dynamic path), and the :class:`Collector` that appends each new token, ends a row on EOS, a stop
sequence or the length limit, and files its :class:`~ultrascale.generate.output.Completion`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from ultrascale.generate.output import Completion, GenerationStats
from ultrascale.generate.sampling import SamplingParams


@dataclass
class Row:
    prompt: int
    sample: int
    key: int
    """The sample's noise key (:func:`~ultrascale.generate.sampling.row_key`); its step is ``len(tokens)``."""
    tokens: list[int] = field(default_factory=list)
    checked: int = 0
    """Characters of the decoded text already searched for stop sequences."""
    done: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)


@dataclass
class Batch:
    """The rows in flight: their KV cache, attention mask over its columns, next position, last token."""

    cache: Cache
    mask: torch.Tensor
    pos: torch.Tensor
    last: torch.Tensor | None
    rows: list[Row]
    last_logps: torch.Tensor | None = None
    """The log-probs of ``last`` (``SamplingParams.logprobs``), read with it by :meth:`Collector.add_picks`."""
    holes_by_row: list[int] = field(default_factory=list)
    """Masked columns left inside each row by rejected drafts."""

    def __post_init__(self) -> None:
        self.holes_by_row = self.holes_by_row or [0] * len(self.rows)

    @property
    def holes(self) -> int:
        return max(self.holes_by_row, default=0)

    def alive(self) -> int:
        return sum(not r.done for r in self.rows)

    def dead(self) -> int:
        return sum(r.done for r in self.rows)


class Collector:
    """One ``generate`` call's results: stop checks run on the new text of unfinished rows only (the old stopping
    criterion re-decoded every row at every step), and a prompt counts as done on the progress bar once all its
    samples are."""

    def __init__(self, tokenizer, eos: set[int], stops: list[tuple[str, ...]], params: SamplingParams,
                 stats: GenerationStats, bar, t0: float) -> None:  # fmt: skip
        self.tokenizer, self.eos, self.stops, self.params = tokenizer, eos, stops, params
        self.stats, self.bar, self.t0 = stats, bar, t0
        self.results: list[list[Completion | None]] = [[None] * params.n for _ in stops]
        self.left = {i: params.n for i in range(len(stops))}

    def add_picks(self, b: Batch, picks: torch.Tensor) -> None:
        """Append each unfinished row's new token (one read back to the host, two with log-probs)."""
        self.stats.host_reads += 1
        logps = b.last_logps.tolist() if b.last_logps is not None else [None] * len(b.rows)
        for row, tok, lp in zip(b.rows, picks.tolist(), logps):
            if not row.done:
                self.add(row, tok, lp)

    def add(self, row: Row, tok: int, logp: float | None = None) -> bool:
        """Append ``tok`` (and its log-prob, when kept) to ``row``; True when that finished it."""
        params = self.params
        row.tokens.append(tok)
        if logp is not None:
            row.logps.append(logp)
        finish, text = None, None
        if tok in self.eos:
            finish, text = "eos", self.decode(row.tokens[:-1])
        elif stops := self.stops[row.prompt]:
            text = self.decode(row.tokens)
            start = max(0, row.checked - max(len(s) for s in stops) + 1)
            hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
            if hits:
                finish, text = "stop", text[: min(hits)]
            row.checked = len(text)
        if finish is None and len(row.tokens) >= params.max_new_tokens:
            finish, text = "length", text if text is not None else self.decode(row.tokens)
        if finish is not None:
            row.done = True
            self.results[row.prompt][row.sample] = Completion(
                text, len(row.tokens), finish, tuple(row.tokens), tuple(row.logps)
            )
            self.stats.tokens += len(row.tokens)
            self.left[row.prompt] -= 1
            if not self.left[row.prompt]:
                self.bar.update(1)
                self.bar.set_postfix(tok_s=f"{self.stats.tokens / max(time.perf_counter() - self.t0, 1e-9):.0f}")
        return finish is not None

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
