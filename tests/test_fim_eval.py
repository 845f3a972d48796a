"""FIM evaluation (ultrascale/eval/fim.py): spans, prompts in data prep's FIM layout, scoring against planted
completions, the eval.py task end to end on a real tiny model, and the one-line refusal of a model without FIM
tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TEST_ENV, run_py
from tests.test_ssd_prompts import write_corpus
from ultrascale.config.compose import compose, typed
from ultrascale.errors import ConfigError
from ultrascale.eval import fim
from ultrascale.paths import PROJECT_ROOT

CODE = '''import math


def area(r):
    """Area of a circle."""
    return math.pi * r * r


class Box:
    def __init__(self, w, h):
        self.w = w
        self.h = h

    def size(self):
        return self.w * self.h
'''


def _spans() -> list[fim.Span]:
    return [fim.cut(CODE, "geo.py", kind, seed) for kind in fim.KINDS for seed in range(4)]


def test_spans_of_each_kind_cut_the_file_where_the_papers_do():
    for s in _spans():
        assert s.prefix + s.middle + s.suffix == CODE and s.middle.strip()
        if s.kind == "single_line":
            assert "\n" not in s.middle and s.prefix.endswith("\n") and s.suffix.startswith("\n")
        elif s.kind == "multi_line":
            assert 2 <= s.middle.count("\n") + 1 <= 6 and (s.prefix == "" or s.prefix.endswith("\n"))
        else:
            assert 1 <= len(s.middle) <= 120
    assert fim.cut(CODE, "geo.py", "multi_line", 7) == fim.cut(CODE, "geo.py", "multi_line", 7)  # seeded
    assert len({fim.cut(CODE, "geo.py", "random_span", s) for s in range(8)}) > 1
    assert fim.cut("\n\n", "empty.py", "single_line", 0) is None


def test_scores_against_planted_completions_perfect_is_1_empty_is_0():
    spans = _spans()
    rows = [(s, m, s.middle) for s in spans for m in ("psm", "spm")]
    perfect = fim.score(rows)
    assert {k: v for k, v in perfect.items() if not k.endswith("/n")} == {
        f"{g}/{m}/{x}": 1.0 for g in (*fim.KINDS, "all") for m in ("psm", "spm")
        for x in ("exact_match", "edit_similarity")
    }  # fmt: skip
    assert perfect["all/psm/n"] == len(spans) and perfect["single_line/spm/n"] == 4
    empty = fim.score([(s, m, "") for s, m, _ in rows])
    assert all(v == 0.0 for k, v in empty.items() if not k.endswith("/n"))
    span = fim.Span("f.py", "single_line", "", "    return a + b", "\n")
    off = fim.score([(span, "psm", "return a - b  ")])  # stripped, one substitution in 12 characters
    assert off["all/psm/exact_match"] == 0.0 and off["all/psm/edit_similarity"] == pytest.approx(11 / 12)
    assert fim.score([(span, "psm", "\n  return a + b\n")])["all/psm/exact_match"] == 1.0
    assert fim.levenshtein("kitten", "sitting") == 3 and fim.levenshtein("", "abc") == 3


def test_left_to_right_prompts_are_healed_and_a_single_line_ends_at_its_own_newline(monkeypatch):
    """An l2r prompt ends at the span's line start, a bare newline token that tells a byte-level BPE model the next
    line starts at column 0 (HumanEval's boundary problem, ``humaneval.heal``): it is healed, and the single line,
    which then begins with the newline it gave back, is cut at the next one. PSM keeps its prompt as data prep
    trains it and stops a single line at its first newline."""
    import ultrascale.eval.humaneval as humaneval

    calls = []

    def fake_generate(model, tokenizer, prompts, *, heal_newline, extra_stops, **kw):
        calls.append((heal_newline, list(extra_stops)))
        # what generate returns after unhealing: the model's line, then whatever it wrote next
        return [["    return a + b\n    print(a)"] for _ in prompts]

    monkeypatch.setattr(humaneval, "generate", fake_generate)
    span = fim.Span("f.py", "single_line", "def f(a, b):\n", "    return a + b\n", "")
    block = fim.Span("f.py", "multi_line", "def f(a, b):\n", "    return a + b\n    print(a)\n", "")
    tokens = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    monkeypatch.setattr(fim, "fim_tokens", lambda tok, name="": tokens)
    res = fim.evaluate(None, None, [span, block], modes=("psm", "l2r"), loss=False)
    assert calls == [(False, [("\n",), ()]), (True, [(), ()])]
    assert res["single_line/l2r/exact_match"] == 1.0 and res["multi_line/l2r/exact_match"] == 1.0


_FIM_MODEL: list[Path] = []
"""The fixture's directory, built once a session: test_infill imports the fixture, and pytest keeps a module-scoped
fixture per module that names it, so it was trained and saved twice (about 10 s on a 2-core box)."""


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> Path:
    """A tiny Llama with data prep's tokenizer (trained here on stdlib sources, FIM tokens included), saved as an
    HF directory the way an export is. Tests only read it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from data_prep.tokenizer import save_hf, train_bpe

    if _FIM_MODEL:
        return _FIM_MODEL[0]
    out = tmp_path_factory.mktemp("fim_model")
    texts = [f.read_text(errors="replace") for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:30]]
    save_hf(train_bpe(texts, 600), out, 512)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=512, eos_token_id=0, bos_token_id=0,
                      pad_token_id=0)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out)
    _FIM_MODEL.append(out)
    return out


def test_prompts_are_data_preps_fim_layout_token_for_token(fim_model):
    """PSM and SPM as ``data_prep/pack.py`` writes a FIM sample (each piece encoded on its own between the
    sentinels), read through the sampler's own encoding."""
    from transformers import AutoTokenizer

    from data_prep.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, load_dir
    from ultrascale.generate import Sampler

    hf = AutoTokenizer.from_pretrained(str(fim_model))
    raw = load_dir(fim_model)
    sid = {t: raw.token_to_id(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)}
    tokens = fim.fim_tokens(hf)
    enc = lambda s: raw.encode(s).ids  # noqa: E731
    sampler = Sampler.__new__(Sampler)
    sampler.tokenizer = hf
    for s in _spans():
        psm = sampler.encode(fim.prompt(s, "psm", tokens, 1000))
        spm = sampler.encode(fim.prompt(s, "spm", tokens, 1000))
        assert psm == [sid[FIM_PREFIX], *enc(s.prefix), sid[FIM_SUFFIX], *enc(s.suffix), sid[FIM_MIDDLE]]
        assert spm == [sid[FIM_PREFIX], sid[FIM_SUFFIX], *enc(s.suffix), sid[FIM_MIDDLE], *enc(s.prefix)]
    s = _spans()[0]
    assert fim.prompt(s, "l2r", None, 10) == s.prefix[-10:]
    assert fim.prompt(s, "psm", tokens, 5) == f"{tokens[0]}{s.prefix[-5:]}{tokens[1]}{s.suffix[:5]}{tokens[2]}"


def _held_out(tmp_path: Path) -> tuple[Path, Path]:
    corpus = write_corpus(tmp_path / "corpus", {"trainrepo/a.py": "x = 1\n", "valrepo/geo.py": CODE,
                                                "valrepo/more.py": CODE.replace("area", "perimeter")})  # fmt: skip
    prep = tmp_path / "prepared"
    prep.mkdir()
    (prep / "repos.json").write_text(json.dumps({"trainrepo": "train", "valrepo": "validation"}))
    return corpus, prep


def hf_greedy(model_dir: Path, span: fim.Span, mode: str, max_new_tokens: int) -> str:
    """HF ``generate`` (greedy, one unpadded row) on the task's prompt for ``mode``: the l2r prompt healed as
    HumanEval's are; the completion cut at the first newline for a single line."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ultrascale.eval.humaneval import heal, unheal

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    text = fim.prompt(span, mode, fim.fim_tokens(tok) if mode != "l2r" else None, 1000)
    text, k = heal(text) if mode == "l2r" else (text, 0)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0)  # fmt: skip
    completion = unheal(tok.decode(out[0, len(ids) :], skip_special_tokens=True), k)
    return completion.split("\n", 1)[0] if span.kind == "single_line" else completion


def test_eval_py_fim_task_end_to_end_on_held_out_files(fim_model, tmp_path):
    from ultrascale.eval.config import register_eval_configs
    from ultrascale.eval.run import run

    corpus, prep = _held_out(tmp_path)
    register_eval_configs()
    out = tmp_path / "eval"
    cfg = compose([f"model_dir={fim_model}", "tasks=[fim]", f"fim.data={prep}", f"fim.input={corpus}",
                   "fim.modes=[psm,spm,l2r]", "fim.max_new_tokens=8", f"output_dir={out}", "wandb=false"], "eval")  # fmt: skip
    res = run(typed(cfg))["tasks"]["fim"]
    assert (res["files"], res["spans"]) == (2, 6)  # the validation repository's two files, never trainrepo's
    for kind in (*fim.KINDS, "all"):
        for mode in ("psm", "spm", "l2r"):
            assert (
                0.0 <= res[f"{kind}/{mode}/exact_match"] <= res[f"{kind}/{mode}/edit_similarity"] + 1e-9 <= 1.0 + 1e-9
            )
    samples = [json.loads(ln) for ln in (out / "fim_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 18 and {s["file"] for s in samples} == {"valrepo/geo.py", "valrepo/more.py"}
    assert all("\n" not in s["completion"] for s in samples if s["kind"] == "single_line")
    assert np.mean([s["exact_match"] for s in samples if s["mode"] == "psm"]) == res["all/psm/exact_match"]
    # each mode's sample of one span is HF greedy's continuation of the same prompt (the sampler's batching, cache and
    # stops change nothing), cut where the task cuts it
    f = cfg.fim
    docs = fim.held_out_documents(str(prep), str(corpus))
    problems = fim.spans(docs, [str(k) for k in f.kinds], f.files, f.seed, f.max_lines, f.max_span_chars)
    assert [(p.file, p.kind, p.middle) for p in problems] == [(s["file"], s["kind"], s["middle"]) for s in samples[:6]]
    j = next(j for j, p in enumerate(problems) if p.prefix.strip())  # an empty l2r prompt has nothing to continue
    for i, mode in enumerate(("psm", "spm", "l2r")):
        sample, span = samples[i * len(problems) + j], problems[j]
        assert sample["mode"] == mode
        assert sample["completion"] == hf_greedy(fim_model, span, mode, max_new_tokens=8), (mode, sample)


def test_a_model_without_fim_tokens_is_one_error_line(smollm2_135m, tmp_path):
    from transformers import AutoTokenizer

    with pytest.raises(ConfigError, match="has no FIM tokens"):
        fim.fim_tokens(AutoTokenizer.from_pretrained(str(smollm2_135m)))
    corpus, prep = _held_out(tmp_path)
    cmd = [sys.executable, "eval.py", f"model_dir={smollm2_135m}", "tasks=[fim]", f"fim.data={prep}",
           f"fim.input={corpus}", "wandb=false", f"output_dir={tmp_path / 'out'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env={**os.environ, **TEST_ENV}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "has no FIM tokens" in errors[0] and "fim.modes=[l2r]" in errors[0]


def test_in_training_eval_includes_fim_on_the_datas_held_out_files(tmp_path):
    """``train.eval_fim``: data prep (FIM on) over the fixture corpus, a tiny model trained 2 steps on 1 rank; its
    closing eval row carries FIM exact match and edit similarity, every completion is kept per eval."""
    from tests.conftest import FAST, check, launch, metrics
    from tests.test_data_prep import FIXTURE

    data = tmp_path / "data"
    prep = [sys.executable, "-m", "data_prep", f"input={FIXTURE}", f"output_dir={data}", "tokenizer.vocab_size=400",
            "pack.seq_len=64", "split.validation_fraction=0.3", "executor.progress=false"]  # fmt: skip
    check(run_py(prep[1:], cwd=PROJECT_ROOT))
    out = tmp_path / "run"
    args = ["model=tiny", *FAST, f"data.path={data}", "train.steps=2", "train.eval_fim=2",
            f"train.eval_fim_input={FIXTURE}", f"output_dir={out}"]  # fmt: skip
    check(launch(args, nproc=0))
    evals = [r for r in metrics(out) if r.get("event") == "eval"]
    assert len(evals) == 1 and 0.0 <= evals[0]["fim_exact_match"] <= evals[0]["fim_edit_similarity"] <= 1.0
    assert evals[0]["fim_files"] == 2
    samples = [json.loads(ln) for ln in (out / "fim" / "step_00000002.jsonl").read_text().splitlines()]
    assert {s["mode"] for s in samples} == {"psm"} and len({s["file"] for s in samples}) == 2
    repos = json.loads((data / "repos.json").read_text())
    assert all(repos[s["file"].split("/")[0]] == "validation" for s in samples)
