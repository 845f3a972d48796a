"""HumanEval-Infilling (ultrascale/eval/infill.py): the paper's task sets to the byte, canonical and empty
completions executed in the real sandbox, the left-to-right cut, and eval.py's infill task on a real tiny model
against HF greedy decoding."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import TEST_ENV, needs, run_py, sandbox_missing
from tests.test_fim_eval import fim_model  # noqa: F401  (the tiny FIM model fixture)
from ultrascale.config.compose import compose, typed
from ultrascale.errors import ConfigError
from ultrascale.eval import infill
from ultrascale.paths import PROJECT_ROOT

needs_sandbox = needs(sandbox_missing())

REFERENCE_SHA256 = {
    "single-line": "413d3565bbc69561a9df481ab507d89bd5fbbcd3a49bf2440d2ca6616526b674",
    "multi-line": "fc62d75a8b33a63cb90e3aa781bc1730b831589f467a2f91d84ddb2d840f5a2a",
}
"""sha256 of ``"\\n".join(json.dumps(task, sort_keys=True))`` over openai/human-eval-infilling's
``data/HumanEval-{SingleLine,MultiLine}Infilling.jsonl.gz`` (every field, in its order): the reference's files."""


def _digest(tasks: list[dict]) -> str:
    return hashlib.sha256("\n".join(json.dumps(t, sort_keys=True) for t in tasks).encode()).hexdigest()


def test_write_gives_the_papers_1033_and_5815_tasks_byte_for_byte(tmp_path):
    single, multi = infill.problems("single-line"), infill.problems("multi-line")
    assert (len(single), len(multi)) == (1033, 5815)
    assert all(re.fullmatch(r"SingleLineInfilling/HumanEval/\d+/L\d+", t["task_id"]) for t in single)
    assert all(re.fullmatch(r"MultiLineInfilling/HumanEval/\d+/L\d+_L\d+", t["task_id"]) for t in multi)
    assert single[0]["task_id"] == "SingleLineInfilling/HumanEval/0/L0" and single[0]["prompt"].endswith('"""\n\n')
    assert _digest(single) == REFERENCE_SHA256["single-line"] and _digest(multi) == REFERENCE_SHA256["multi-line"]
    out = tmp_path / "single.jsonl"
    cmd = [sys.executable, "-m", "ultrascale.eval.infill", "write", "--benchmark", "single-line", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env={**os.environ, **TEST_ENV}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == single and list(rows[0]) == ["task_id", "entry_point", "prompt", "suffix", "canonical_solution",
                                                "test"]  # fmt: skip


def test_random_spans_are_ours_seeded_and_cut_the_solution():
    tasks = infill.problems("random-span")
    assert len(tasks) == 1640 and tasks[0]["task_id"] == "RandomSpanInfilling/HumanEval/0/R0"
    from ultrascale.eval.humaneval import load_problems

    by_n = {p["task_id"].split("/")[1]: p for p in load_problems()}
    for t in tasks:
        p = by_n[t["task_id"].split("/")[2]]
        assert t["prompt"] + t["canonical_solution"] + t["suffix"] == p["prompt"] + p["canonical_solution"]
        assert t["prompt"].startswith(p["prompt"]) and t["canonical_solution"].strip()
    assert len({t["task_id"] for t in tasks}) == 1640
    assert infill.problems("random-span", seed=0) == tasks and infill.problems("random-span", seed=1) != tasks


def _handful() -> tuple[dict[str, dict], list[str]]:
    tasks = {t["task_id"]: t for b in ("single-line", "multi-line") for t in infill.problems(b)}
    picked = ["SingleLineInfilling/HumanEval/0/L0", "SingleLineInfilling/HumanEval/0/L5",
              "SingleLineInfilling/HumanEval/12/L3", "MultiLineInfilling/HumanEval/1/L4_L14",
              "MultiLineInfilling/HumanEval/5/L0_L11"]  # fmt: skip
    return tasks, picked


@needs_sandbox
def test_canonical_solutions_pass_and_empty_ones_fail_in_the_sandbox(tmp_path):
    tasks, picked = _handful()
    canon = infill.score(tasks, [{"task_id": t, "completion": tasks[t]["canonical_solution"]} for t in picked], [1])
    empty = infill.score(tasks, [{"task_id": t, "completion": ""} for t in picked], [1])
    assert (canon["pass@1"], canon["exact_match"], canon["tasks"]) == (1.0, 1.0, len(picked))
    assert (empty["pass@1"], empty["exact_match"]) == (0.0, 0.0), [r["error"] for r in empty["results"]]
    # the command line: two samples per task (one right, one empty) give pass@1 0.5 and pass@2 1.0
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n" for t in picked[:3]
                               for c in (tasks[t]["canonical_solution"], "")))  # fmt: skip
    cmd = [sys.executable, "-m", "ultrascale.eval.infill", "score", "--benchmark", "single-line", "--samples",
           str(samples), "--json", str(tmp_path / "r.json"), "--k", "1", "2", "10"]  # fmt: skip
    proc = run_py(cmd[1:], timeout=120, cwd=PROJECT_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pass@1: 0.5000, pass@2: 1.0000" in proc.stdout and "on 3 of 1033 tasks" in proc.stdout
    res = json.loads((tmp_path / "r.json").read_text())
    assert "pass@10" not in res and [r["passed"] for r in res["results"]] == [True, False] * 3
    wrong = subprocess.run([*cmd[:5], "multi-line", *cmd[6:]], cwd=PROJECT_ROOT, env={**os.environ, **TEST_ENV}, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: samples name 3 task(s) the benchmark does not")


def test_left_to_right_cut_keeps_the_masked_lines():
    single = {"canonical_solution": "    return a\n", "suffix": "    pass\n"}
    assert infill.cut(single, "single-line", "l2r", "    return a + b\n    print(a)\n") == "    return a + b\n"
    assert infill.cut(single, "single-line", "psm", "    return a") == "    return a\n"
    multi = {"canonical_solution": "    x = 1\n    y = 2\n", "suffix": "    return x\n"}
    assert infill.cut(multi, "multi-line", "l2r", "    x = 1\n    y = 3\n    return y\n") == "    x = 1\n    y = 3\n"
    assert infill.cut(multi, "multi-line", "spm", "    x = 1\n    y = 2") == "    x = 1\n    y = 2\n"
    span = {"canonical_solution": "ber ", "suffix": "% 1.0\n"}  # "return num|ber |% 1.0"
    assert infill.cut(span, "random-span", "l2r", "ber % 1.0\n    pass\n") == "ber "
    assert infill.cut(span, "random-span", "psm", "ber") == "ber"


def _hf_greedy(model, tok, prompt: str, n: int) -> str:
    """HF ``generate``, greedy, on one unpadded row: ``prompt`` encoded as the sampler encodes it (special tokens
    spelled out, each piece on its own)."""
    import torch

    from ultrascale.generate import Sampler

    sampler = Sampler.__new__(Sampler)
    sampler.tokenizer = tok
    ids = torch.tensor([sampler.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=0, pad_token_id=0)  # fmt: skip
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


CASES = [("single-line", "psm", 2, 8), ("single-line", "spm", 2, 8), ("single-line", "l2r", 2, 8),
         ("multi-line", "psm", 3, 16), ("multi-line", "l2r", 2, 8), ("random-span", "spm", 1, 8),
         ("random-span", "l2r", 1, 8)]  # fmt: skip
"""(benchmark, mode, tasks, max_new_tokens): every mode on the paper's single lines; the multi-line and random-span
cuts in a FIM mode (the middle runs to EOS) and left to right (cut by the masked line count). multi-line's first
tasks mask one and two lines of HumanEval/0; on the third this model's 16 greedy tokens hold a newline inside."""


def _reference(model, tok, task: dict, benchmark: str, mode: str, fim_tokens: tuple[str, str, str], n: int) -> str:
    """The completion HF greedy gives ``task``: the prompt laid out for ``mode``, then the task set's cut
    (``infill.CUTS``), written out here for the FIM modes; ``l2r``'s line counting is ``infill.cut``'s own (its
    unit test: test_left_to_right_cut_keeps_the_masked_lines), applied to HF's healed, stopped text."""
    from ultrascale.eval.humaneval import STOP_SEQUENCES, truncate

    fp, fs, fm = fim_tokens
    pre, suf = task["prompt"], task["suffix"]
    if mode == "l2r":  # healed: the prompt without its trailing newlines, which the completion gives back
        healed = pre.rstrip("\n")
        text, k = _hf_greedy(model, tok, healed, n), len(pre) - len(healed)
        text = truncate(text[k:] if text.startswith("\n" * k) else text, STOP_SEQUENCES)
        return text.split("\n", 1)[0] + "\n" if benchmark == "single-line" else infill.cut(task, benchmark, mode, text)
    text = _hf_greedy(model, tok, f"{fp}{pre}{fs}{suf}{fm}" if mode == "psm" else f"{fp}{fs}{suf}{fm}{pre}", n)
    if benchmark == "single-line":
        return text.split("\n", 1)[0] + "\n"
    return text if benchmark == "random-span" or text.endswith("\n") else text + "\n"


@needs_sandbox
def test_eval_py_infill_end_to_end_matches_hf_greedy(fim_model, tmp_path, monkeypatch):  # noqa: F811
    """eval.py's infill task, per (task set, mode) of ``CASES``, writes HF greedy's completion of each task's
    prompt, cut as the task set cuts it: the sampler's prompt layout (SPM's suffix first, the prefix right before the
    middle), its stops and its healing, and the cut, on the same prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ultrascale.eval import fim, sandbox
    from ultrascale.eval.config import check, register_eval_configs
    from ultrascale.eval.run import run

    register_eval_configs()
    tok = AutoTokenizer.from_pretrained(str(fim_model))
    model = AutoModelForCausalLM.from_pretrained(str(fim_model)).eval()
    tokens = fim.fim_tokens(tok)
    cfg = compose([f"model_dir={fim_model}", "tasks=[infill]", "wandb=false"], "eval")
    for benchmark, mode, n, new in CASES:  # the composed config's keys set per case (composing each costs a second)
        out = tmp_path / f"{benchmark}_{mode}"
        cfg.infill.benchmark, cfg.infill.mode, cfg.infill.limit, cfg.output_dir = benchmark, mode, n, str(out)
        cfg.infill.max_new_tokens = new
        res = run(typed(cfg))["tasks"]["infill"]
        monkeypatch.setattr(sandbox, "check_available", lambda: None)  # checked for real by the first case (0.4 s)
        tasks = infill.problems(benchmark)
        assert (res["tasks"], res["of"], res["mode"]) == (n, len(tasks), mode) and res["pass@1"] == 0.0
        samples = [json.loads(line) for line in (out / "infill_samples.jsonl").read_text().splitlines()]
        assert [s["task_id"] for s in samples] == [t["task_id"] for t in tasks[:n]]
        assert any(s["completion"].strip() for s in samples)  # the model wrote something: the comparison has teeth
        for t, s in zip(tasks, samples):
            want = _reference(model, tok, t, benchmark, mode, tokens, new)
            assert s["completion"] == want, (benchmark, mode, t["task_id"], s["completion"], want)
        if (benchmark, mode) == ("multi-line", "psm"):  # a middle past its first line: cut at EOS, not at a newline
            assert any("\n" in s["completion"].rstrip("\n") for s in samples), samples
    with pytest.raises(ConfigError, match=r"infill\.k=\[1, 2\] needs n_samples >= 2"):
        check(compose(["model_dir=x", "tasks=[infill]", "infill.k=[1,2]"], "eval"))
    with pytest.raises(ConfigError, match=r"infill\.benchmark='single_line' is not one of \[single-line, multi-line"):
        compose(["model_dir=x", "tasks=[infill]", "infill.benchmark=single_line"], "eval")
