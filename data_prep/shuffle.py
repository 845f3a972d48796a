"""A seeded permutation of [0, n) evaluated pointwise: a shard writer asks where its samples come from.

A global shuffle of N packed samples normally materialises ``permutation(N)`` (8 bytes a sample, in one
process). Here the permutation is a keyed Feistel network on the smallest even-bit domain >= n, with
cycle-walking to stay inside [0, n): a bijection, so every sample lands exactly once, and computable for
any slice of output positions in O(slice) memory. The output depends on (seed, split, n) only, never on
how many tasks write the shards.
"""

from __future__ import annotations

import hashlib

import numpy as np

from data_prep.dedup import fmix64

ROUNDS = 6


def _round_keys(seed: int, salt: str) -> list[np.uint64]:
    return [
        np.uint64(int.from_bytes(hashlib.sha256(f"{seed}:{salt}:{i}".encode()).digest()[:8], "little"))
        for i in range(ROUNDS)
    ]


def _feistel(x: np.ndarray, half: int, keys: list[np.uint64]) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    sh = np.uint64(half)
    left, right = x >> sh, x & mask
    for k in keys:
        left, right = right, left ^ (fmix64(right ^ k) & mask)
    return (left << sh) | right


def permute(positions: np.ndarray, n: int, seed: int, salt: str) -> np.ndarray:
    """π(positions) for the seeded bijection π of [0, n) named by (seed, salt); int64 in, int64 out."""
    pos = np.asarray(positions, dtype=np.int64)
    if n <= 1:
        return pos.copy()
    half = max(1, -(-max(n - 1, 1).bit_length() // 2))
    keys = _round_keys(seed, salt)
    out = _feistel(pos.astype(np.uint64), half, keys)
    walk = out >= np.uint64(n)
    while walk.any():  # the domain is < 4n, so a few rounds of walking at most, on ever fewer values
        out[walk] = _feistel(out[walk], half, keys)
        walk = out >= np.uint64(n)
    return out.astype(np.int64)
