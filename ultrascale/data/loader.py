"""Deterministic batches over packed shards, addressed by (step, micro-step, rank).

The sample a rank reads is a pure function of the step, so resuming needs only the step number:
no iterator state, no sampler state, nothing lost or repeated. Each optimizer step consumes the
contiguous range [step*G, (step+1)*G) of a per-epoch permutation (G = global batch), split over
micro-steps and data-parallel ranks. The set of samples per step is therefore the same for any
(dp, grad-accum) layout with the same G, which is what lets a universal checkpoint resume on a
different world size and still see exactly the data it would have seen.
"""

from __future__ import annotations

import numpy as np
import torch

from ultrascale.data.shards import SplitReader


class StepBatches:
    def __init__(self, reader: SplitReader, micro_batch: int, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        self.reader = reader
        self.mb = micro_batch
        self.gb = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.n = len(reader)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def grad_accum(self) -> int:
        return self.gb // (self.mb * self.dp_size)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._perms[epoch]

    def positions(self, step: int, micro: int) -> np.ndarray:
        start = step * self.gb + micro * self.mb * self.dp_size + self.dp_rank * self.mb
        return np.arange(start, start + self.mb, dtype=np.int64)

    def indices(self, step: int, micro: int) -> np.ndarray:
        pos = self.positions(step, micro)
        return np.array([self._perm(int(p // self.n))[p % self.n] for p in pos], dtype=np.int64)

    def get(self, step: int, micro: int) -> torch.Tensor:
        return torch.from_numpy(self.reader.get(self.indices(step, micro)))

    def epoch(self, step: int) -> float:
        return step * self.gb / self.n


def eval_batches(reader: SplitReader, micro_batch: int, num_batches: int, dp_rank: int, dp_size: int):
    """The same held-out samples at every evaluation (first ones in file order), split over ranks."""
    # Every rank must run the same number of forwards (ZeRO-3 gathers weights collectively in forward).
    batches = min(num_batches, len(reader) // (micro_batch * dp_size))
    total = batches * micro_batch * dp_size
    mine = np.arange(dp_rank, total, dp_size, dtype=np.int64)
    for i in range(0, len(mine), micro_batch):
        yield torch.from_numpy(reader.get(mine[i : i + micro_batch]))
