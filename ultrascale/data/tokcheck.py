"""Prepared token ids mean something only under the tokenizer that wrote them: a model meets prepared data here.

A pretrained model reads ids through its own vocabulary. Data tokenized by another tokenizer (the project's
4,096-token BPE under SmolLM2's 49,152) trains without a word: every id is a valid row of the embedding, it just
means another token, and the loss only looks high. So wherever a model meets prepared data (training and its
in-training eval, which read the run's sources with the model, eval's perplexity, SSD's fine-tune) the data's
manifest is compared with the model's tokenizer first, in :func:`check_tokenizer`, before anything is built or
written.

The comparison is a hash of the vocabulary computed on both sides (:func:`vocab_sha256`), a legacy-format model
tokenizer's read through ``AutoTokenizer`` (:func:`read_vocab`); a manifest from before the hash falls back to the
vocabulary size and the special tokens' ids.
"""

from __future__ import annotations

import hashlib
import importlib.util
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
LEGACY_FILES = ("vocab.json", "merges.txt", "tokenizer.model")
"""A tokenizer's files without ``tokenizer.json`` (the slow tokenizers' form): BPE's vocabulary and merges, or a
sentencepiece model. Any of them makes a directory one with a tokenizer to compare."""


def pretrained_dir(model_cfg: ModelConfig) -> Path | None:
    """The model's own directory (``model.pretrained_path``, resolved), whose tokenizer prepared data must have;
    None for a model built from ``model.type`` (it learns the data's ids, whatever they are). A run's saved
    config.yaml from before the key existed reads as None."""
    path = getattr(model_cfg, "pretrained_path", None)
    return resolve_path(path) if path else None


def read_vocab(tok_dir: str | os.PathLike) -> dict[str, int] | None:
    """``token -> id`` of a tokenizer directory, added tokens included; None when it holds no tokenizer file (a
    model directory saved without a tokenizer: nothing to compare).

    ``tokenizer.json`` is read by ``tokenizers`` alone. A directory in the legacy form (``vocab.json`` +
    ``merges.txt``, or a sentencepiece ``tokenizer.model``) is loaded through ``AutoTokenizer``, as training, eval
    and the export load it, so it is compared too instead of passing unseen; one that cannot be loaded here raises
    :class:`DataError` saying what is missing (:func:`legacy_vocab`)."""
    d = Path(tok_dir)
    if (d / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True)
    files = [name for name in LEGACY_FILES if (d / name).exists()]
    return legacy_vocab(d, files) if files else None


def legacy_vocab(tok_dir: Path, files: list[str]) -> dict[str, int]:
    """``token -> id`` of a tokenizer without ``tokenizer.json``, loaded by ``AutoTokenizer`` (``files``: which
    of :data:`LEGACY_FILES` it has). Refused, in one line naming the directory and the fix, when it cannot be
    loaded here: a ``tokenizer.model`` alone needs ``sentencepiece`` (transformers would otherwise fall back to
    tiktoken and say that one is missing)."""
    if "vocab.json" not in files and importlib.util.find_spec("sentencepiece") is None:
        raise DataError(
            f"{shown(tok_dir / 'tokenizer.model')} is a sentencepiece tokenizer without a tokenizer.json, and "
            "sentencepiece is not installed to read it, so its vocabulary cannot be compared with the data's: "
            "`pip install sentencepiece`, or save the tokenizer as tokenizer.json (AutoTokenizer.from_pretrained("
            "dir).save_pretrained(dir) where sentencepiece is installed)"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as e:  # whatever the loader says goes into the one line
        why = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
        raise DataError(
            f"{shown(tok_dir)} has {' + '.join(files)} but no tokenizer.json, and AutoTokenizer cannot load it here "
            f"({type(e).__name__}: {why[:300]}), so its vocabulary cannot be compared with the data's: name its "
            "class in tokenizer_config.json's tokenizer_class, or save it as tokenizer.json"
        ) from e
    return dict(tok.get_vocab())  # a fast tokenizer's vocabulary, added tokens included


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
    without a tokenizer (None, or a directory saved without any tokenizer file) has nothing to compare and passes;
    one in the legacy form is compared, or refused when it cannot be read here (:func:`read_vocab`)."""
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
    save = ""
    if not (model_dir / "tokenizer.json").exists():  # data prep reads tokenizer.json only
        save = ", once AutoTokenizer.from_pretrained(dir).save_pretrained(dir) has written its tokenizer.json"
    raise DataError(
        f"{data_key}={shown(data_path)} was tokenized by {shown(data_tok)}, not by {model_key}={shown(model_dir)}'s "
        f"tokenizer ({'; '.join(diffs[:3])}): the model would read every id as another token; prepare the data "
        f"with the model's tokenizer, `{prep_command('<new dir>', model_dir, int(manifest['seq_len']))}`{save}, "
        f"and point {data_key} at it"
    )
