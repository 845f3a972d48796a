"""The sampler's decoding step over a static KV cache, replayed as CUDA graphs in power-of-two batch buckets
(gpt-fast's shape; vLLM captures one graph per batch size the same way).

Why: on a GPU a small model's decoding step is launch-bound. SmolLM2-135M's step is some 450 kernels of a few
microseconds each, and the eager sampler reached ~1,000 tokens/s on an H200 at 32 rows (issue 41), far below
what the card reads and computes. A captured CUDA graph replays every kernel of the step with one launch, but
only if each tensor the step touches lives at a fixed address and nothing inside it waits for the host. So:

- every row owns a **slot** of a cache allocated once per layer ([slots, kv heads, width, head dim]): its
  prompt's keys and values left-aligned in columns 0..L-1 (written by :meth:`StaticSlots.load` from a prefill),
  then one column per step at the row's own next column (``lens``). Positions are columns, so no row is padded;
- the step reads the last tokens and next columns from fixed tensors and builds its attention mask from them
  (column <= own next column), so no host value enters it (:meth:`StaticSlots.forward`);
- the rows the step computes are rounded up to a power of two (:func:`bucket`), one graph per bucket, all in one
  memory pool and over the same buffers (slot views), so a batch that shrinks after its last refill replays a
  smaller graph once its live rows are moved into the lowest slots (:meth:`StaticSlots.move`);
- prefill stays eager (its shapes change with every group of prompts), as in gpt-fast.

On CPU the same step runs eagerly over the columns in use (no graphs: there are no kernel launches to save).
:func:`decide_static` says which path runs and why; the sampler (``ultrascale/generate.py``) owns the rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers.cache_utils import Cache, DynamicLayer

log = logging.getLogger("ultrascale")

STATIC_CHOICES = ("auto", "on", "eager", "off")
SYNC_EVERY_CUDA = 8
"""Steps between host reads of the new tokens on a GPU: the host checks stop sequences while the next steps run.
A row that finished mid-window computes at most this many steps too many; its text is cut where it stopped."""


def bucket(rows: int) -> int:
    """The power of two at or above ``rows``: the batch sizes a graph is captured for."""
    return 1 << max(rows - 1, 0).bit_length()


def decide_static(device: torch.device, asked: str, plain_head: bool, sdpa: bool) -> tuple[bool, bool, str]:
    """(static cache on, CUDA graphs on, why), decided once per sampler.

    ``auto``: on CUDA both (the step is launch-bound there); on CPU neither, since a CPU has no launches to save
    and the dynamic path's prompt-lookup drafting decodes several tokens per step (``make bench-generate``
    measures both). ``on``: the static cache, with graphs where CUDA is. ``eager``: the static cache, no graphs.
    The static step computes the head itself and hands SDPA a boolean mask, so it needs both."""
    if asked not in STATIC_CHOICES:
        raise ValueError(f"static={asked!r}: choose one of {', '.join(STATIC_CHOICES)}")
    if asked == "off":
        return False, False, "off (static=off)"
    if not (plain_head and sdpa):
        return False, False, ("off: the static step needs a causal LM whose logits are a plain head product "
                              "and SDPA attention (the dynamic path serves this model)")  # fmt: skip
    cuda = device.type == "cuda"
    if asked == "eager":
        return True, False, "static cache, eager steps (static=eager)"
    if cuda:
        return True, True, "static cache + CUDA graphs per power-of-two bucket (decoding is launch-bound on a GPU)"
    if asked == "on":
        return True, False, "static cache, eager steps (CPU: no CUDA graphs)"
    return False, False, ("off on CPU: no kernel launches to save, and the dynamic path drafts several tokens "
                          "per step (static=on runs the static cache here)")  # fmt: skip


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _SlotView(DynamicLayer):
    """One layer of :class:`StaticSlots` as HF's cache protocol sees it for one step: ``update`` writes the step's
    key/value of row r at column ``lens[r]`` (in place, no host value) and returns the first ``width`` columns of
    the first ``rows`` slots."""

    def __init__(self, slots: StaticSlots, layer: int, rows: int, width: int) -> None:
        super().__init__()
        self.slots, self.layer, self.rows, self.width = slots, layer, rows, width
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        s, b = self.slots, self.rows
        k, v = s.k[self.layer], s.v[self.layer]
        k[s.row_ids[:b], :, s.lens[:b]] = key_states[:, :, 0]
        v[s.row_ids[:b], :, s.lens[:b]] = value_states[:, :, 0]
        self.keys, self.values = k[:b, :, : self.width], v[:b, :, : self.width]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.width


class StaticSlots:
    """The static cache and the step's fixed inputs: per layer K and V [slots, kv heads, width, head dim], and per
    slot the last token, the next column (``lens``), the sample's noise key and step. ``host_lens`` mirrors
    ``lens`` on the host (it changes by known amounts), so nothing is read back to size an eager step."""

    def __init__(self, layers: int, slots: int, width: int, device: torch.device) -> None:
        self.layers, self.slots, self.width, self.device = layers, slots, width, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        zeros = lambda: torch.zeros(slots, dtype=torch.long, device=device)  # noqa: E731
        self.tok, self.lens, self.keys, self.steps = zeros(), zeros(), zeros(), zeros()
        self.row_ids = torch.arange(slots, device=device)
        self.cols = torch.arange(width, device=device)
        self.host_lens = [0] * slots
        self._views: dict[tuple[int, int], Cache] = {}

    def fits(self, layers: int, slots: int, width: int, device: torch.device) -> bool:
        return (self.layers, self.device) == (layers, device) and self.slots >= slots and self.width >= width

    def _allocate(self, like: torch.Tensor) -> None:
        heads, dim = like.shape[1], like.shape[3]
        for _ in range(self.layers):
            self.k.append(like.new_zeros((self.slots, heads, self.width, dim)))
            self.v.append(like.new_zeros((self.slots, heads, self.width, dim)))

    def load(self, dst: list[int], cache: Cache, src: list[int], lengths: list[int], tokens: torch.Tensor,
             keys: list[int], steps: list[int]) -> None:  # fmt: skip
        """Rows ``src`` of a prefill's cache (left-padded to its width) into slots ``dst``, left-aligned: slot
        column j takes prefill column j + padding. Columns past a row's length hold junk the mask never shows."""
        first = cache.layers[0].keys
        if not self.k:
            self._allocate(first)
        n = first.shape[2]
        src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        shift = torch.tensor([n - length for length in lengths], device=self.device)
        cols = (torch.arange(n, device=self.device)[None, :] + shift[:, None]).clamp(max=n - 1)
        for li, layer in enumerate(cache.layers):
            for buf, part in ((self.k[li], layer.keys), (self.v[li], layer.values)):
                rows = part[src_t]
                buf[dst_t, :, :n] = rows.gather(2, cols[:, None, :, None].expand(-1, rows.shape[1], -1, rows.shape[3]))
        self.tok[dst_t] = tokens.to(self.device)
        self.lens[dst_t] = torch.tensor(lengths, device=self.device)
        self.keys[dst_t] = torch.tensor(keys, device=self.device)
        self.steps[dst_t] = torch.tensor(steps, device=self.device)
        for d, length in zip(dst, lengths):
            self.host_lens[d] = length

    def move(self, src: list[int], dst: list[int]) -> None:
        """Slots ``src`` into slots ``dst`` (a compaction: live rows into the lowest slots)."""
        src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for buf in (*self.k, *self.v, self.tok, self.lens, self.keys, self.steps):
            buf[dst_t] = buf[src_t]
        lens = [self.host_lens[s] for s in src]
        for d, length in zip(dst, lens):
            self.host_lens[d] = length

    def free(self, slots: list[int]) -> None:
        """A finished row's slot goes on being computed until a refill or compaction: keep its column in range."""
        self.lens[torch.tensor(slots, device=self.device)] = 0
        for s in slots:
            self.host_lens[s] = 0

    def advance(self, rows: int, picks: torch.Tensor) -> None:
        """After a step: the picks are the next inputs, every row moves one column on (device and host mirror)."""
        self.tok[:rows] = picks
        self.lens[:rows] += 1
        self.steps[:rows] += 1
        for s in range(rows):
            self.host_lens[s] += 1

    def view(self, rows: int, width: int) -> Cache:
        if (rows, width) not in self._views:
            self._views[rows, width] = Cache(layers=[_SlotView(self, li, rows, width) for li in range(self.layers)])
        return self._views[rows, width]

    def forward(self, base: torch.nn.Module, head: Callable[[torch.Tensor], torch.Tensor], rows: int,
                width: int) -> torch.Tensor:  # fmt: skip
        """One decoding step of the first ``rows`` slots over the first ``width`` columns: fp32 logits
        [rows, vocab]. Reads only fixed tensors and host ints, and reads nothing back: capturable."""
        lens = self.lens[:rows, None]
        mask = (self.cols[None, :width] <= lens)[:, None, None, :]
        h = base(input_ids=self.tok[:rows, None], attention_mask=mask, position_ids=lens,
                 past_key_values=self.view(rows, width), use_cache=True).last_hidden_state[:, -1]  # fmt: skip
        return head(h)


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
