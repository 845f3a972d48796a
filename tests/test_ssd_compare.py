"""The SSD comparison (ultrascale/ssd/compare.py) on planted per-problem results: the choice is made on dev, the
test half is generated only for the chosen setting, and the verdict follows the paired bootstrap."""

from __future__ import annotations

import pytest

from ultrascale.ssd.compare import Setting, cached, evaluate_set, grid, table
from ultrascale.ssd.stats import NO_GAIN

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


def test_the_score_cache_resumes_a_killed_evaluation_and_misses_a_retrained_model(tmp_path):
    """A second evaluation with the cache re-scores nothing and gives the same result; a model whose weights were
    rewritten is scored again; a line torn by a kill is skipped, not fatal."""
    models = {m: tmp_path / m for m in ("base", "ssd")}
    for d in models.values():
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"weights")
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
