"""The tokenizer: a byte-level BPE trained on the corpus with ``tokenizers``, or a local HF tokenizer directory.

Saved as an HF tokenizer directory (tokenizer.json + tokenizer_config.json) that ``AutoTokenizer`` loads,
written without importing transformers (it costs seconds at every prep). Special tokens take the first
ids, inside the ``vocab_size`` budget, so a model with that vocabulary can embed every id.

:func:`encode_texts` is the one place text becomes token ids. It hands the tokenizer less text: byte-level BPE
with the GPT-2 split regex never lets a token cross certain cuts, so each distinct part of a batch is encoded once
and the ids are gathered back with numpy; tokenizers for which the cuts are not provably neutral are encoded
whole (:func:`piece_cuts_are_neutral`). The profile behind it and its figures: data_prep/README.md, "Tokenize +
pack".
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from itertools import chain
from pathlib import Path

import numpy as np

from ultrascale.errors import ConfigError, DataError

EOS = "<|endoftext|>"
FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD = "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"
REPO_NAME, FILE_SEP = "<repo_name>", "<file_sep>"
SPECIAL_TOKENS = [EOS, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD, REPO_NAME, FILE_SEP]
FIM_TOKENS = [FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD]
"""StarCoder's FIM sentinels, in StarCoder's id order: what the FIM layout (:mod:`data_prep.pack`) and the FIM eval
emit, and what ``tokenizer.add_fim`` adds to a pretrained tokenizer that lacks them."""


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

    EOS always (documents are joined with it); the FIM sentinels only when FIM is on and they are not added
    (``tokenizer.add_fim``): a pretrained model's tokenizer without them (SmolLM2's, for one) is fine for plain
    next-token data.
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
    missing = [t for t in FIM_TOKENS if tok.token_to_id(t) is None] if fim else []
    if missing:
        raise DataError(
            f"tokenizer.path={path} lacks the FIM tokens {missing}: set tokenizer.add_fim=true (adds them after its "
            "vocabulary; the model's embedding grows to match), fim.rate=0 (no fill-in-the-middle samples), or "
            "train one (tokenizer.path=null)"
        )
    return tok


def copy_local(path: str, out_dir: Path) -> None:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(path, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def add_special(tok_dir: Path, tokens: list[str]) -> dict[str, int]:
    """Give the tokenizer in ``tok_dir`` the ``tokens`` it lacks, as special tokens with the ids right after its
    vocabulary (``tokenizer.json`` and ``tokenizer_config.json`` rewritten); returns each added token's id.

    Appended, never inserted: every id the pretrained model knows keeps its meaning, and the model grows only new
    rows for the new ids (:func:`ultrascale.model.weights.grow_rows`). Special, so text never encodes to them and
    ``decode(skip_special_tokens=True)`` drops them, as it does StarCoder's."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    new = [t for t in tokens if tok.token_to_id(t) is None]
    tok.add_special_tokens(new)
    ids = {t: tok.token_to_id(t) for t in new}
    if sorted(ids.values()) != list(range(size, size + len(new))):  # holes in the vocabulary: ids would collide
        raise DataError(f"tokenizer at {tok_dir} gave the added tokens ids {ids}, not {size}..: its vocabulary "
                        "has holes; add the tokens yourself or train one (tokenizer.path=null)")  # fmt: skip
    tok.save(str(tok_dir / "tokenizer.json"))
    conf_path = tok_dir / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text()) if conf_path.exists() else {}
    decoder = conf.get("added_tokens_decoder")
    if isinstance(decoder, dict):  # transformers reads the added tokens from here when it is present
        for t, i in ids.items():
            decoder[str(i)] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True}  # fmt: skip
    extra_key = "extra_special_tokens" if "extra_special_tokens" in conf else "additional_special_tokens"
    extra = conf.get(extra_key) or []
    if isinstance(extra, list):
        conf[extra_key] = [*extra, *(t for t in new if t not in extra)]
    conf_path.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")
    return ids


def special_ids(tok) -> dict[str, int | None]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def load_dir(path: str | Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a source file is text, not EOS
    return tok


# Two levels of cuts, both where the split regex ends a match whatever follows, so ids never change:
# 1. pieces: before ASCII whitespace that follows anything else. The regex (Oniguruma \s, Unicode
#    White_Space) ends a match there unless the character before is itself whitespace outside ASCII: that
#    set is _WIDE_SPACE, and a text containing any of it is not cut (ASCII texts skip the check). Python's
#    \s would be wrong: U+001C..U+001F are Python whitespace but regex punctuation.
# 2. parts, inside a distinct ASCII piece without an apostrophe: between a letter/digit run and a
#    punctuation run (`` self.assertEqual(`` -> `` self``, ``.``, ``assertEqual``, ``(``). Letter and
#    digit runs end at punctuation and punctuation runs at letters; only the contractions (``'s``) span
#    both, hence no apostrophe. Parts are cut only when no added token occurs in the batch's text.
# Tests check every code point (level 1) and every ASCII pair (level 2) against the installed tokenizer.
_PIECE = re.compile(r"[ \t\n\r\f\v]*[^ \t\n\r\f\v]+|[ \t\n\r\f\v]+")
_WIDE_SPACE = re.compile("[\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")
_PART = re.compile(r"[ \t\n\r\f\v]*(?:[A-Za-z0-9]+|[^A-Za-z0-9 \t\n\r\f\v]+)")
_JOIN = 64  # parts per joined input: 32..128 measure alike; 4096 was slower than not joining at all


def piece_cuts_are_neutral(tok) -> bool:
    """Whether the cuts :func:`encode_texts` makes (see ``_PIECE``, ``_PART``) leave a text's ids unchanged.

    True for byte-level BPE with the GPT-2 split regex (ours, GPT-2's, SmolLM2's; StarCoder's adds
    ``Digits`` first, also fine): ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|
    \\s+(?!\\S)|\\s+`` ends a match at each cut, has no look-behind, and BPE works inside one match.
    Anything that could see across a cut (a normalizer, another split regex such as Llama 3's, which
    glues ``):\\n`` into one token, a prefix space, truncation, BPE dropout, an added token with
    whitespace or strip flags) makes this False and texts are encoded whole.
    """
    cfg = json.loads(tok.to_str())
    if cfg.get("normalizer") is not None or cfg.get("truncation") is not None or cfg.get("padding") is not None:
        return False
    model = cfg.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return False
    pre = cfg.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps:
        return False
    *first, last = steps
    byte_level = last.get("type") == "ByteLevel" and last.get("use_regex", True) and not last.get("add_prefix_space")
    if not byte_level or any(s.get("type") != "Digits" for s in first):
        return False
    return all(
        not t.get("rstrip") and not t.get("lstrip") and not any(c.isspace() for c in t["content"])
        for t in cfg.get("added_tokens", [])
    )


def _pieces(text: str) -> list[str]:
    return [text] if not text.isascii() and _WIDE_SPACE.search(text) else _PIECE.findall(text)


def _parts(pieces: list[str]) -> list[list[str]]:
    # A piece is whitespace then non-space, so the parts join back to it; an all-space piece stays whole.
    return [(_PART.findall(p) or [p]) if p.isascii() and "'" not in p else [p] for p in pieces]


def _offsets(lens: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def _distinct(groups: list[list[str]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(distinct strings in first-seen order, each member's index into them, group sizes)."""
    members = list(chain.from_iterable(groups))
    distinct = list(dict.fromkeys(members))
    index = dict(zip(distinct, range(len(distinct)), strict=True))
    plan = np.fromiter(map(index.__getitem__, members), dtype=np.int64, count=len(members))
    return distinct, plan, np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))


def _gather(ids: np.ndarray, off: np.ndarray, plan: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group, the concatenated ids of its members (``plan``: member -> distinct string, ``off``: its ids)."""
    starts, lens = off[:-1][plan], np.diff(off)[plan]
    out = _offsets(lens)
    # Output position j of member k reads ids[starts[k] + (j - out[k])].
    src = np.repeat(starts - out[:-1], lens) + np.arange(out[-1], dtype=np.int64)
    return ids[src], out[_offsets(sizes)]


def _encode_list(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    ids = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)] if texts else []
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    return np.fromiter(chain.from_iterable(ids), dtype=np.uint32, count=int(lens.sum())), _offsets(lens)


def _encode_joined(tok, parts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``_encode_list(tok, parts)`` through few long inputs: ``_JOIN`` parts joined by a special token.

    Special tokens are split out before pre-tokenization, so each part is still encoded on its own; the
    caller has checked that no added token occurs in the text. Falls back to the list if the separators
    do not come back one per part.
    """
    specials = sorted((i, t.content) for i, t in tok.get_added_tokens_decoder().items() if t.special)
    if not specials:
        return _encode_list(tok, parts)
    sep_id, sep = specials[0]
    inputs = [sep.join(parts[i : i + _JOIN]) for i in range(0, len(parts), _JOIN)]
    saved = tok.encode_special_tokens
    tok.encode_special_tokens = False
    try:
        enc = tok.encode_batch_fast(inputs, add_special_tokens=False)
    finally:
        tok.encode_special_tokens = saved
    # Every input gets a separator at its end too, so part i ends at the i-th separator.
    flat = np.fromiter(chain.from_iterable([*e.ids, sep_id] for e in enc), dtype=np.uint32)
    ends = np.flatnonzero(flat == sep_id)
    if len(ends) != len(parts):
        return _encode_list(tok, parts)
    return flat[flat != sep_id], _offsets(ends - np.concatenate([[0], ends[:-1] + 1]))


def encode_texts(tok, texts: list[str], reuse: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of every text (no special tokens added) as one flat uint32 array and ``len(texts) + 1`` offsets.

    Text ``i`` is ``flat[offsets[i] : offsets[i + 1]]``, identical to ``tok.encode(texts[i]).ids``. With
    ``reuse`` (default: :func:`piece_cuts_are_neutral`), texts are cut into whitespace-led pieces and
    distinct pieces into parts; each distinct part is encoded once, and pieces' then texts' ids are
    gathered with numpy (no per-token Python).
    """
    if reuse is None:
        reuse = piece_cuts_are_neutral(tok)
    if not reuse or not texts:
        return _encode_list(tok, texts)
    pieces, plan, sizes = _distinct([_pieces(t) for t in texts])
    added = [t.content for t in tok.get_added_tokens_decoder().values()]
    if any(a in t for a in added for t in texts):  # it would be split out of the joined input, or cut in parts
        ids, off = _encode_list(tok, pieces)
    else:
        parts, part_plan, part_sizes = _distinct(_parts(pieces))
        ids, off = _gather(*_encode_joined(tok, parts), part_plan, part_sizes)
    return _gather(ids, off, plan, sizes)
