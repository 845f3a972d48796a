"""Weighted sources and staged schedules: which source each sample of a step comes from, as a pure function.

A mixture is a set of prepared datasets (sources), each with a share of the training samples, and optionally a
list of stages (SmolLM3-style: a new mixture from a given step on, the last one often an annealing stage). A
step's ``G`` samples (the global batch) are split between the sources by apportionment with carried remainders:
inside a stage, after ``u`` steps source ``i`` has been given within one sample of ``share_i * G * u``, at every
step, not only on average, which a seeded random draw cannot promise. Which slot holds which source is then
shuffled (:meth:`Mixture.slots`), so the set of samples of a step does not depend on dp or gradient accumulation;
a source smaller than its share repeats, epoch after epoch, and its epoch count is reported (:meth:`Mixture.epochs`).
A resume needs the step number and nothing else (:meth:`Mixture.cursors`); the checkpoint still records the
positions so a resume with a mixture that would have read other samples is refused.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

QUANTUM = 1 << 30
"""Shares are held as integers out of this: the apportionment is exact integer arithmetic, the same on every
machine (a float residual would drift differently under another summation order)."""


def _hash(seed: int, step: int, n: int) -> np.ndarray:
    """splitmix64 of (seed, step, slot) for ``n`` slots: the same bits on every machine (uint64 arithmetic wraps)."""
    mult = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB], dtype=np.uint64)
    x = np.arange(n, dtype=np.uint64) + np.array([((seed << 32) ^ step) & (2**64 - 1)], dtype=np.uint64) * mult[0]
    x = (x ^ (x >> np.uint64(30))) * mult[1]
    x = (x ^ (x >> np.uint64(27))) * mult[2]
    return x ^ (x >> np.uint64(31))


def quantize(weights: Sequence[float]) -> tuple[int, ...]:
    """Normalized shares as integers summing to :data:`QUANTUM` (largest remainder; ties to the lower index)."""
    total = math.fsum(weights)
    exact = [w / total * QUANTUM for w in weights]
    q = [math.floor(x) for x in exact]
    order = sorted(range(len(q)), key=lambda i: (-(exact[i] - q[i]), i))
    for i in order[: QUANTUM - sum(q)]:
        q[i] += 1
    return tuple(q)


@dataclass(frozen=True)
class Stage:
    """Data steps ``[start, end)`` (``end`` None: to the end) trained on ``shares`` (one per source, summing to 1)."""

    start: int
    end: int | None
    shares: tuple[float, ...]
    lr: str = "schedule"
    """The lr rule inside the stage: ``schedule`` (the run's) or ``linear_to_zero`` (anneal to 0 at ``end``)."""

    @property
    def quanta(self) -> tuple[int, ...]:
        return quantize(self.shares)


class Mixture:
    """The sources' names and sizes, the stages, the global batch and the seed: every step's samples from them."""

    def __init__(self, names: Sequence[str], sizes: Sequence[int], stages: Sequence[Stage], global_batch: int,
                 seed: int, legacy_seed: bool = False):  # fmt: skip
        if not stages or stages[0].start != 0 or stages[-1].end is not None:
            raise ValueError("stages must start at step 0 and the last one must run to the end")
        self.names, self.sizes = tuple(names), tuple(int(n) for n in sizes)
        self.stages, self.gb, self.seed = tuple(stages), int(global_batch), int(seed)
        self.legacy_seed = legacy_seed and len(names) == 1
        self._quanta = [s.quanta for s in self.stages]
        self._starts = [s.start for s in self.stages]
        k = len(self.names)
        self._cum = np.zeros((1, k), dtype=np.int64)  # _cum[t] = samples taken from each source before step t
        self._resid = [0] * k
        self._slots: tuple[int, np.ndarray, np.ndarray] | None = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def single(cls, size: int, global_batch: int, seed: int) -> Mixture:
        """One source: the order of the loader before mixtures existed (same permutations, same samples)."""
        return cls(["data"], [size], [Stage(0, None, (1.0,))], global_batch, seed, legacy_seed=True)

    # ---- how many samples each source gives each step ---------------------------------------------
    def stage_index(self, step: int) -> int:
        return int(np.searchsorted(self._starts, step, side="right") - 1)

    def _extend(self, upto: int) -> None:
        """Apportion steps ``len(_cum)-1 .. upto-1``: each source gets the floor of its carried target, the
        leftover samples go to the largest remainders (ties to the lower index)."""
        rows, t, G = [], len(self._cum) - 1, self.gb
        cum = [int(c) for c in self._cum[-1]]
        while t < upto:
            s = self.stage_index(t)
            if t == self._starts[s]:
                self._resid = [0] * len(cum)  # each stage apportions its own samples from its first step
            d = [r + w * G for r, w in zip(self._resid, self._quanta[s])]
            n = [max(x // QUANTUM, 0) for x in d]
            left = G - sum(n)
            rem = sorted(range(len(n)), key=lambda i: (-(d[i] - n[i] * QUANTUM), i))
            for i in rem[:left]:
                n[i] += 1
            self._resid = [x - c * QUANTUM for x, c in zip(d, n)]
            cum = [a + b for a, b in zip(cum, n)]
            rows.append(cum)
            t += 1
        if rows:
            self._cum = np.concatenate([self._cum, np.asarray(rows, dtype=np.int64)])

    def cursors(self, step: int) -> np.ndarray:
        """Samples taken from each source before data step ``step`` (its position in every source): it follows
        from the weights and the stage table alone."""
        if step >= len(self._cum):  # ahead, in blocks: one growth per step would copy the table every step
            self._extend(max(step, 2 * len(self._cum), len(self._cum) + 1024))
        return self._cum[step].copy()

    def counts(self, step: int) -> np.ndarray:
        """Samples each source gives data step ``step``."""
        return self.cursors(step + 1) - self.cursors(step)

    # ---- which rows --------------------------------------------------------------------------------
    def slots(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, row) for each of the step's ``G`` slots; slot order is what ranks and micro-batches split.

        Each source's positions are taken in order, then the slots are shuffled by a hash of (seed, step, slot):
        a few microseconds, where a seeded generator per step costs more than the gather it feeds. Every rank and
        micro-batch sees a mix. Source ``i``'s ``j``-th sample overall is row ``perm_i(j // n_i)[j % n_i]``, a
        per-epoch permutation of its ``n_i`` rows."""
        if self._slots is not None and self._slots[0] == step:
            return self._slots[1], self._slots[2]
        if step + 1 >= len(self._cum):
            self.cursors(step + 1)
        start, counts = self._cum[step], self._cum[step + 1] - self._cum[step]
        src = np.repeat(np.arange(len(self.names), dtype=np.int64), counts)
        rows = np.concatenate([self._run(i, lo, c) for i, (lo, c) in enumerate(zip(start.tolist(), counts.tolist()))])
        if len(self.names) > 1:
            order = np.argsort(_hash(self.seed, step, self.gb), kind="stable")
            src, rows = src[order], rows[order]
        self._slots = (step, src, rows)
        return src, rows

    def _run(self, source: int, lo: int, count: int) -> np.ndarray:
        """Rows of positions ``[lo, lo + count)`` of ``source``: slices of its epochs' permutations."""
        n, parts = self.sizes[source], []
        while count > 0:
            epoch, r = divmod(lo, n)
            take = min(count, n - r)
            parts.append(self._perm(source, epoch)[r : r + take])
            lo, count = lo + take, count - take
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.names):
                self._perms.clear()
            seed = (
                [self.seed, epoch] if self.legacy_seed else [self.seed, zlib.crc32(self.names[source].encode()), epoch]
            )
            self._perms[key] = np.random.default_rng(seed).permutation(self.sizes[source])
        return self._perms[key]

    # ---- what was read -------------------------------------------------------------------------------
    def epochs(self, step: int) -> np.ndarray:
        """Passes over each source before data step ``step`` (1.0 = every row once)."""
        return self.cursors(step) / np.asarray(self.sizes, dtype=np.float64)

    def realized(self, step: int) -> dict:
        """Per source, at data step ``step``: samples read so far, and inside the current stage the share read
        against the share asked (the first thing to look at when a mixture seems off)."""
        s = self.stage_index(max(step - 1, 0))
        cur, base = self.cursors(step), self.cursors(self.stages[s].start)
        in_stage = cur - base
        total = max(int(in_stage.sum()), 1)
        return {"stage": s, "samples": cur, "share": in_stage / total, "asked": np.asarray(self.stages[s].shares)}

    def mix(self, step: int) -> dict[str, float]:
        """Share of every source among all samples read before data step ``step`` (the run's realized mixture)."""
        cur = self.cursors(step)
        total = max(int(cur.sum()), 1)
        return {n: float(c) / total for n, c in zip(self.names, cur)}

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier on the schedule's lr at optimizer step ``step`` from its stage's rule: ``linear_to_zero``
        falls from 1 at the stage's first step to 0 at its end (the last stage ends with the run)."""
        st = self.stages[self.stage_index(step)]
        if st.lr != "linear_to_zero":
            return 1.0
        end = st.end if st.end is not None else total_steps
        return max(end - step, 0) / max(end - st.start, 1)
