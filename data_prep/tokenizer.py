"""The tokenizer: a byte-level BPE trained on the corpus with ``tokenizers``, or a local HF tokenizer directory.

Saved as an HF tokenizer directory (tokenizer.json + tokenizer_config.json) that ``AutoTokenizer`` loads,
written without importing transformers (it costs seconds at every prep). Special tokens take the first
ids, inside the ``vocab_size`` budget, so a model with that vocabulary can embed every id.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from ultrascale.errors import ConfigError, DataError

EOS = "<|endoftext|>"
FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD = "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"
REPO_NAME, FILE_SEP = "<repo_name>", "<file_sep>"
SPECIAL_TOKENS = [EOS, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD, REPO_NAME, FILE_SEP]


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(
            f"tokenizer.vocab_size={vocab_size} is below the 256 byte symbols + {len(SPECIAL_TOKENS)} special tokens: "
            f"use at least {256 + len(SPECIAL_TOKENS)}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_hf(tok, out_dir: Path, model_max_length: int) -> None:
    """Write an AutoTokenizer-loadable directory atomically (tmp dir + rename)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    special = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
    extra = [t for t in SPECIAL_TOKENS if t != EOS]
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": model_max_length,
                "clean_up_tokenization_spaces": False,
                "add_prefix_space": False,
                **special,
                "additional_special_tokens": extra,
            },
            indent=2,
        )
    )
    (tmp / "special_tokens_map.json").write_text(json.dumps({**special, "additional_special_tokens": extra}, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def load_local(path: str, fim: bool = True):
    """A local HF tokenizer directory; it must already define the special tokens we emit.

    EOS always (documents are joined with it); the FIM sentinels only when FIM is on: a pretrained model's
    tokenizer without them (SmolLM2's, for one) is fine for plain next-token data.
    """
    from tokenizers import Tokenizer

    p = Path(path)
    if not (p / "tokenizer.json").exists():
        raise DataError(
            f"tokenizer.path={path} has no tokenizer.json: point it at a local HF (fast) tokenizer directory"
        )
    tok = Tokenizer.from_file(str(p / "tokenizer.json"))
    if tok.token_to_id(EOS) is None:
        raise DataError(f"tokenizer.path={path} has no {EOS} token: add it or train one (tokenizer.path=null)")
    missing = [t for t in SPECIAL_TOKENS[1:5] if tok.token_to_id(t) is None] if fim else []
    if missing:
        raise DataError(
            f"tokenizer.path={path} lacks the FIM tokens {missing}: set fim.rate=0 (no fill-in-the-middle "
            "samples), add the tokens, or train one (tokenizer.path=null)"
        )
    return tok


def copy_local(path: str, out_dir: Path) -> None:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(path, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def special_ids(tok) -> dict[str, int | None]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def load_dir(path: str | Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a source file is text, not EOS
    return tok
