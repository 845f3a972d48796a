"""Prepared token ids mean something only under the tokenizer that wrote them: a model meets prepared data here.

A pretrained model reads ids through its own vocabulary. Data tokenized by another tokenizer (the project's
4,096-token BPE under SmolLM2's 49,152) trains without a word: every id is a valid row of the embedding, it just
means another token, and the loss only looks high. So wherever a model meets prepared data (training and its
in-training eval, which read the run's sources with the model, eval's perplexity, SSD's fine-tune) the data's
manifest is compared with the model's tokenizer first, in :func:`check_tokenizer`, before anything is built or
written.

The comparison is a hash of the vocabulary computed on both sides (:func:`vocab_sha256`); a manifest from before
the hash falls back to the vocabulary size and the special tokens' ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ultrascale.data.shards import load_manifest
from ultrascale.errors import DataError
from ultrascale.paths import resolve_path

if TYPE_CHECKING:
    from ultrascale.config.model import ModelConfig

VOCAB_KEY = "vocab_sha256"
"""The manifest key holding the data's :func:`vocab_sha256` (absent in manifests written before it)."""
ADDED_KEY = "tokenizer_added"
"""The manifest key data prep's ``tokenizer.add_fim`` writes: the vocabulary the data's tokenizer grew from
(``base_vocab_sha256``, ``base_vocab_size``) and the appended tokens' ids. A model of that vocabulary reads the data
once its embedding has the new rows (``model.config.vocab_size``, checked against the manifest's ``vocab_size``)."""
FIM_PREFIX = "<fim_prefix>"


def pretrained_dir(model_cfg: ModelConfig) -> Path | None:
    """The model's own directory (``model.pretrained_path``, resolved), whose tokenizer prepared data must have;
    None for a model built from ``model.type`` (it learns the data's ids, whatever they are). A run's saved
    config.yaml from before the key existed reads as None."""
    path = getattr(model_cfg, "pretrained_path", None)
    return resolve_path(path) if path else None


def read_vocab(tok_dir: str | os.PathLike) -> dict[str, int] | None:
    """``token -> id`` of a tokenizer directory's ``tokenizer.json``, added tokens included; None without one
    (a model directory saved without a tokenizer: nothing to compare)."""
    path = Path(tok_dir) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def vocab_sha256(tok_dir: str | os.PathLike) -> str | None:
    """sha256 of the vocabulary as sorted ``(id, token)`` pairs: what an id means, whatever bytes hold it.

    The added tokens are included. Data prep records it in the manifest from the tokenizer it wrote, the check
    computes it from the model's. A file hash would not do: ``save_pretrained`` rewrites ``tokenizer.json`` with
    the same vocabulary and other bytes."""
    vocab = read_vocab(tok_dir)
    if vocab is None:
        return None
    pairs = sorted((i, t) for t, i in vocab.items())
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


def shown(path: str | os.PathLike) -> str:
    """A path as a command typed here would take it: relative to the working directory when it is inside it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def prep_command(output_dir: str | os.PathLike, tok_dir: str | os.PathLike, seq_len: int) -> str:
    """The data prep command that tokenizes with a model's own tokenizer (``fim.rate=0`` when it has no FIM
    tokens, which data prep would otherwise refuse)."""
    vocab = read_vocab(tok_dir)
    fim = " fim.rate=0" if vocab is not None and FIM_PREFIX not in vocab else ""
    return (
        f"python -m data_prep output_dir={shown(output_dir)} tokenizer.path={shown(tok_dir)}{fim} "
        f"pack.seq_len={seq_len}"
    )


def _differences(manifest: dict, vocab: dict[str, int], model_dir: Path) -> list[str]:
    """What tells the two tokenizers apart, in words (empty: they agree)."""
    added = manifest.get(ADDED_KEY)
    if added and added.get("base_vocab_sha256") == vocab_sha256(model_dir):
        return []  # the model's own vocabulary with tokens appended: every id it knows means what it did
    if manifest.get(VOCAB_KEY):
        theirs = vocab_sha256(model_dir)
        if manifest[VOCAB_KEY] != theirs:
            return [
                f"{manifest['vocab_size']:,} vs {len(vocab):,} tokens, vocabulary sha256 "
                f"{manifest[VOCAB_KEY][:12]} vs {str(theirs)[:12]}"
            ]
        return []
    out = []  # a manifest from before the hash: its size and special tokens are all it says
    if int(manifest["vocab_size"]) != len(vocab):
        out.append(f"{int(manifest['vocab_size']):,} vs {len(vocab):,} tokens")
    for token, i in sorted((manifest.get("special_tokens") or {}).items()):
        if i is not None and vocab.get(token) != i:
            out.append(f"{token} is id {i} vs {vocab.get(token)}")
    return out


def check_tokenizer(data_path: str | os.PathLike, data_key: str, model_dir: str | os.PathLike | None,
                    model_key: str) -> None:  # fmt: skip
    """Refuse, in one line naming both tokenizers' paths, prepared data whose ids the model reads as other
    tokens. ``data_key``/``model_key`` name the settings (``data.path``, ``model.pretrained_path``). A model
    without a ``tokenizer.json`` (None, or a directory saved without one) has nothing to compare and passes."""
    if model_dir is None:
        return
    model_dir = Path(model_dir)
    vocab = read_vocab(model_dir)
    if vocab is None:
        return
    manifest = load_manifest(data_path)
    diffs = _differences(manifest, vocab, model_dir)
    if not diffs:
        return
    data_tok = Path(data_path) / str(manifest.get("tokenizer") or "tokenizer")
    raise DataError(
        f"{data_key}={shown(data_path)} was tokenized by {shown(data_tok)}, not by {model_key}={shown(model_dir)}'s "
        f"tokenizer ({'; '.join(diffs[:3])}): the model would read every id as another token; prepare the data "
        f"with the model's tokenizer, `{prep_command('<new dir>', model_dir, int(manifest['seq_len']))}`, and "
        f"point {data_key} at it"
    )
