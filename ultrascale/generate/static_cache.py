"""The static KV cache the GPU decoding step runs over (gpt-fast's shape). Every row owns a **slot** of a cache
allocated once per layer ([slots, kv heads, width, head dim]): its prompt's keys and values left-aligned in
columns 0..L-1 (:meth:`StaticSlots.load`, from a prefill), then one column per step at the row's own next column
(``lens``), so no row is padded. The step reads its last tokens and next columns from fixed tensors and builds
its mask from them (:meth:`StaticSlots.forward`): nothing from the host enters it and nothing is read back, so a
CUDA graph can hold it. Live rows move into the lowest slots (:meth:`StaticSlots.move`) so that a smaller
power-of-two bucket (:func:`bucket`) serves a shrinking batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer


def bucket(rows: int) -> int:
    """The power of two at or above ``rows``: the batch sizes a graph is captured for."""
    return 1 << max(rows - 1, 0).bit_length()


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
