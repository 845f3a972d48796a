"""The dynamic path's KV cache: one :class:`SlotLayer` per layer, written in place into a buffer with room for
every token the batch can still generate (HF's ``DynamicLayer`` concatenates, re-allocating the whole cache at
every step). The batch scheduler rebuilds it when rows leave or join."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's keys and values for the rows in flight. ``keys``/``values`` are views of the filled part."""

    def __init__(self) -> None:
        super().__init__()
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None
        self.length = 0
        self.room = 0

    def reserve(self, room: int) -> None:
        """Make sure ``room`` more positions fit (set before a prefill or a merge)."""
        self.room = room

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.length + q
        if self.k_buf is None or end > self.k_buf.shape[-2] or self.k_buf.shape[0] != key_states.shape[0]:
            cap = end + max(self.room, 1)
            k = key_states.new_empty((*key_states.shape[:2], cap, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
            if self.k_buf is not None and self.length:
                k[:, :, : self.length] = self.k_buf[:, :, : self.length]
                v[:, :, : self.length] = self.v_buf[:, :, : self.length]
            self.k_buf, self.v_buf = k, v
        self.k_buf[:, :, self.length : end] = key_states
        self.v_buf[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.k_buf[:, :, :end], self.v_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def rebuild(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the contents with ``k``/``v`` [rows, heads, length, dim], keeping ``room`` free positions."""
        n = k.shape[-2]
        self.k_buf = k.new_empty((*k.shape[:2], n + max(self.room, 1), k.shape[-1]))
        self.v_buf = v.new_empty((*v.shape[:2], n + max(self.room, 1), v.shape[-1]))
        self.k_buf[:, :, :n], self.v_buf[:, :, :n] = k, v
        self.length = n
        self.keys, self.values = self.k_buf[:, :, :n], self.v_buf[:, :, :n]
        self.is_initialized = True


def new_cache(layers: int) -> Cache:
    return Cache(layers=[SlotLayer() for _ in range(layers)])
