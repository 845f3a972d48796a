"""FIM, tokenization and packing.

FIM is applied at prep time, not on the fly in the loader: the samples on disk are then exactly what the
model sees, the manifest's checksums cover them, resume needs no RNG state, and ``data_prep.show`` can
display them. Each document draws its own RNG from ``(seed, doc id)``, so the result does not depend on
document order, task count or resume point.

Formats (StarCoder): PSM ``<fim_prefix>pre<fim_suffix>suf<fim_middle>mid``;
SPM ``<fim_prefix><fim_suffix>suf<fim_middle>pre mid``. Cut points are character offsets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from data_prep.tokenizer import (
    FILE_SEP,
    FIM_MIDDLE,
    FIM_PREFIX,
    FIM_SUFFIX,
    REPO_NAME,
    encode_texts,
    piece_cuts_are_neutral,
)


def doc_rng(seed: int, doc_id: str) -> np.random.Generator:
    h = int.from_bytes(hashlib.sha1(doc_id.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, h])


def fim_plan(doc_id: str, text: str, seed: int, rate: float, spm_rate: float) -> tuple[str, list[str]]:
    """(mode, text pieces) for one document; mode is ``plain``, ``psm`` or ``spm``."""
    rng = doc_rng(seed, doc_id)
    if rate <= 0 or rng.random() >= rate or len(text) < 2:
        return "plain", [text]
    lo, hi = sorted(rng.integers(0, len(text) + 1, size=2).tolist())
    pre, mid, suf = text[:lo], text[lo:hi], text[hi:]
    if rng.random() < spm_rate:
        return "spm", [suf, pre, mid]
    return "psm", [pre, suf, mid]


def _cat(parts: list) -> np.ndarray:
    """Concatenate id arrays and single sentinel ids into one uint32 array."""
    return np.concatenate([np.array([x], dtype=np.uint32) if isinstance(x, int) else x for x in parts])


def encode_docs(
    tok,
    docs: list[dict],
    seed: int,
    rate: float,
    spm_rate: float,
    metadata: bool,
    batch: int = 512,
    reuse: bool | None = None,
) -> Iterator[tuple[dict, str, np.ndarray]]:
    """Yield (doc, mode, uint32 token ids without EOS) per doc, encoding ``batch`` docs' pieces per call.

    A plain document without metadata (every one when FIM is off) is a view into the batch's id array,
    not a copy; FIM and metadata documents are concatenated around their sentinels. ``reuse`` is
    :func:`encode_texts`'s (None: when the tokenizer allows it); the ids are the same either way.
    """
    sid = {t: tok.token_to_id(t) for t in (FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, REPO_NAME, FILE_SEP)}
    reuse = piece_cuts_are_neutral(tok) if reuse is None else reuse
    for start in range(0, len(docs), batch):
        chunk = docs[start : start + batch]
        plans, pieces = [], []
        for d in chunk:
            mode, parts = fim_plan(d["id"], d["text"], seed, rate, spm_rate)
            head = [d["repo"], d["path"] + "\n"] if metadata else []
            plans.append((mode, len(head), len(parts)))
            pieces.extend(head + parts)
        flat, off = encode_texts(tok, pieces, reuse)
        k = 0
        for d, (mode, nh, np_) in zip(chunk, plans):
            enc = [flat[off[j] : off[j + 1]] for j in range(k, k + nh + np_)]
            k += nh + np_
            head, p = ([sid[REPO_NAME], enc[0], sid[FILE_SEP], enc[1]] if nh else []), enc[nh:]
            if mode == "plain":
                ids = _cat([*head, p[0]]) if nh else p[0]
            elif mode == "psm":
                ids = _cat([*head, sid[FIM_PREFIX], p[0], sid[FIM_SUFFIX], p[1], sid[FIM_MIDDLE], p[2]])
            else:
                ids = _cat([*head, sid[FIM_PREFIX], sid[FIM_SUFFIX], p[0], sid[FIM_MIDDLE], p[1], p[2]])
            yield d, mode, ids


def pack(token_lists: Sequence, eos_id: int, seq_len: int) -> tuple[np.ndarray, int, int]:
    """Join documents with EOS and cut into [n, seq_len]. The tail is padded with EOS, so no token is lost.

    ``token_lists`` holds id arrays (or lists); they are copied once, straight into the packed buffer.
    Returns (samples, real tokens, pad tokens).
    """
    n_real = sum(len(ids) for ids in token_lists) + len(token_lists)
    pad = (-n_real) % seq_len
    stream = np.full(n_real + pad, eos_id, dtype=np.uint32)
    if token_lists:
        eos = np.array([eos_id], dtype=np.uint32)
        parts = [x for ids in token_lists for x in (np.asarray(ids, dtype=np.uint32), eos)]
        np.concatenate(parts, out=stream[:n_real])
    return stream.reshape(-1, seq_len), n_real, pad
