"""Exact dedup (content hash) and near dedup (MinHash LSH), vectorised with numpy.

MinHash: a document's word 5-gram shingles are hashed once (xxh64, 32-bit), then all 256 permutations are
applied as one ``(a * h + b) mod p`` matrix operation and reduced with ``min`` - no per-shingle Python
loop over permutations (the cost that dominates ``datasketch.MinHash.update``). LSH: the signature is cut
into ``bands`` x ``rows``; documents sharing any band bucket are candidates, confirmed by their estimated
Jaccard (share of equal signature slots) >= threshold, and merged with union-find. The lowest id in each
cluster is kept, so the result does not depend on input order.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
import xxhash

_MERSENNE = np.uint64((1 << 61) - 1)
_MAX32 = np.uint64(0xFFFFFFFF)
_WORD = re.compile(r"\w+")


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def permutations(num_perm: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    a = rng.randint(1, (1 << 32) - 1, size=num_perm, dtype=np.uint64)
    b = rng.randint(0, (1 << 32) - 1, size=num_perm, dtype=np.uint64)
    return a, b


def shingle_hashes(text: str, ngram: int) -> np.ndarray:
    """32-bit hashes of the distinct word n-grams (a short file is one shingle)."""
    words = _WORD.findall(text)
    if len(words) < ngram:
        grams = {" ".join(words)}
    else:
        grams = {" ".join(words[i : i + ngram]) for i in range(len(words) - ngram + 1)}
    h = xxhash.xxh32_intdigest
    return np.fromiter((h(g.encode()) for g in grams), dtype=np.uint64, count=len(grams))


def minhash(text: str, ngram: int, a: np.ndarray, b: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """uint32 signature of ``len(a)`` slots. (a*h+b) stays < 2^64: a, h, b are all < 2^32."""
    hv = shingle_hashes(text, ngram)
    sig = np.full(len(a), _MAX32, dtype=np.uint64)
    for i in range(0, len(hv), chunk):
        ph = (hv[i : i + chunk, None] * a[None, :] + b[None, :]) % _MERSENNE & _MAX32
        np.minimum(sig, ph.min(axis=0), out=sig)
    return sig.astype(np.uint32)


def signatures(texts: list[str], num_perm: int = 256, ngram: int = 5, seed: int = 1) -> np.ndarray:
    a, b = permutations(num_perm, seed)
    out = np.empty((len(texts), num_perm), dtype=np.uint32)
    for i, t in enumerate(texts):
        out[i] = minhash(t, ngram, a, b)
    return out


def optimal_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimising the false-positive + false-negative area of the LSH S-curve at threshold."""
    xs = np.linspace(0, 1, 201)
    best, best_err = (1, num_perm), float("inf")
    for bands in range(1, num_perm + 1):
        rows = num_perm // bands
        p = 1 - (1 - xs**rows) ** bands
        fp = np.trapezoid(np.where(xs < threshold, p, 0), xs)
        fn = np.trapezoid(np.where(xs >= threshold, 1 - p, 0), xs)
        if fp + fn < best_err:
            best, best_err = (bands, rows), fp + fn
    return best


def near_duplicates(sigs: np.ndarray, threshold: float, bands: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return (keep mask, cluster root index per doc). Rows of ``sigs`` must be in the keep-priority order."""
    n, num_perm = sigs.shape
    if bands is None:
        bands, rows = optimal_bands(threshold, num_perm)
    else:
        rows = num_perm // bands
    parent = np.arange(n)

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    checked: set[tuple[int, int]] = set()
    for band in range(bands):
        block = np.ascontiguousarray(sigs[:, band * rows : (band + 1) * rows])
        keys = block.view(np.dtype((np.void, block.dtype.itemsize * rows))).ravel()
        _, inv, cnt = np.unique(keys, return_inverse=True, return_counts=True)
        dup = np.flatnonzero(cnt[inv] > 1)  # docs whose bucket in this band has company
        if not len(dup):
            continue
        order = dup[np.argsort(inv[dup], kind="stable")]
        groups = np.split(order, np.flatnonzero(np.diff(inv[order])) + 1)
        for members in groups:
            first = members[0]
            for j in members[1:]:
                pair = (int(first), int(j))
                if pair in checked:
                    continue
                checked.add(pair)
                if np.mean(sigs[first] == sigs[j]) >= threshold:
                    ri, rj = find(first), find(j)
                    if ri != rj:
                        parent[max(ri, rj)] = min(ri, rj)
    roots = np.array([find(i) for i in range(n)])
    return roots == np.arange(n), roots
