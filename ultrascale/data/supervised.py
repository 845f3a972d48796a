"""Supervised sets on disk: samples with a loss mask, whole groups held out, packed into rows and written as a
prepared dataset (``manifest.json`` + ``tokenizer/``) that ``train.py data.path=...`` trains on.

Every supervised set goes through :func:`write_packed`: SSD's kept samples (:mod:`ultrascale.ssd.sft`) and
``python -m data_prep.chat``'s conversations, so they split, pack and write alike.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ultrascale.data.shards import write_samples
from ultrascale.data.tokcheck import VOCAB_KEY, vocab_sha256


def pack(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing in order into [rows, seq_len]; the tail of each row is ``pad`` with mask False."""
    rows, masks = [], []
    ids_row, mask_row = np.full(seq_len, pad, np.int64), np.zeros(seq_len, bool)
    used = 0
    for ids, mask in samples:
        if len(ids) > seq_len:
            raise ValueError(f"sample of {len(ids)} tokens does not fit seq_len={seq_len}")
        if used + len(ids) > seq_len:
            rows.append(ids_row)
            masks.append(mask_row)
            ids_row, mask_row, used = np.full(seq_len, pad, np.int64), np.zeros(seq_len, bool), 0
        ids_row[used : used + len(ids)] = ids
        mask_row[used : used + len(ids)] = mask
        used += len(ids)
    if used:
        rows.append(ids_row)
        masks.append(mask_row)
    return np.stack(rows) if rows else np.zeros((0, seq_len), np.int64), (
        np.stack(masks) if masks else np.zeros((0, seq_len), bool)
    )


def write_packed(
    encoded: list[tuple[str, np.ndarray, np.ndarray]],
    tokenizer,
    out_dir: str | os.PathLike,
    *,
    seq_len: int,
    pad: int,
    validation_fraction: float,
    seed: int,
    key: str,
    report: Callable[[dict], dict],
) -> dict:
    """Hold out whole groups (a problem's samples, a conversation) for validation, pack each split in a seeded
    order with ``pad`` (also the manifest's document separator), and write the dataset with ``report(figures)``
    in its manifest under ``key``. Every supervised set (SSD's samples, ``python -m data_prep.chat``'s
    conversations) goes through here, so they split, pack and write alike. ``encoded``: ``(group, ids, loss
    mask)`` per sample. Written into a temporary sibling and renamed, so ``out_dir`` exists only when complete.
    Returns the report."""
    rng = random.Random(seed)
    groups = sorted({g for g, _, _ in encoded})
    n_val = max(1, round(validation_fraction * len(groups))) if len(groups) >= 2 and validation_fraction > 0 else 0
    val_groups = set(rng.sample(groups, n_val))
    encoded = list(encoded)
    rng.shuffle(encoded)
    train = pack([(i, m) for g, i, m in encoded if g not in val_groups], seq_len, pad)
    val = pack([(i, m) for g, i, m in encoded if g in val_groups], seq_len, pad) if val_groups else train
    stats = report({"train_groups": len(groups) - n_val, "validation_groups": n_val,
                    "train_rows": int(train[0].shape[0]), "validation_rows": int(val[0].shape[0]),
                    "target_tokens": int(train[1].sum()),
                    "context_tokens": int(sum(int((~m).sum()) for g, _, m in encoded if g not in val_groups))})  # fmt: skip
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(str(tmp / "tokenizer"))
    write_samples(
        tmp,
        {"train": [train[0]], "validation": [val[0]]},
        seq_len=seq_len,
        vocab_size=len(tokenizer),
        eos_token_id=pad,
        tokenizer="tokenizer",
        extra={key: stats, VOCAB_KEY: vocab_sha256(tmp / "tokenizer")},
        loss_masks={"train": [train[1]], "validation": [val[1]]},
    )
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return stats
