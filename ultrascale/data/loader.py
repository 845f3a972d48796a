"""Deterministic batches over packed shards, addressed by (step, micro-step, rank).

The sample a rank reads is a pure function of the step, so resuming needs only the step number:
no iterator state, no sampler state, nothing lost or repeated. Each optimizer step consumes the
contiguous range [step*G, (step+1)*G) of a per-epoch permutation (G = global batch), split over
micro-steps and data-parallel ranks. The set of samples per step is therefore the same for any
(dp, grad-accum) layout with the same G, which is what lets a universal checkpoint resume on a
different world size and still see exactly the data it would have seen. Packed rows hold several
documents joined by EOS; with document masking (the default) each is trained as if it were alone
(:func:`make_batch`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ultrascale.data.mixture import Mixture
from ultrascale.data.shards import SplitReader

IGNORE = -100
"""Label value for 'not a target' (HF's and torch's cross-entropy ignore_index)."""
TRACE_ENV = "ULTRASCALE_TRACE_SAMPLES"
"""Test hook: a directory where each rank appends the sample indices it reads (``rankNNNNN.jsonl``, one line
per micro-batch), so tests can check what was trained on, not the offset arithmetic that chose it."""


@dataclass
class Batch:
    """One micro-batch as the model consumes it (HF conventions: labels are unshifted, -100 = no target)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for an HF causal LM (and a DeepSpeed engine wrapping one)."""
        kw = {"input_ids": self.input_ids, "labels": self.labels}
        if self.position_ids is not None:
            kw["position_ids"] = self.position_ids
        return kw

    def pinned(self) -> Batch:
        """The micro-batch in page-locked host memory (a CUDA run's copy to the device is then asynchronous)."""
        from ultrascale.runtime.device import pin

        return Batch(*(None if t is None else pin(t) for t in (self.input_ids, self.labels, self.position_ids)))

    def flattened(self) -> Batch:
        """The micro-batch as one [1, b*s] row: what varlen FlashAttention needs to see document boundaries.

        HF's flash-attention path derives cu_seqlens from position ids only when the batch has one row;
        with several rows it would run plain causal attention across documents.
        """
        flat = [None if t is None else t.reshape(1, -1) for t in (self.input_ids, self.labels, self.position_ids)]
        return Batch(*flat)

    @property
    def num_targets(self) -> int:
        return int((self.labels[:, 1:] != IGNORE).sum())


def make_batch(ids: np.ndarray, loss_mask: np.ndarray | None, eos_id: int | None, document_masking: bool) -> Batch:
    """Labels and position ids for packed rows ``ids`` [b, s] (int64).

    With ``document_masking`` each document of a row is trained as if it were alone: position ids restart after
    every EOS, attention does not cross a document boundary, and the first token of a document is not a target
    (nothing in its own document predicts it). That is padding-free packing: no compute is spent on pad tokens,
    and no token learns from an unrelated file that happened to precede it in the row."""
    input_ids = torch.from_numpy(ids)
    labels = input_ids.clone()
    if loss_mask is not None:
        labels[~torch.from_numpy(loss_mask)] = IGNORE
    if not document_masking or eos_id is None:
        return Batch(input_ids, labels)
    b, s = input_ids.shape
    idx = torch.arange(s).expand(b, s)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id  # a document starts right after an EOS
    last_start = torch.where(starts, idx, 0).cummax(dim=1).values
    labels[starts] = IGNORE
    return Batch(input_ids, labels, (idx - last_start).contiguous())


class StepBatches:
    """The micro-batches of a step, for one data-parallel rank, from one prepared split or a mixture of several.

    ``readers`` is one split, or one per source of ``mixture`` (same order). Slots ``[micro*mb*dp + rank*mb,
    + mb)`` of the step's ``G`` are this rank's, and what fills a slot is :meth:`Mixture.slots`."""

    def __init__(
        self,
        readers: SplitReader | Sequence[SplitReader],
        micro_batch: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        eos_id: int | None = None,
        document_masking: bool = False,
        mixture: Mixture | None = None,
    ):
        self.readers = [readers] if isinstance(readers, SplitReader) else list(readers)
        self.reader = self.readers[0]
        self.mb = micro_batch
        self.gb = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.eos_id = eos_id
        self.document_masking = document_masking
        self.mixture = mixture or Mixture.single(len(self.reader), global_batch, seed)
        if len(self.readers) != len(self.mixture.names):
            raise ValueError(f"{len(self.readers)} readers for the {len(self.mixture.names)} sources of the mixture")
        self._trace = None
        # The sources' shards as one reader: a (source, row) is row base[source] + row of it, so a mixed
        # micro-batch is one gather, as cheap as a single source's (per-source gathers cost ~25 % of loader speed).
        sizes = [len(r) for r in self.readers]
        self._base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        masks = [r.masks for r in self.readers]
        self._joined = SplitReader(
            self.reader.root, self.reader.name, self.reader.seq_len, [a for r in self.readers for a in r.arrays],
            np.concatenate([[0], np.cumsum([a.shape[0] for r in self.readers for a in r.arrays])]).astype(np.int64),
            [m for ms in masks for m in ms] if all(m is not None for m in masks) else None,
        )  # fmt: skip
        self._some_masked = any(m is not None for m in masks) and self._joined.masks is None

    def trace_to(self, directory: str | os.PathLike, rank: int) -> None:
        """Append every read's indices to ``directory/rankNNNNN.jsonl`` (see TRACE_ENV)."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._trace = open(Path(directory) / f"rank{rank:05d}.jsonl", "a")  # noqa: SIM115 (lives with the loader)

    @property
    def grad_accum(self) -> int:
        return self.gb // (self.mb * self.dp_size)

    def positions(self, step: int, micro: int) -> np.ndarray:
        """This rank's slots of the step's ``G`` for micro-batch ``micro``."""
        start = micro * self.mb * self.dp_size + self.dp_rank * self.mb
        return np.arange(start, start + self.mb, dtype=np.int64)

    def sources_and_indices(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        """(source number, row in that source's split) for each sample of this rank's micro-batch."""
        src, rows = self.mixture.slots(step)
        mine = self.positions(step, micro)
        return src[mine], rows[mine]

    def indices(self, step: int, micro: int) -> np.ndarray:
        return self.sources_and_indices(step, micro)[1]

    def get(self, step: int, micro: int) -> Batch:
        src, idx = self.sources_and_indices(step, micro)
        if self._trace is not None:
            line = {"data_step": step, "micro": micro, "indices": idx.tolist()}
            if len(self.readers) > 1:
                line["sources"] = [self.mixture.names[i] for i in src]
            self._trace.write(json.dumps(line) + "\n")
            self._trace.flush()
        if not self._some_masked:
            rows = self._base[src] + idx
            return make_batch(self._joined.get(rows), self._joined.get_loss_mask(rows), self.eos_id,
                              self.document_masking)  # fmt: skip
        # supervised and pretraining sources mixed: the unmasked ones train on every token
        ids = np.empty((len(idx), self.reader.seq_len), dtype=np.int64)
        mask = np.ones(ids.shape, dtype=bool)
        for i in np.unique(src):
            here = src == i
            reader = self.readers[int(i)]
            ids[here] = reader.get(idx[here])
            if reader.has_loss_mask:
                mask[here] = reader.get_loss_mask(idx[here])
        return make_batch(ids, mask, self.eos_id, self.document_masking)

    def epoch(self, step: int) -> float:
        """Passes over the data before data step ``step``: samples read over rows held, all sources together."""
        return float(self.mixture.cursors(step).sum()) / sum(self.mixture.sizes)


def eval_batches(
    reader: SplitReader,
    micro_batch: int,
    num_batches: int,
    dp_rank: int,
    dp_size: int,
    eos_id: int | None = None,
    document_masking: bool = False,
):
    """The same held-out samples at every evaluation (first ones in file order), split over ranks.
    ``num_batches=0``: every sample, rank ``r`` taking samples ``r, r + dp, ...``; the short last micro-batches are
    filled with rows whose loss mask is all false (no targets), so every rank runs the same number of forwards."""
    if num_batches == 0:
        n = len(reader)
        batches = -(-(-(-n // dp_size)) // micro_batch)  # ceil(ceil(n / dp) / micro_batch), the same on every rank
        mine = np.arange(dp_rank, n, dp_size, dtype=np.int64)
        for i in range(batches):
            idx = mine[i * micro_batch : (i + 1) * micro_batch]
            pad = micro_batch - len(idx)
            if pad == 0:
                yield make_batch(reader.get(idx), reader.get_loss_mask(idx), eos_id, document_masking)
                continue
            filler = np.zeros(pad, dtype=np.int64)  # sample 0 again, with no targets
            full = np.concatenate([idx, filler])
            mask = reader.get_loss_mask(full)
            mask = np.ones((micro_batch, reader.seq_len), dtype=bool) if mask is None else mask.copy()
            mask[len(idx) :] = False
            yield make_batch(reader.get(full), mask, eos_id, document_masking)
        return
    # Every rank must run the same number of forwards (ZeRO-3 gathers weights collectively in forward).
    batches = min(num_batches, len(reader) // (micro_batch * dp_size))
    total = batches * micro_batch * dp_size
    mine = np.arange(dp_rank, total, dp_size, dtype=np.int64)
    for i in range(0, len(mine), micro_batch):
        idx = mine[i : i + micro_batch]
        yield make_batch(reader.get(idx), reader.get_loss_mask(idx), eos_id, document_masking)
