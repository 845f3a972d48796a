"""Exact dedup keys (content hash) and near dedup (MinHash + LSH), vectorised with numpy.

The pipeline splits near dedup the way datatrove's ``MinhashDedup*`` steps do, so no process needs every
signature: per document bucket, :class:`MinHasher` signs each document and :func:`band_keys` cuts the
signature into LSH band keys; per key partition, :func:`candidate_pairs` finds documents sharing a band key
and :func:`confirm` keeps the pairs whose estimated Jaccard (share of equal slots) reaches the threshold;
one small step, :func:`clusters`, joins the confirmed pairs and keeps the lowest id of each cluster, so the
result does not depend on input order or partitioning. :func:`near_duplicates` runs all of it in memory.

Why our own code and not datatrove's steps or datasketch: ``make bench-data-scale`` times the three on the
same texts (data_prep/README.md has the figures); what makes a signature cheap here: :class:`MinHasher`.
"""

from __future__ import annotations

import hashlib

import numpy as np

# A word is a maximal run of ASCII letters, digits, '_' or any non-ASCII byte (UTF-8 letters of other
# scripts stay whole). Code is almost all ASCII, where this is exactly ``data_prep.decontam.WORD`` (``\w+``).
_IS_WORD = np.zeros(256, dtype=bool)
for _c in b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_":
    _IS_WORD[_c] = True
_IS_WORD[0x80:] = True

_P = np.uint64(0x100000001B3)  # odd multipliers: byte -> word and word -> n-gram polynomials (mod 2**64)
_Q = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_S33, _S32 = np.uint64(33), np.uint64(32)


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser: a bijection that spreads every input bit over the output."""
    x = x ^ (x >> _S33)
    x = x * _M1
    x = x ^ (x >> _S33)
    x = x * _M2
    return x ^ (x >> _S33)


class _Powers:
    """``base ** i`` and ``base ** -i`` mod 2**64 for i < n, grown on demand (one table per process)."""

    def __init__(self, base: np.uint64):
        self.base = base
        self.inv = np.uint64(pow(int(base), -1, 1 << 64))
        self.fwd = self.bwd = np.ones(1, dtype=np.uint64)

    def upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.fwd) < n:
            size = max(n, 2 * len(self.fwd))
            fwd, bwd = np.full(size, self.base, dtype=np.uint64), np.full(size, self.inv, dtype=np.uint64)
            fwd[0] = bwd[0] = 1
            self.fwd, self.bwd = np.cumprod(fwd, dtype=np.uint64), np.cumprod(bwd, dtype=np.uint64)
        return self.fwd, self.bwd


_BYTE_POW = _Powers(_P)


def shingle_hashes(text: str, ngram: int) -> np.ndarray:
    """Distinct 64-bit hashes of the document's word n-grams (a document shorter than n words is one shingle)."""
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    edge = np.diff(_IS_WORD[raw].astype(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)
    fwd, bwd = _BYTE_POW.upto(len(raw) + 1)
    with np.errstate(over="ignore"):
        prefix = np.zeros(len(raw) + 1, dtype=np.uint64)
        np.cumsum((raw.astype(np.uint64) + np.uint64(1)) * fwd[: len(raw)], out=prefix[1:])
        words = fmix64((prefix[ends] - prefix[starts]) * bwd[starts])  # hash of bytes[start:end], position-free
        n = len(words)
        if n < ngram:  # the whole (short) document is one shingle
            grams = np.array([np.sum(words * _Q ** np.arange(n, dtype=np.uint64))], dtype=np.uint64)
        else:
            grams = words[: n - ngram + 1].copy()
            q = np.uint64(1)
            for k in range(1, ngram):
                q = q * _Q
                grams += words[k : n - ngram + 1 + k] * q
    return np.unique(fmix64(grams))


class MinHasher:
    """``num_perm``-slot uint32 MinHash signatures of word ``ngram`` shingles (same ``seed``, same signatures).

    The cost of a signature is shingling plus the shingles x permutations product. Shingling has no per-n-gram
    Python (:func:`shingle_hashes`: a document's UTF-8 bytes are split into words, each word hashed by a
    polynomial over its bytes and each n-gram by a polynomial over its words, all numpy); the permutations are
    datasketch's ``affine32`` scheme (MurmurHash3 finaliser, then ``a * h + b`` in uint32 with ``a`` odd, a
    bijection), one uint32 multiply-add-min per shingle and slot instead of a 64-bit ``% (2**61 - 1)``."""

    def __init__(self, num_perm: int = 256, ngram: int = 5, seed: int = 1, chunk: int = 2048):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(0, 1 << 32, size=num_perm, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
        self.b = rng.integers(0, 1 << 32, size=num_perm, dtype=np.uint64).astype(np.uint32)
        self.num_perm, self.ngram, self.chunk = num_perm, ngram, chunk

    def signature(self, text: str) -> np.ndarray:
        h = (shingle_hashes(text, self.ngram) >> _S32).astype(np.uint32)
        sig = np.full(self.num_perm, np.iinfo(np.uint32).max, dtype=np.uint32)
        for i in range(0, len(h), self.chunk):
            np.minimum(sig, (h[i : i + self.chunk, None] * self.a + self.b).min(axis=0), out=sig)
        return sig

    def signatures(self, texts: list[str]) -> np.ndarray:
        out = np.empty((len(texts), self.num_perm), dtype=np.uint32)
        for i, t in enumerate(texts):
            out[i] = self.signature(t)
        return out


def signatures(texts: list[str], num_perm: int = 256, ngram: int = 5, seed: int = 1) -> np.ndarray:
    return MinHasher(num_perm, ngram, seed).signatures(texts)


def recall_bands(threshold: float, num_perm: int, recall: float = 0.99) -> tuple[int, int]:
    """(bands, rows): the most rows per band (fewest false candidates) for which a pair at ``threshold``
    becomes a candidate with probability >= ``recall``.

    Candidates are confirmed on the whole signature afterwards, so a false candidate costs one comparison
    while a missed one is a duplicate kept: the LSH is tuned for recall. (Minimising the false-positive +
    false-negative area instead picks 13 x 19 at 0.85, which finds a pair at the threshold 45 % of the time.)
    """
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if 1 - (1 - threshold**rows) ** bands >= recall:
            return bands, rows
    return num_perm, 1


def bands_rows(threshold: float, num_perm: int, bands: int | None) -> tuple[int, int]:
    return recall_bands(threshold, num_perm) if bands is None else (bands, num_perm // bands)


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 [n, bands]: band j's ``rows`` slots hashed together (equal slots, equal key), band index mixed in."""
    n = len(sigs)
    coef = fmix64(np.arange(1, rows + 1, dtype=np.uint64))
    with np.errstate(over="ignore"):
        block = sigs[:, : bands * rows].reshape(n, bands, rows).astype(np.uint64)
        keys = (block * coef).sum(axis=2, dtype=np.uint64)
        return fmix64(keys ^ (np.arange(bands, dtype=np.uint64) * _Q))


def candidate_pairs(kind: np.ndarray, key: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Pairs (first, other) of refs sharing (kind, key): every member of a group paired with its lowest ref.

    ``ref`` identifies a document (``bucket << 32 | row``); pairs come back as int64 [m, 2], each once.
    """
    if len(ref) < 2:
        return np.empty((0, 2), dtype=np.int64)
    order = np.lexsort((ref, key, kind))
    k, h, r = kind[order], key[order], ref[order]
    new = np.ones(len(r), dtype=bool)
    new[1:] = (k[1:] != k[:-1]) | (h[1:] != h[:-1])
    first = np.maximum.accumulate(np.where(new, np.arange(len(r)), 0))
    pairs = np.stack([r[first], r], axis=1)[~new]
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    return np.unique(pairs, axis=0) if len(pairs) else pairs.reshape(0, 2)


def confirm(sig_a: np.ndarray, sig_b: np.ndarray, threshold: float) -> np.ndarray:
    """Mask of pairs whose estimated Jaccard (share of equal signature slots) is at least ``threshold``."""
    return np.mean(sig_a == sig_b, axis=1) >= threshold


def clusters(pairs: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Union-find over ``pairs`` (indices into ``rank``); each index's cluster root is its lowest-``rank`` member."""
    parent = np.arange(len(rank))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in pairs.tolist():
        ri, rj = find(i), find(j)
        if ri != rj:
            lo, hi = (ri, rj) if rank[ri] < rank[rj] else (rj, ri)
            parent[hi] = lo
    return np.array([find(i) for i in range(len(rank))], dtype=np.int64)


def near_duplicates(sigs: np.ndarray, threshold: float, bands: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return (keep mask, cluster root index per doc) for one in-memory set; rows must be in keep-priority order."""
    n, num_perm = sigs.shape
    b, r = bands_rows(threshold, num_perm, bands)
    keys = band_keys(sigs, b, r)
    kind = np.repeat(np.arange(b, dtype=np.int64)[None, :], n, axis=0).ravel()
    ref = np.repeat(np.arange(n, dtype=np.int64), b)
    pairs = candidate_pairs(kind, keys.ravel(), ref)
    pairs = pairs[confirm(sigs[pairs[:, 0]], sigs[pairs[:, 1]], threshold)]
    roots = clusters(pairs, np.arange(n))
    return roots == np.arange(n), roots
