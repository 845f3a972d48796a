"""The finetuning set: kept samples as prompt + completion + EOS, packed into shards, prompt tokens masked.

Tokenized with the *model's* tokenizer and split where generation splits it (:func:`encode`), so the model
learns the token sequence it produces when sampled and scored. The loss mask is True on the completion and on
the EOS after it (the model learns where to stop), False on the prompt and on the EOS padding at the end of a
packed row. Rows hold several samples; the loader's document masking restarts position ids after every EOS and
keeps attention inside one sample. Validation holds the kept samples of whole problems, so its loss is on
problems the finetune never saw. The output is a standard prepared dataset (``manifest.json`` + ``tokenizer/``),
so ``train.py data.path=...`` trains on it and ``ultrascale.export`` finds its tokenizer.
"""

from __future__ import annotations

import os

import numpy as np

from ultrascale.data.supervised import write_packed
from ultrascale.errors import DataError
from ultrascale.ssd.config import SFTConfig

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
    generation uses (:func:`ultrascale.eval.humaneval.encode_sample`, with the sampling's ``heal_newline``).

    The prompt without its trailing newline, encoded as the sampler encodes it (no special tokens), then the
    newline and the completion (``sample.heal_newline``: newline + indent is one token, which a prompt ending in
    a bare newline token would never let the model train)."""
    from ultrascale.eval.humaneval import encode_sample

    p, c = encode_sample(tokenizer, prompt, completion, heal_newline)
    ids = np.asarray([*p, *c, eos], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    mask[len(p) :] = True
    return ids, mask


def build(
    records: list[dict],
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    cfg: SFTConfig,
    heal_newline: bool = True,
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
