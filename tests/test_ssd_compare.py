"""The SSD comparison (ultrascale/ssd/compare.py) on planted per-problem results: the choice is made on dev, the
test half is generated only for the chosen setting, and the verdict follows the paired bootstrap."""

from __future__ import annotations

import pytest

from tests.conftest import needs, sandbox_missing
from ultrascale.eval.stats import NO_GAIN
from ultrascale.ssd.compare import Setting, cached, evaluate_set, grid, table

needs_sandbox = needs(sandbox_missing())

PROBLEMS = [{"task_id": f"P/{i:03d}", "prompt": "", "test": "", "entry_point": "f"} for i in range(120)]


def planted(solved: dict[tuple[str, str], set[str]], calls: list):
    """A scorer that returns 1 for the planted solved problems of (model_dir, setting), 0 elsewhere."""

    def score(model_dir: str, problems: list[dict], setting: Setting, n: int) -> dict[str, float]:
        calls.append((model_dir, setting.name, len(problems), n))
        good = solved.get((model_dir, setting.name), set())
        return {p["task_id"]: float(p["task_id"] in good) for p in problems}

    return score


def ids(lo: int, hi: int) -> set[str]:
    return {f"P/{i:03d}" for i in range(lo, hi)}


def test_the_grid_is_greedy_then_each_temperature_with_and_without_truncation():
    names = [s.name for s in grid([0.6, 1.1], top_k=20, top_p=0.8)]
    assert names == ["greedy", "T=0.6,top_k=0,top_p=1", "T=0.6,top_k=20,top_p=0.8", "T=1.1,top_k=0,top_p=1",
                     "T=1.1,top_k=20,top_p=0.8"]  # fmt: skip
    assert [s.name for s in grid([0.6], top_k=0, top_p=1.0)] == ["greedy", "T=0.6,top_k=0,top_p=1"]
    assert [s.name for s in grid([], top_k=20, top_p=0.8)] == ["greedy"]  # --temperatures with no value


def test_the_choice_is_made_on_dev_and_only_it_is_generated_on_test():
    settings = grid([1.1], top_k=20, top_p=0.8)
    truncated = settings[2].name
    solved = {
        ("base", "greedy"): ids(0, 30),
        ("ssd/ckpt1", "greedy"): ids(0, 30),
        ("ssd/ckpt2", truncated): ids(0, 60),  # a later checkpoint at T_eval with truncation: clearly better
    }
    calls: list = []
    r = evaluate_set(PROBLEMS, {"base": ["base"], "ssd": ["ssd/ckpt1", "ssd/ckpt2"]}, settings,
                     planted(solved, calls), n_dev=4, n_test=10, seed=0, n_boot=2000)  # fmt: skip
    assert set(r["split"]["dev"]).isdisjoint(r["split"]["test"]) and len(r["split"]["test"]) == 60
    ssd = r["models"]["ssd"]
    assert ssd["chosen_checkpoint"] == "ssd/ckpt2" and ssd["chosen_setting"]["name"] == truncated
    tests = [c for c in calls if c[3] == 10]  # the test half is scored once per model, at its chosen setting
    assert tests == [("base", "greedy", 60, 10), ("ssd/ckpt2", truncated, 60, 10)]
    vs = ssd["vs_base"]
    assert vs["verdict"] == "gain" and vs["lo"] > 0 and vs["diff"] == pytest.approx(ssd["test_pass@1"] - 0.25, abs=0.1)
    assert "gain" in table({"seed": 0, "sets": {"humaneval": r}})


def test_identical_models_give_no_measurable_gain():
    settings = grid([0.6], top_k=0, top_p=1.0)
    solved = {("a", "greedy"): ids(0, 40), ("b", "greedy"): ids(0, 40)}
    r = evaluate_set(PROBLEMS, {"base": ["a"], "same": ["b"]}, settings, planted(solved, []), 2, 10, n_boot=2000)
    vs = r["models"]["same"]["vs_base"]
    assert vs["diff"] == 0 and vs["lo"] <= 0 <= vs["hi"] and vs["verdict"] == NO_GAIN


def test_a_setting_best_on_test_but_not_on_dev_is_not_chosen():
    """Plant the trap: one setting solves the test half's problems, another the dev half's. The dev one wins."""
    settings = grid([0.6], top_k=0, top_p=1.0)
    calls: list = []
    probe = evaluate_set(PROBLEMS, {"m": ["m"]}, settings, planted({}, calls), 1, 1, seed=3)
    dev, test = set(probe["split"]["dev"]), set(probe["split"]["test"])
    solved = {("m", "greedy"): set(sorted(dev)[:20]), ("m", settings[1].name): test}
    r = evaluate_set(PROBLEMS, {"m": ["m"]}, settings, planted(solved, []), 1, 1, seed=3)
    assert r["models"]["m"]["chosen_setting"]["name"] == "greedy" and r["models"]["m"]["test_pass@1"] == 0.0


def test_a_tie_on_dev_goes_to_greedy_then_the_grid_and_listing_order():
    """Every dev score 0 (a weak model on a hard set) used to pick whichever setting's name sorted first (T=0.6):
    n samples per problem for nothing. Greedy wins ties; among sampled settings the grid's order, then the
    candidates as listed."""
    settings = grid([0.6, 1.1], top_k=20, top_p=0.8)
    r = evaluate_set(PROBLEMS, {"m": ["m/step_2", "m/final"]}, settings, planted({}, []), 2, 10, n_boot=200)
    assert r["models"]["m"]["chosen_setting"]["name"] == "greedy"
    assert r["models"]["m"]["chosen_checkpoint"] == "m/step_2"
    settings = grid([1.1, 0.6], top_k=0, top_p=1.0)  # the grid as given: T=1.1 before T=0.6
    dev = set(sorted(r["split"]["dev"])[:10])  # both temperatures solve the same dev problems, greedy fewer
    solved = {("m/final", "T=0.6,top_k=0,top_p=1"): dev, ("m/final", "T=1.1,top_k=0,top_p=1"): dev,
              ("m/final", "greedy"): set(sorted(dev)[:5])}  # fmt: skip
    r = evaluate_set(PROBLEMS, {"m": ["m/step_2", "m/final"]}, settings, planted(solved, []), 2, 10, n_boot=200)
    assert r["models"]["m"]["chosen_setting"]["name"] == "T=1.1,top_k=0,top_p=1"  # a better score beats greedy


def test_the_score_cache_resumes_a_killed_evaluation_and_misses_a_retrained_model(tmp_path):
    """A second evaluation with the cache re-scores nothing and gives the same result; a model whose weights were
    rewritten is scored again; a line torn by a kill is skipped, not fatal."""
    models = {m: tmp_path / m for m in ("base", "ssd")}
    for m, d in models.items():
        d.mkdir()
        (d / "model.safetensors").write_bytes(f"weights of {m}".encode())  # two models: other bytes
    settings = grid([0.6], top_k=0, top_p=1.0)
    solved = {(str(models["base"]), "greedy"): ids(0, 30), (str(models["ssd"]), "greedy"): ids(0, 50)}
    path = tmp_path / "compare.scores.jsonl"
    first: list = []
    one = evaluate_set(PROBLEMS, {k: [str(v)] for k, v in models.items()}, settings,
                       cached(planted(solved, first), path), 2, 10, n_boot=500)  # fmt: skip
    assert len(first) == 2 * len(settings) + 2 and len(path.read_text().splitlines()) == len(first)
    with open(path, "a") as f:
        f.write('{"key": "torn')  # killed mid-write
    second: list = []
    two = evaluate_set(PROBLEMS, {k: [str(v)] for k, v in models.items()}, settings,
                       cached(planted(solved, second), path), 2, 10, n_boot=500)  # fmt: skip

    def strip(r: dict) -> dict:
        return {**r, "models": {k: {**m, "wall_s": None} for k, m in r["models"].items()}}

    assert second == [] and strip(two) == strip(one)
    (models["ssd"] / "model.safetensors").write_bytes(b"retrained weights")
    third: list = []
    evaluate_set(PROBLEMS, {k: [str(v)] for k, v in models.items()}, settings,
                 cached(planted(solved, third), path), 2, 10, n_boot=500)  # fmt: skip
    assert third and {c[0] for c in third} == {str(models["ssd"])}


def test_the_score_cache_is_keyed_by_the_models_content_not_its_path_or_file_times(tmp_path):
    """Weights rewritten in place with the same size and modification time (cp -p, rsync -a) are another model:
    scored again, not served the old scores. A copy of a scored model at another path is the same model: served
    from the cache. A model saved as pytorch_model.bin (no .safetensors) is keyed by its bytes too."""
    import os
    import shutil

    settings = grid([], top_k=0, top_p=1.0)  # greedy only
    path = tmp_path / "compare.scores.jsonl"
    model = tmp_path / "round_00" / "model"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights A")
    (model / "config.json").write_text("{}")
    solved = {(str(model), "greedy"): ids(0, 30)}
    calls: list = []
    evaluate_set(PROBLEMS, {"m": [str(model)]}, settings, cached(planted(solved, calls), path), 1, 1, n_boot=100)
    assert len(calls) == 2  # dev and test, greedy
    stat = (model / "model.safetensors").stat()
    (model / "model.safetensors").write_bytes(b"weights B")  # retrained in place: same size...
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ...same time (cp -p)
    again: list = []
    evaluate_set(PROBLEMS, {"m": [str(model)]}, settings, cached(planted(solved, again), path), 1, 1, n_boot=100)
    assert [c[0] for c in again] == [str(model)] * 2  # scored afresh: other weights
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(model, copy)
    served: list = []
    evaluate_set(PROBLEMS, {"m": [str(copy)]}, settings, cached(planted(solved, served), path), 1, 1, n_boot=100)
    assert served == []  # the same bytes at another path: the same model
    for d, data in ((tmp_path / "bin_a", b"one"), (tmp_path / "bin_b", b"two")):
        d.mkdir()
        (d / "pytorch_model.bin").write_bytes(data)
    bins: list = []
    for d in ("bin_a", "bin_b"):
        evaluate_set(PROBLEMS, {"m": [str(tmp_path / d)]}, settings, cached(planted({}, bins), path), 1, 1, n_boot=100)
    assert [c[0] for c in bins] == [str(tmp_path / "bin_a")] * 2 + [str(tmp_path / "bin_b")] * 2


def test_the_cli_keeps_a_fence_stopped_or_chat_runs_scores_apart_from_a_plain_runs(tmp_path, monkeypatch):
    """``--stop-fence`` and ``--chat`` score other completions than a plain prompt, so ``compare.main`` tags the
    score cache with them: a plain run's cached scores are never served to them, while each repeated run is served
    from the cache. Issue 54's planted defect 5 (``",fence"`` dropped from the tag) reused the plain scores for
    ``--stop-fence`` silently. The generating scorer is planted (nothing generates), so is the sandbox check."""
    from ultrascale.eval import sandbox
    from ultrascale.ssd import compare

    made: list = []  # (chat, fence) each run's scorer was built with
    calls: list = []

    def scorer(max_new_tokens: int = 256, device: str = "auto", chat: bool = False, fence: bool = False):
        made.append((chat, fence))
        return planted({}, calls)

    monkeypatch.setattr(compare, "sandbox_scorer", scorer)
    monkeypatch.setattr(sandbox, "check_available", lambda: None)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = ["--model", f"m={model}", "--limit", "4", "--temperatures", "--cache", str(tmp_path / "scores.jsonl")]
    for extra, scored in (([], 2), ([], 0), (["--stop-fence"], 2), (["--stop-fence"], 0), (["--chat"], 2)):
        calls.clear()
        compare.main([*args, *extra])
        assert len(calls) == scored, f"{extra}: scored {calls}, want {scored} (dev and test, greedy) or 0 (cached)"
    assert made == [(False, False)] * 2 + [(False, True)] * 2 + [(True, False)]


def _ssd_run(root, train_repos_from) -> str:
    """An SSD output_dir as the entry point leaves it: ssd_manifest.json with the run's config, round_00/model."""
    import json

    (root / "round_00" / "model").mkdir(parents=True)
    config = {"method": "ssd", "problems": {"input": "stdlib", "train_repos_from": train_repos_from}}
    (root / "ssd_manifest.json").write_text(json.dumps({"config": config, "rounds": {}}))
    return str(root / "round_00" / "model")


def test_a_heldout_set_that_the_run_did_not_hold_out_is_refused(tmp_path):
    """--heldout DATA scores the problems of DATA's validation repositories as code no prompt came from; that holds
    only for a run whose prompts came from DATA's train split. A run with train_repos_from unset (every repository)
    or another dataset is refused by name, whether given by --run or found above a --model checkpoint; the same
    split under another path (an identical repos.json) is accepted."""
    import json

    from ultrascale.errors import ConfigError
    from ultrascale.ssd.compare import check_heldout, ssd_runs

    data, other, copy = (tmp_path / n for n in ("data", "other", "copy"))
    for d, split in ((data, {"a": "train", "b": "validation"}), (other, {"a": "validation", "b": "train"})):
        d.mkdir()
        (d / "repos.json").write_text(json.dumps(split))
    copy.mkdir()
    (copy / "repos.json").write_text((data / "repos.json").read_text())
    good = _ssd_run(tmp_path / "good", str(data))
    same = _ssd_run(tmp_path / "same", str(copy))
    unset = _ssd_run(tmp_path / "unset", None)
    moved = _ssd_run(tmp_path / "moved", str(other))
    step = tmp_path / "good" / "round_00" / "model_steps" / "step_00000002"
    step.mkdir(parents=True)
    runs = ssd_runs({"base": ["models/x"], "ssd": [str(step), good]}, [f"rft={tmp_path / 'same'}"])
    assert list(runs.values()) == [tmp_path / "same", tmp_path / "good"]  # both candidates: one run, found once
    check_heldout(str(data), runs)
    with pytest.raises(ConfigError, match=r"^--heldout .*data: --model ssd \(.*\) ran with problems\.train_repos_from="
                       r"null, so its prompts came from every repository, .* rerun it with problems\.train_repos_from="
                       r".*data, or leave out --heldout$"):  # fmt: skip
        check_heldout(str(data), ssd_runs({"ssd": [unset]}, []))
    with pytest.raises(ConfigError, match=r"is not the split --run m trained on \(problems\.train_repos_from=.*other\):"
                       r" pass --heldout .*other$"):  # fmt: skip
        check_heldout(str(data), ssd_runs({"base": [same]}, [f"m={tmp_path / 'moved'}"]))
    with pytest.raises(ConfigError, match="is not the split"):
        check_heldout(str(data), ssd_runs({"ssd": [moved]}, []))


def test_the_evaluation_cli_refuses_a_mismatched_heldout_in_one_line_before_generating(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, TEST_ENV

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "repos.json").write_text('{"a": "train", "b": "validation"}')
    model = _ssd_run(tmp_path / "run", None)
    proc = subprocess.run([sys.executable, "-m", "ultrascale.ssd.evaluate", "--model", f"ssd={model}", "--heldout",
                           str(tmp_path / "data"), "--sets", "heldout", "--temperatures"], cwd=ROOT,
                          env={**os.environ, **TEST_ENV}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --heldout ") and "problems.train_repos_from=null" in lines[0]


# What the full fine-tuning chat SFT checkpoint wrote for HumanEval/23 in plain completion (greedy, step 20): the
# right body, then a closing fence and prose, as the instruction set's assistant turns end.
CHAT_HABIT = (
    "    return len(string)\n```\n\nThis implementation uses the `len` function to calculate the length of a string."
)


@needs_sandbox
def test_the_fence_stop_scores_the_body_a_chat_tuned_model_writes_not_its_prose():
    """``--stop-fence``: a plain completion ends at a code fence (as with ``--chat``), so the body is scored; with
    HumanEval's stops alone the prose after the fence is run as Python and fails."""
    from ultrascale.eval.humaneval import STOP_SEQUENCES, check_program, load_problems, truncate
    from ultrascale.eval.sandbox import run_many
    from ultrascale.ssd.compare import completion_stops, parser

    assert completion_stops() == STOP_SEQUENCES
    assert completion_stops(fence=True) == completion_stops(chat=True) == (*STOP_SEQUENCES, "```")
    assert parser().parse_args(["--model", "a=m", "--stop-fence"]).stop_fence
    problem = load_problems(24)[23]
    programs = [check_program(problem, truncate(CHAT_HABIT, stops)) for stops in (completion_stops(),
                completion_stops(fence=True))]  # fmt: skip
    assert [o.passed for o in run_many(programs, workers=2)] == [False, True]
