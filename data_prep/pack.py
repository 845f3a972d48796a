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

import numpy as np

from data_prep.tokenizer import FILE_SEP, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, REPO_NAME


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


def encode_docs(tok, docs: list[dict], seed: int, rate: float, spm_rate: float, metadata: bool, batch: int = 512):
    """Yield (doc, mode, token ids without EOS) for each doc, encoding all pieces with ``encode_batch``."""
    sid = {t: tok.token_to_id(t) for t in (FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, REPO_NAME, FILE_SEP)}
    for start in range(0, len(docs), batch):
        chunk = docs[start : start + batch]
        plans, pieces = [], []
        for d in chunk:
            mode, parts = fim_plan(d["id"], d["text"], seed, rate, spm_rate)
            head = [d["repo"], d["path"] + "\n"] if metadata else []
            plans.append((mode, len(head), len(parts)))
            pieces.extend(head + parts)
        enc = tok.encode_batch_fast(pieces, add_special_tokens=False) if pieces else []
        k = 0
        for d, (mode, nh, np_) in zip(chunk, plans):
            ids: list[int] = []
            if nh:
                ids += [sid[REPO_NAME], *enc[k].ids, sid[FILE_SEP], *enc[k + 1].ids]
            p = [e.ids for e in enc[k + nh : k + nh + np_]]
            k += nh + np_
            if mode == "plain":
                ids += p[0]
            elif mode == "psm":
                ids += [sid[FIM_PREFIX], *p[0], sid[FIM_SUFFIX], *p[1], sid[FIM_MIDDLE], *p[2]]
            else:
                ids += [sid[FIM_PREFIX], sid[FIM_SUFFIX], *p[0], sid[FIM_MIDDLE], *p[1], *p[2]]
            yield d, mode, ids


def pack(token_lists, eos_id: int, seq_len: int) -> tuple[np.ndarray, int, int]:
    """Join documents with EOS and cut into [n, seq_len]. The tail is padded with EOS, so no token is lost.

    Returns (samples, real tokens, pad tokens).
    """
    buf: list[int] = []
    for ids in token_lists:
        buf.extend(ids)
        buf.append(eos_id)
    n_real = len(buf)
    pad = (-n_real) % seq_len
    stream = np.empty(n_real + pad, dtype=np.uint32)
    stream[:n_real] = buf
    stream[n_real:] = eos_id
    return stream.reshape(-1, seq_len), n_real, pad
