"""``python -m data_prep.chat input=FILE.jsonl output_dir=DIR tokenizer=MODEL_DIR``: chat conversations as
packed, loss-masked training shards.

Each line of the input is ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`` (other
keys are kept out of the shards; an ``id`` names the conversation in errors). A conversation is rendered by the
tokenizer's own chat template (``tokenizer.apply_chat_template``: SmolLM2-Instruct's ChatML, a Llama or Qwen
template, whatever the model was tuned with), so training sees exactly the text the model will be prompted with.
Only assistant turns are targets, their spans read off the template itself (:func:`assistant_spans`).
Conversations are packed whole into rows of ``seq_len`` with a separator token between them (:func:`separator`),
by SSD's supervised-set writer (:func:`ultrascale.data.supervised.write_packed`): the output is a standard
prepared dataset that ``train.py data.path=DIR`` trains on.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from data_prep.config import register_configs
from ultrascale.config.compose import compose
from ultrascale.config.describe import help_if_asked
from ultrascale.errors import ConfigError, DataError, UltrascaleError
from ultrascale.paths import resolve_path

log = logging.getLogger("ultrascale")

ROLES = ("system", "user", "assistant")
SEPARATOR_CANDIDATES = ("<|endoftext|>",)
"""Tried after the tokenizer's EOS as the separator between packed conversations."""


def read_conversations(path: str | Path, counts: Counter) -> list[tuple[str, list[dict]]]:
    """``(id, messages)`` of every well-formed line; malformed ones are counted (``bad_line``) and the first is named
    in the error when none is left. Conversations without an assistant turn teach nothing: ``no_assistant``."""
    p = resolve_path(path)
    if not p.is_file():
        raise DataError(f"input={path}: no such file (one JSON object with a 'messages' list per line)")
    out, first_bad = [], None
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            why = None
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row, why = None, f"not JSON ({e.msg})"
            msgs = row.get("messages") if isinstance(row, dict) else None
            if why is None and not (isinstance(msgs, list) and msgs):
                why = "no non-empty 'messages' list"
            for m in msgs if why is None else []:
                if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                    why = f"a message is not {{'role': one of {list(ROLES)}, 'content': a string}}: {str(m)[:80]}"
                    break
            if why is not None:
                counts["bad_line"] += 1
                first_bad = first_bad or f"{p}:{n}: {why}"
                continue
            if not any(m["role"] == "assistant" for m in msgs):
                counts["no_assistant"] += 1
                continue
            out.append((str(row.get("id", f"line{n}")), [{"role": m["role"], "content": m["content"]} for m in msgs]))
    if not out:
        raise DataError(f"input={path}: no conversation to train on ({dict(counts)})" +
                        (f"; first bad line: {first_bad}" if first_bad else ""))  # fmt: skip
    if first_bad:
        log.warning(f"chat: skipped {counts['bad_line']} malformed lines (first: {first_bad})")
    return out


def render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn: from where its content begins to
    its end-of-turn markup, read off the template.

    Not parsed from the markup: the conversation up to an assistant turn rendered with ``add_generation_prompt``
    ends where that turn's content begins, and the conversation through the turn ends where it ends (its
    end-of-turn token included, so the model learns to stop; trailing whitespace the template adds between turns
    is not). Every token that overlaps such a span carries loss; system and user turns, the role headers and the
    template's own system prompt are context only. A template that does not render a conversation as its turns
    one after another cannot be split this way and is refused."""
    text, spans = render(tokenizer, messages), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        through = render(tokenizer, messages[: i + 1])
        if not (i and text.startswith(before) and through.startswith(before) and text.startswith(through)):
            raise DataError(
                f"the tokenizer's chat template does not render this conversation as its turns one after another "
                f"(turn {i}, {'the first' if not i else 'an'} assistant turn): the assistant tokens cannot be "
                "located; a conversation must start with a system or user turn, and the template must render each "
                "prefix of a conversation as a prefix of it"
            )
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def encode_conversation(tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one conversation: True on every token overlapping an assistant span."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for j, (a, b) in enumerate(enc["offset_mapping"]):
        mask[j] = any(a < end and b > start for start, end in spans)
    return ids, mask


def separator(tokenizer, conversations: list[np.ndarray], asked: str | None) -> tuple[str, int]:
    """The token between packed conversations (the manifest's ``eos_token_id``): ``asked``, or the first candidate
    that is a single token of the vocabulary and never occurs inside a conversation.

    It is the manifest's EOS so that the loader's document masking keeps each conversation's attention and
    positions to itself; it must never occur inside a rendered conversation, which rules out ChatML's
    ``<|im_end|>``: by default the first of the tokenizer's EOS and ``<|endoftext|>`` that does not. Packing, the
    seeded split of whole conversations into validation and the shard format are the supervised set's
    (:func:`ultrascale.data.supervised.write_packed`)."""
    candidates = [asked] if asked else [t for t in (tokenizer.eos_token, *SEPARATOR_CANDIDATES) if t]
    inside: set[int] = set()
    for ids in conversations:
        inside.update(np.unique(ids).tolist())
    reasons = []
    for tok in candidates:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is None or (tid == tokenizer.unk_token_id and tok != tokenizer.unk_token):
            reasons.append(f"{tok!r} is not a token of this tokenizer")
        elif tid in inside:
            reasons.append(f"{tok!r} occurs inside the rendered conversations (it would cut them apart)")
        else:
            return tok, int(tid)
    raise DataError(f"no separator between packed conversations: {'; '.join(reasons)}; set separator_token to a "
                    "special token the chat template never writes")  # fmt: skip


def prepare(cfg) -> dict:
    """Render, mask, pack and write ``cfg.input``'s conversations to ``cfg.output_dir``; returns the report."""
    from transformers import AutoTokenizer

    from ultrascale.data.supervised import write_packed

    if not cfg.input or not cfg.output_dir:
        raise ConfigError("python -m data_prep.chat needs input=FILE.jsonl and output_dir=DIR")
    tok_dir = resolve_path(cfg.tokenizer)
    if not (tok_dir / "tokenizer_config.json").exists() and not (tok_dir / "tokenizer.json").exists():
        raise ConfigError(f"tokenizer={cfg.tokenizer}: not a tokenizer directory (the model's HF directory)")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    if not tokenizer.chat_template:
        raise ConfigError(f"tokenizer={cfg.tokenizer} has no chat template (chat_template.jinja or tokenizer_config's "
                          "chat_template): use the instruct model's directory, whose template the model was tuned on")  # fmt: skip
    counts: Counter = Counter()
    convs = read_conversations(cfg.input, counts)
    encoded = []
    for cid, msgs in convs:
        ids, mask = encode_conversation(tokenizer, msgs)
        if len(ids) + 1 > cfg.seq_len:
            counts["too_long"] += 1
            continue
        encoded.append((cid, ids, mask))
    if not encoded:
        raise DataError(f"every conversation is longer than seq_len={cfg.seq_len} tokens: raise seq_len")
    sep, sep_id = separator(tokenizer, [i for _, i, _ in encoded], cfg.separator_token)
    encoded = [(c, np.append(i, sep_id), np.append(m, False)) for c, i, m in encoded]

    def report(packed: dict) -> dict:
        return {"input": str(cfg.input), "tokenizer": str(cfg.tokenizer), "conversations": len(encoded),
                **{k: counts[k] for k in ("bad_line", "no_assistant", "too_long")},
                "train_conversations": packed["train_groups"], "validation_conversations": packed["validation_groups"],
                "train_rows": packed["train_rows"], "validation_rows": packed["validation_rows"],
                "assistant_tokens": packed["target_tokens"], "context_tokens": packed["context_tokens"],
                "separator": sep, "separator_id": sep_id}  # fmt: skip

    return write_packed(encoded, tokenizer, resolve_path(cfg.output_dir), seq_len=cfg.seq_len, pad=sep_id,
                        validation_fraction=cfg.validation_fraction, seed=cfg.seed, key="chat", report=report)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    if (rc := help_if_asked("data_prep_chat", argv, __doc__)) is not None:
        return rc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    try:
        cfg = compose(argv, config_name="data_prep_chat")
        stats = prepare(cfg)
    except UltrascaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {cfg.output_dir}: {json.dumps(stats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
