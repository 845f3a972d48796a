"""The finetuning set: kept samples as prompt + completion + EOS, packed into shards, prompt tokens masked.

Tokenized with the *model's* tokenizer and split where generation splits it
(:func:`ultrascale.eval.humaneval.encode_sample`): the prompt without its trailing newline, encoded as the
sampler encodes it (no special tokens), then the newline and the completion, so the model learns the token
sequence it produces when sampled and scored (``sample.heal_newline``: newline + indent is one token, which a
prompt ending in a bare newline token would never let it train). The loss mask is True on the
completion and on the EOS after it (the model learns where to stop), False on the prompt and on the EOS
padding at the end of a packed row. Rows hold several samples; the loader's document masking restarts
position ids after every EOS and keeps attention inside one sample.

Validation holds the kept samples of whole problems (``validation_fraction`` of them), so its loss is on
problems the finetune never saw. The output is a standard prepared dataset (``manifest.json`` +
``tokenizer/``), so ``train.py data.path=...`` trains on it and ``ultrascale.export`` finds its tokenizer.
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
from ultrascale.errors import DataError

HEALED = "healed (the prompt's trailing newlines start the completion)"


def eos_id(tokenizer, eos_token: str | None = None) -> int:
    """The id appended after each completion (and used as the document separator)."""
    token = eos_token or tokenizer.eos_token
    tid = tokenizer.convert_tokens_to_ids(token) if token else None
    if tid is None or (token and tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise DataError(f"sft.eos_token={token!r} is not a token of this tokenizer: set sft.eos_token to one that is")
    return int(tid)


def encode(
    tokenizer, prompt: str, completion: str, eos: int, heal_newline: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask) of one sample: prompt (masked out) + completion + EOS (targets), split at the boundary
    generation uses (:func:`ultrascale.eval.humaneval.encode_sample`, with the sampling's ``heal_newline``)."""
    from ultrascale.eval.humaneval import encode_sample

    p, c = encode_sample(tokenizer, prompt, completion, heal_newline)
    ids = np.asarray([*p, *c, eos], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    mask[len(p) :] = True
    return ids, mask


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


def build(
    records: list[dict], tokenizer_dir: str | os.PathLike, out_dir: str | os.PathLike, cfg, heal_newline: bool = True
) -> dict:
    """Write the packed SFT dataset for ``records`` (``{task_id, prompt, completion}``) to ``out_dir``.

    ``heal_newline`` is the sampling's (``sample.heal_newline``): the samples are encoded as they were generated.

    Written into a temporary sibling and renamed, so ``out_dir`` exists only when complete. Returns stats.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos = eos_id(tokenizer, cfg.eos_token)
    encoded, too_long = [], 0
    for r in records:
        ids, mask = encode(tokenizer, r["prompt"], r["completion"], eos, heal_newline)
        if len(ids) > cfg.seq_len:
            too_long += 1
            continue
        encoded.append((r["task_id"], ids, mask))
    if not encoded:
        raise DataError(
            f"no kept sample to finetune on ({len(records)} kept, {too_long} longer than sft.seq_len={cfg.seq_len}): "
            "sample more (sample.n), raise sft.seq_len, or start from a stronger model"
        )

    def report(packed: dict) -> dict:
        val = packed["validation_groups"]
        return {
            "samples": len(encoded),
            "too_long": too_long,
            "train_problems": packed["train_groups"],
            "validation_problems": val,
            "train_rows": packed["train_rows"],
            "validation_rows": packed["validation_rows"],
            "target_tokens": packed["target_tokens"],
            "prompt_tokens": packed["context_tokens"],
            "eos_token_id": eos,
            "prompt_boundary": HEALED if heal_newline else "as is",
            "validation": "held-out problems" if val else "a copy of train (fewer than 2 problems kept)",
        }

    return write_packed(encoded, tokenizer, out_dir, seq_len=cfg.seq_len, pad=eos,
                        validation_fraction=cfg.validation_fraction, seed=cfg.seed, key="sft", report=report)  # fmt: skip


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
