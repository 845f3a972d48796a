"""Make sure prepared shards exist before training: rank 0 builds them, the other ranks wait.

A fresh checkout has no data; ``recipe=cpu_smoke`` must still run as-is, so the built-in default corpus
(``data/stdlib``: this Python's standard library) is prepared on first use. Nothing else is: a misspelt
``data.path`` used to be "prepared" from the stdlib and trained on, silently, in every recipe, the 7B ones
included. Preparing on every rank would race on the same files, so rank 0 alone runs data prep and broadcasts
the outcome (including an error, so no rank is left waiting at a barrier for a rank that already failed).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ultrascale.config.data import DataConfig
from ultrascale.data.shards import MANIFEST, load_manifest, open_split
from ultrascale.data.sources import check_agree, check_eval_source, is_mixture, sources
from ultrascale.data.tokcheck import check_tokenizer, prep_command, read_vocab
from ultrascale.errors import DataError, UltrascaleError
from ultrascale.paths import resolve_path
from ultrascale.runtime import dist

log = logging.getLogger("ultrascale")
BUILTIN_CORPUS = DataConfig.path
"""The one data path a run prepares by itself (from the stdlib) when it is missing."""


def is_builtin_corpus(path: str | Path) -> bool:
    return resolve_path(path) == resolve_path(BUILTIN_CORPUS)


def _not_prepared(key: str, path: Path, seq_len: int, model_dir: Path | None = None) -> str:
    what = "does not exist" if not path.exists() else f"has no {MANIFEST}"
    if _has_tokenizer(model_dir):  # a fresh BPE's ids would mean other tokens to a pretrained model
        return (
            f"{key}={path} {what}: check the path, or prepare it with model.pretrained_path's own tokenizer: "
            f"`{prep_command(path, model_dir, seq_len)}` (which reads this Python's stdlib; add "
            "input=<your source dir> for your own code)"
        )
    return (
        f"{key}={path} {what}: check the path, or prepare it with "
        f"`python -m data_prep input=<your source dir> output_dir={path} pack.seq_len={seq_len}` "
        f"(only the built-in {BUILTIN_CORPUS} is prepared on first use)"
    )


def _key(data: DataConfig, name: str) -> str:
    return f"data.sources.{name}.path" if is_mixture(data) else "data.path"


def ensure_prepared(data: DataConfig) -> list[Path]:
    """Every source's directory, the built-in corpus prepared on rank 0 if it is one of them and missing."""
    error = None
    for src in sources(data):
        error = error or _ensure_one(data, _key(data, src.name), src.path)
    error = dist.broadcast_object(error)
    if error:
        raise DataError(error)
    return [s.path for s in sources(data)]


def _ensure_one(data: DataConfig, key: str, path: Path) -> str | None:
    error = None
    if dist.is_rank0() and not (path / MANIFEST).exists():
        if not (data.prepare_if_missing and is_builtin_corpus(path)):
            error = _not_prepared(key, path, int(data.seq_len))
        else:
            log.info(f"{path / MANIFEST} not found: preparing the built-in corpus from the stdlib (rank 0) ...")
            try:
                from data_prep.api import prepare

                prepare(output_dir=str(path), source="stdlib", seq_len=int(data.seq_len),
                        max_files=data.prepare_max_files)  # fmt: skip
            except UltrascaleError as e:
                error = str(e)
    return error


def _has_tokenizer(model_dir: Path | None) -> bool:
    return model_dir is not None and read_vocab(model_dir) is not None


def check_prepared(data: DataConfig, model_vocab: int, dry_run: bool = False, model_dir: Path | None = None) -> str:
    """Every source checked (:func:`check_one`), then that they share one tokenizer; one line per source.
    ``model_dir``: the pretrained model (``model.pretrained_path``, resolved), whose tokenizer the data must have."""
    lines = [
        (f"{s.name}: " if is_mixture(data) else "")
        + check_one(data, _key(data, s.name), s.path, model_vocab, dry_run, model_dir)
        for s in sources(data)
    ]
    check_agree(data)
    held_out = check_eval_source(data, dry_run)
    return "; ".join(lines + ([held_out] if held_out else []))


def check_one(
    data: DataConfig, key: str, path: Path, model_vocab: int, dry_run: bool = False, model_dir: Path | None = None
) -> str:
    """Read-only: does the source at ``path`` (config key ``key``) fit this run (or will it be prepared)? One line
    saying what it holds.

    Run before anything is written (and again after on-demand preparation), so a missing, corrupt or
    mismatched dataset fails with its file named, not after the run directory and checkpoints exist. With
    ``data.verify_checksums`` every shard is hashed here, once. A ``dry_run`` only notes a missing corpus. With a
    pretrained ``model_dir``, the data must be tokenized by its tokenizer (:func:`check_tokenizer`).
    """
    if not (path / MANIFEST).exists():
        if not is_builtin_corpus(path) or _has_tokenizer(model_dir):
            # the built-in corpus is prepared with a fresh BPE, which a pretrained model does not read
            if dry_run:  # a dry run plans for hardware (and a corpus) this machine may not have
                return f"not here: a real run stops with: {_not_prepared(key, path, int(data.seq_len), model_dir)}"
            raise DataError(_not_prepared(key, path, int(data.seq_len), model_dir))
        if not data.prepare_if_missing:
            raise DataError(
                f"{key}={path} has no {MANIFEST}: run `python -m data_prep output_dir={path}` first "
                "(or set data.prepare_if_missing=true to prepare it on rank 0)"
            )
        return f"{path}: not prepared yet; rank 0 prepares it from the stdlib (data.prepare_if_missing)"
    manifest = load_manifest(path)
    seq_len, vocab = int(manifest["seq_len"]), int(manifest["vocab_size"])
    if seq_len != data.seq_len:
        raise DataError(
            f"data.seq_len={data.seq_len} but {path} was packed with seq_len={seq_len}: "
            f"set data.seq_len={seq_len} or re-run data prep"
        )
    if vocab > model_vocab:  # token ids past the embedding table would crash deep inside the forward
        raise DataError(
            f"{path} was tokenized with {vocab} tokens but model.config.vocab_size={model_vocab}: set "
            f"model.config.vocab_size={vocab} (or larger) or prepare the data with a smaller tokenizer"
        )
    check_tokenizer(path, key, model_dir, "model.pretrained_path")
    n = {s: len(open_split(path, s, verify=data.verify_checksums)) for s in ("train", "validation")}
    checked = ", every shard's sha256 checked" if data.verify_checksums else ""
    return (
        f"{path}: {n['train']:,} train / {n['validation']:,} validation samples of {seq_len} tokens, "
        f"vocab {vocab}{checked}"
    )
