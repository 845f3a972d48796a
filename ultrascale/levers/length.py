"""How long a run is: ``train.steps``, or ``train.tokens`` turned into steps, and what a resume under another
global batch does to both.

Scaling laws, budgets and papers count tokens; the engine counts optimizer steps, each ``data.global_batch x
data.seq_len`` tokens. ``train.tokens=2B`` sets ``train.steps`` to the steps that train at least that many tokens
(the last step rounds up), and the lr schedule, whose length defaults to ``train.steps``, follows; a warmup given
as ``optim.sched.warmup_tokens`` converts the same way. When ``train.tokens`` is set it decides the length: the
``train.steps`` a recipe or an override gives is replaced, and the banner prints both.

A resume under another global batch (same world size, another ``data.global_batch``) keeps what the run was
asked for: every checkpoint records the run's batch history, so the tokens trained by any step are known exactly
(:func:`on_resume`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ultrascale.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from ultrascale.config.data import DataConfig
    from ultrascale.config.root import RootConfig

SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
"""Decimal, as token counts are written (2B = 2e9; ``G`` is read as ``B``)."""


def parse_tokens(value: Any, key: str = "train.tokens") -> int:
    """A token count from ``20480``, ``500M``, ``2B``, ``1.5T``, ``2e9`` or ``2_000_000`` (at least 1)."""
    text = str(value).strip().replace("_", "").replace(",", "")
    m = re.fullmatch(r"(\d+(?:\.\d*)?(?:[eE]\+?\d+)?)\s*([kKmMbBgGtT]?)", text)
    n = float(m.group(1)) * SUFFIXES[m.group(2).upper()] if m else 0.0
    if not m or n < 1 or n != int(n):
        raise ConfigError(f"{key}={value} is not a whole number of tokens: use e.g. {key}=2B, 500M or 20480")
    return int(n)


def tokens_per_step(data: DataConfig) -> int:
    return int(data.global_batch) * int(data.seq_len)


def resolve(cfg: RootConfig) -> None:
    """``train.tokens`` -> ``train.steps`` and ``optim.sched.warmup_tokens`` -> ``warmup_steps``, in place, before
    any rule reads them (idempotent: the validator, the dry run and the planner may each call it)."""
    per = tokens_per_step(cfg.data)
    if getattr(cfg.train, "tokens", None) is not None:
        cfg.train.steps = max(1, math.ceil(parse_tokens(cfg.train.tokens) / per))
    sched = cfg.optim.sched
    if getattr(sched, "warmup_tokens", None) is not None:
        sched.warmup_steps = math.ceil(parse_tokens(sched.warmup_tokens, "optim.sched.warmup_tokens") / per)


def describe(cfg: RootConfig) -> str:
    """The banner's and the dry run's length line: both units, and which one was asked for."""
    per, steps = tokens_per_step(cfg.data), int(cfg.train.steps)
    if getattr(cfg.train, "tokens", None) is None:
        return f"{steps:,} steps (train.steps) x {per:,} tokens/step = {steps * per:,} tokens"
    asked = parse_tokens(cfg.train.tokens)
    over = steps * per - asked
    tail = f" (the last step rounds up: {steps * per:,} trained)" if over > 0 else ""
    return f"{asked:,} tokens (train.tokens={cfg.train.tokens}) = {steps:,} steps x {per:,} tokens/step{tail}"


# ---- the batch history a checkpoint records ----------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """From optimizer step ``start`` on, each step was ``global_batch`` samples of ``seq_len`` tokens."""

    start: int
    global_batch: int
    seq_len: int

    @property
    def per_step(self) -> int:
        return self.global_batch * self.seq_len


def record(cfg: RootConfig, history: list[Segment] | None = None) -> dict:
    """``meta["length"]`` of every checkpoint: the asked tokens (None: steps were asked) and the batch history."""
    history = history or [Segment(0, int(cfg.data.global_batch), int(cfg.data.seq_len))]
    tokens = parse_tokens(cfg.train.tokens) if getattr(cfg.train, "tokens", None) is not None else None
    return {"tokens": tokens, "history": [[s.start, s.global_batch, s.seq_len] for s in history]}


def history_of(meta: dict) -> list[Segment] | None:
    """The checkpoint's batch history (None for a checkpoint written before it was recorded)."""
    rows = (meta.get("length") or {}).get("history")
    return [Segment(*map(int, r)) for r in rows] if rows else None


def history_for(meta: dict, cfg: RootConfig) -> list[Segment]:
    """The checkpoint's batch history; for one written before it was recorded, its one batch from step 0."""
    old = batch_changed(meta, cfg.data)
    gb, seq = (old.global_batch, old.seq_len) if old else (int(cfg.data.global_batch), int(cfg.data.seq_len))
    return history_of(meta) or [Segment(0, gb, seq)]


def tokens_at(history: list[Segment], step: int) -> int:
    """Tokens trained by the first ``step`` optimizer steps."""
    total = 0
    for i, s in enumerate(history):
        end = history[i + 1].start if i + 1 < len(history) else None
        if step <= s.start:
            break
        total += (min(step, end) - s.start if end is not None else step - s.start) * s.per_step
    return total


def continued(history: list[Segment], step: int, data: DataConfig) -> list[Segment]:
    """The history after resuming at ``step`` under ``data``'s batch (a new segment only if the batch changed)."""
    now = Segment(step, int(data.global_batch), int(data.seq_len))
    kept = [s for s in history if s.start < step]
    last = kept[-1] if kept else None
    if last is not None and (last.global_batch, last.seq_len) == (now.global_batch, now.seq_len):
        return kept
    return [*kept, now]


def schedule_position(history: list[Segment], step: int, by_tokens: bool) -> float | int:
    """Where optimizer step ``step`` is on the lr schedule: the step itself, or with ``train.tokens`` and a batch
    change behind it, the tokens trained before it in the first batch's steps (the schedule's unit)."""
    if not by_tokens or len(history) < 2:
        return step
    return tokens_at(history, step) / history[0].per_step


# ---- a resume -----------------------------------------------------------------------------------------------
def batch_changed(meta: dict, data: DataConfig) -> Segment | None:
    """The checkpoint's last batch when a run with ``data``'s batch resumes it under another one (None: same batch,
    or unknown)."""
    history = history_of(meta)
    if history is not None:
        last = history[-1]
        return last if (last.global_batch, last.seq_len) != (data.global_batch, data.seq_len) else None
    cursors = meta.get("data_cursors") or {}  # an older checkpoint: its one source's position tells the old batch
    data_step = int(meta.get("step", 0)) + int(meta.get("data_offset", 0))
    if len(cursors) != 1 or data_step == 0:
        return None
    samples = int(next(iter(cursors.values())))
    if samples == data_step * int(data.global_batch) or samples % data_step:
        return None
    return Segment(0, samples // data_step, int(data.seq_len))


def convert_offset(step: int, offset: int, from_gb: int, data: DataConfig, tag: str) -> int:
    """A data offset counted in ``from_gb``-sample steps, in this run's: data step ``step + offset`` of the new
    batch starts at the sample the old one reached (one source is addressed by sample: its epochs' permutations do
    not depend on the batch). Raises where no whole offset does."""
    gb = int(data.global_batch)
    if from_gb == gb:
        return offset
    samples = (step + offset) * from_gb
    if samples % gb:
        raise CheckpointError(
            f"data.global_batch={gb} cannot continue checkpoint {tag}'s data: it had read {samples:,} samples, not "
            f"a whole number of {gb}-sample batches; resume with data.global_batch={from_gb} or one dividing "
            f"{samples:,}"
        )
    return samples // gb - step


def on_resume(cfg: RootConfig, meta: dict, tag: str) -> list[str]:
    """Before the resume's other checks: refuse a batch change the data cannot follow, or adjust this run to it
    (``train.tokens``: the steps that train the rest, the schedule pinned to the checkpoint's steps). Returns the
    changes, in words.

    A resume under another global batch (same world size, more or fewer accumulation steps): the checkpoint's batch
    history (the step each global batch started at) gives the tokens trained by any step. With ``train.tokens``
    the resumed run takes the steps that train the rest of them, and the lr schedule keeps its curve over tokens:
    its steps stay the first batch's (``optim.sched.total_steps`` and ``warmup_steps`` are pinned to the
    checkpoint's) and the trainer reads the schedule at the tokens trained (:func:`schedule_position`). With
    ``train.steps`` the step count is kept. Either way the data goes on from the sample the checkpoint reached: one
    source is addressed by sample, so the step offset is converted; where it cannot be (a mixture apportions each
    step's batch between its sources, or the samples read are not a whole number of new batches) the resume is
    refused in one line."""
    from ultrascale.data.sources import is_mixture

    old = batch_changed(meta, cfg.data)
    if old is None:
        return []
    step, gb, seq = int(meta.get("step", 0)), int(cfg.data.global_batch), int(cfg.data.seq_len)
    if is_mixture(cfg.data) or len(meta.get("data_cursors") or {}) > 1:
        raise CheckpointError(
            f"data.global_batch={gb} cannot continue checkpoint {tag}'s data mixture: each step's "
            f"{old.global_batch} samples were apportioned between its sources, so no step of {gb} starts where it "
            f"stopped; resume with data.global_batch={old.global_batch}"
        )
    convert_offset(step, int(meta.get("data_offset", 0)), old.global_batch, cfg.data, tag)  # raises where it cannot
    change = f"data.global_batch {old.global_batch} -> {gb}" + (f", data.seq_len {old.seq_len} -> {seq}"
                                                                  if old.seq_len != seq else "")  # fmt: skip
    if getattr(cfg.train, "tokens", None) is None:
        return [f"{change} at step {step}: train.steps={cfg.train.steps} kept (steps were asked, so the run now "
                "trains another number of tokens); the data goes on from the sample it reached"]  # fmt: skip
    history = history_of(meta)
    if history is None:
        raise CheckpointError(
            f"train.tokens={cfg.train.tokens} with {change}: checkpoint {tag} predates the batch history a token "
            f"count is kept by; resume with data.global_batch={old.global_batch}"
        )
    asked, done = parse_tokens(cfg.train.tokens), tokens_at(history, step)
    cfg.train.steps = step + max(0, math.ceil((asked - done) / (gb * seq)))
    saved, sched = meta.get("schedule") or {}, cfg.optim.sched
    if saved.get("total_steps") is not None:
        sched.total_steps = int(saved["total_steps"])
    if saved.get("warmup_steps") is not None:
        sched.warmup_steps = int(saved["warmup_steps"])
    return [f"{change} at step {step}: train.tokens={cfg.train.tokens} kept: {done:,} tokens trained, "
            f"{max(0, asked - done):,} left = {cfg.train.steps - step:,} more steps of {gb * seq:,} tokens "
            f"(train.steps {cfg.train.steps}); the lr schedule keeps its curve over tokens, in the first batch's "
            f"steps (optim.sched.total_steps={sched.total_steps}, warmup_steps={sched.warmup_steps}); the data "
            "goes on from the sample it reached"]  # fmt: skip
