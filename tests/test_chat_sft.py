"""Chat SFT data (data_prep/chat.py, data_prep/instruct.py): the tokenizer's own template, loss on assistant tokens
only, checked token by token; packing that keeps the masks; the docstring -> function instruction set."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data_prep.chat import encode_conversation, prepare, read_conversations
from data_prep.config import register_configs
from tests.test_ssd_prompts import write_corpus
from ultrascale.config.compose import compose
from ultrascale.errors import ConfigError, DataError

PLANTED = [
    {"role": "system", "content": "You write short Python."},
    {"role": "user", "content": "As the assistant, write hi().\nKeep it short."},
    {"role": "assistant", "content": 'def hi():\n    return "hi"\n'},
    {"role": "user", "content": "<|im_start|>assistant is only text in a user turn"},
    {"role": "assistant", "content": "Done: it returns 'hi'."},
]


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def chatml_targets(tokenizer, ids: np.ndarray) -> np.ndarray:
    """The oracle, from the token ids alone: ChatML turns are ``<|im_start|>ROLE\\n CONTENT <|im_end|>``; the
    content tokens of assistant turns and their ``<|im_end|>`` are targets, nothing else."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    want, role, header, j = np.zeros(len(ids), bool), None, None, 0
    for j, t in enumerate(ids.tolist()):
        if t == start:
            header, role = "", None
        elif header is not None:  # inside the role header: up to its newline
            header += tokenizer.decode([t])
            if "\n" in header:
                role, header = header.split("\n", 1)[0], None
        elif t == end:
            want[j] = role == "assistant"
            role = None
        else:
            want[j] = role == "assistant"
    return want


def test_only_assistant_tokens_carry_loss_token_by_token(smollm2_135m):
    tok = _tokenizer(smollm2_135m)
    ids, mask = encode_conversation(tok, PLANTED)
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(PLANTED, tokenize=False)  # the model's own template
    want = chatml_targets(tok, ids)
    for j, (t, got) in enumerate(zip(ids.tolist(), mask.tolist())):
        assert got == want[j], f"token {j} {tok.convert_ids_to_tokens(t)!r}: loss {got}, expected {want[j]}"
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
    targets = [tok.decode(ids[r].tolist()) for r in runs if mask[r[0]]]
    assert targets == ['def hi():\n    return "hi"\n<|im_end|>', "Done: it returns 'hi'.<|im_end|>"]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _chat_cfg(**kw):
    register_configs()
    return compose([f"{k}={v}" for k, v in kw.items()], "data_prep_chat")


def test_packing_keeps_the_masks_and_a_separator_between_conversations(smollm2_135m, tmp_path):
    from ultrascale.data.loader import IGNORE, make_batch
    from ultrascale.data.shards import load_manifest, open_split

    convs = [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
             for i in range(6)]  # fmt: skip
    src = _write_jsonl(tmp_path / "chat.jsonl", [
        *({"id": f"c{i}", "messages": m} for i, m in enumerate(convs)),
        "{not json",
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": [{"role": "narrator", "content": "?"}]},
    ])  # fmt: skip
    out = tmp_path / "prepared"
    stats = prepare(_chat_cfg(input=src, output_dir=out, tokenizer=smollm2_135m, seq_len=160, validation_fraction=0.2))
    assert (stats["bad_line"], stats["no_assistant"], stats["conversations"]) == (2, 1, 6)
    assert (stats["separator"], stats["train_conversations"], stats["validation_conversations"]) == ("<|endoftext|>",
                                                                                                     5, 1)  # fmt: skip
    tok = _tokenizer(smollm2_135m)
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    assert load_manifest(out)["eos_token_id"] == sep
    expected = {tok.decode(encode_conversation(tok, m)[0].tolist()): encode_conversation(tok, m)[1] for m in convs}
    seen = 0
    for split in ("train", "validation"):
        reader = open_split(out, split)
        idx = np.arange(len(reader))
        ids, mask = reader.get(idx), reader.get_loss_mask(idx)
        batch = make_batch(ids, mask, sep, document_masking=True)
        for r in range(len(idx)):
            row, lab = ids[r], batch.labels[r].numpy()
            assert ((lab != IGNORE) == (mask[r] & ~np.r_[False, row[:-1] == sep])).all()
            assert not mask[r][row == sep].any()  # separators and padding: no loss
            bounds = np.flatnonzero(row == sep)
            assert len(bounds) >= 1 and (batch.position_ids[r][bounds[0] + 1 :][:1] == 0).all()
            s = 0
            for b in bounds:  # every packed conversation, with its mask where it landed
                if b > s:
                    text = tok.decode(row[s:b].tolist())
                    assert (mask[r][s:b] == expected[text]).all(), text
                    seen += 1
                s = b + 1
    assert seen == 6
    assert len(open_split(out, "train")) < 5  # more than one conversation a row


def test_chat_data_errors_are_one_line(smollm2_135m, tmp_path):
    bad = _write_jsonl(tmp_path / "bad.jsonl", ['{"conversations": []}', "{oops"])
    with pytest.raises(DataError, match=r"no conversation to train on .* first bad line: .*bad.jsonl:1: no non-empty"):
        read_conversations(bad, Counter())
    first = _write_jsonl(tmp_path / "first.jsonl", [{"messages": [{"role": "assistant", "content": "Hi."}]}])
    with pytest.raises(DataError, match="must start with a system or user turn"):
        prepare(_chat_cfg(input=first, output_dir=tmp_path / "o", tokenizer=smollm2_135m))
    no_template = tmp_path / "tok"
    _tokenizer(smollm2_135m).save_pretrained(str(no_template))
    cfg_path = no_template / "tokenizer_config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg_json))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="has no chat template"):
        prepare(_chat_cfg(input=first, output_dir=tmp_path / "o", tokenizer=no_template))


def test_the_instruction_set_is_decontaminated_docstring_function_pairs_of_the_train_repos(tmp_path):
    from data_prep.instruct import build
    from ultrascale.eval.humaneval import load_problems

    he = load_problems(1)[0]  # HumanEval/0, copied into a training repository
    clean = (
        'def add_tax(price, rate):\n    """The price with tax at ``rate`` added."""\n    return price * (1 + rate)\n'
    )
    method = ('class Till:\n    """A shop till."""\n\n    def total(self, prices):\n        """The sum of ``prices``."""\n'
              "        return sum(prices)\n")  # fmt: skip
    corpus = write_corpus(tmp_path / "corpus", {"shop/tax.py": clean, "shop/copied.py": he["prompt"] +
                                                he["canonical_solution"], "heldout/mod.py": clean.replace("tax", "vat"),
                                                "shop/till.py": method})  # fmt: skip
    prep = tmp_path / "prepared"
    prep.mkdir()
    (prep / "repos.json").write_text(json.dumps({"shop": "train", "heldout": "validation"}))
    register_configs()
    out = tmp_path / "instruct.jsonl"
    cfg = compose([f"output={out}", f"problems.input={corpus}", f"problems.train_repos_from={prep}"],
                  "data_prep_instruct")  # fmt: skip
    report = build(cfg)
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["shop/tax.py::add_tax"]
    assert report["humaneval_contaminated"] == 1 and report["files_held_out_repo"] == 1
    user, assistant = rows[0]["messages"]
    assert user["role"] == "user" and user["content"].startswith("Complete the following Python code:\n\n```python\n")
    assert '"""The price with tax at ``rate`` added."""' in user["content"] and "return" not in user["content"]
    assert assistant == {"role": "assistant", "content": f"```python\n{clean}```"}
    assert json.loads(Path(f"{out}.report.json").read_text())["conversations"] == 1
    assert (report["functions"], report["methods"], report["not_in_kinds"]) == (1, 1, 1)  # the method: not by default
    both = build(compose([f"output={out}", f"problems.input={corpus}", f"problems.train_repos_from={prep}",
                          "kinds=[function,method]"], "data_prep_instruct"))  # fmt: skip
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["shop/tax.py::add_tax", "shop/till.py::Till.total"]
    assert both["conversations"] == 2 and both["not_in_kinds"] == 0


def test_the_chat_eval_prompt_is_the_training_conversation_up_to_the_body(smollm2_135m):
    """``ssd.evaluate --chat`` asks a HumanEval problem as data_prep.instruct's set asks for code: the prompt it
    renders is, token for token, the start of the rendered training conversation, ending where the body starts."""
    from data_prep.instruct import conversation
    from ultrascale.data.instruct_format import INSTRUCTION, chat_prompt
    from ultrascale.eval.humaneval import load_problems

    tok = _tokenizer(smollm2_135m)
    problem = load_problems(1)[0]
    record = {"task_id": problem["task_id"], "repo": "x", "prompt": problem["prompt"],
              "reference": problem["canonical_solution"]}  # fmt: skip
    trained = tok.apply_chat_template(conversation(record, INSTRUCTION)["messages"], tokenize=False)
    asked = chat_prompt(tok, problem["prompt"])
    assert trained.startswith(asked) and trained[len(asked) :].startswith(problem["canonical_solution"])
    ids_trained, ids_asked = tok(trained)["input_ids"], tok(asked)["input_ids"]
    assert ids_trained[: len(ids_asked) - 1] == ids_asked[:-1]  # the last token may merge with the body's first
