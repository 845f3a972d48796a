"""CUDA graphs of the static decoding step, one per power-of-two bucket of rows (vLLM captures one per batch
size the same way). On a GPU a small model's step is launch-bound: SmolLM2-135M's is some 450 kernels of a few
microseconds each, and a captured graph replays them all with one launch (issue 41's eager ~1,000 tokens/s at
32 rows on an H200 was far below what the card reads and computes). CI has no GPU: this is the one part it
cannot run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

log = logging.getLogger("ultrascale")


class DecodeGraphs:
    """One CUDA graph per bucket of the static step, captured on first use over the full width, all sharing one
    memory pool (they are replayed one at a time, and each output is read before the next replay)."""

    def __init__(self, step: Callable[[int], torch.Tensor], autocast: AbstractContextManager | None = None) -> None:
        self.step, self.autocast = step, autocast
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def __call__(self, rows: int) -> torch.Tensor:
        if rows not in self.graphs:
            self.graphs[rows] = self._capture(rows)
        graph, out = self.graphs[rows]
        graph.replay()
        return out

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ctx = self.autocast or nullcontext()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), ctx:  # warm-up: cuBLAS workspaces, kernel choices, the allocator's blocks
            for _ in range(2):
                self.step(rows)  # writes this step's key/value at each row's next column: what the replay writes
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), ctx:
            out = self.step(rows)
        log.debug(f"static decode: captured the step for {rows} rows")
        return graph, out
