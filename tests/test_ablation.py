"""The ablation report (``python -m ultrascale.report.ablation``) on planted sweeps whose answer is known: the
paired differences, their Student t interval, the tokens an arm needs to reach the baseline's final loss, and one
``error:`` line for each sweep a comparison cannot stand on. The sweeps are written as a ``train.py -m`` run writes
them (``.hydra/overrides.yaml``, ``config.yaml``, ``metrics.jsonl``, ``summary.json``); nothing trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ultrascale.report import ablation

PER_STEP = 8 * 64  # data.global_batch x data.seq_len
STEPS = 8
BASE = {1: 3.00, 2: 3.10, 3: 2.95}  # the baseline's final held-out loss per seed
BETTER = {1: -0.10, 2: -0.12, 3: -0.08}  # the better arm's planted difference per seed: mean -0.10, sd 0.02
SLOPE = 0.1  # every curve falls by this per eval (one eval a step), so where it crosses is known


def _job(sweep: Path, overrides: list[str], final: float, tokens: int = STEPS * PER_STEP, last_eval: int = STEPS,
         extra_cfg: dict | None = None, name: str | None = None) -> Path:  # fmt: skip
    d = sweep / (name or ",".join(overrides))
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    seed = int(next(o for o in overrides if o.startswith("train.seed=")).split("=")[1])
    optim = next((o.split("=")[1] for o in overrides if o.startswith("optim=")), "adamw")
    cfg = {"data": {"global_batch": 8, "seq_len": 64, **(extra_cfg or {})}, "train": {"seed": seed, "steps": STEPS},
           "optim": {"name": optim, "lr": 3e-3 if optim == "adamw" else 2e-2}, "output_dir": str(d)}  # fmt: skip
    (d / "config.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    rows = [{"step": s, "loss": final + 1 + (STEPS - s) * SLOPE, "time_s": float(s)} for s in range(1, STEPS + 1)]
    rows += [
        {"event": "eval", "step": s, "time_s": s + 0.5, "eval_loss": final + (STEPS - s) * SLOPE}
        for s in range(1, last_eval + 1)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"steps": STEPS, "tokens": tokens, "tokens_per_s": 1000.0 + seed, "complete": True}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def _sweep(root: Path, arms: dict[str, dict[int, float]], **job) -> Path:
    """One job per (arm, seed): ``arms`` maps an arm's override to its difference from the baseline per seed."""
    sweep = root / "sweep"
    for arm, diffs in arms.items():
        for seed, base in BASE.items():
            _job(sweep, [arm, f"train.seed={seed}"], base + diffs.get(seed, 0.0), **job)
    return sweep


def test_paired_differences_their_t_interval_and_the_tokens_to_the_baseline_are_the_planted_ones(tmp_path):
    sweep = _sweep(tmp_path, {"optim=adamw": {}, "optim=muon": BETTER, "optim=sgd": {1: 0.05, 2: 0.04, 3: 0.06}})
    result = ablation.report(sweep, "optim=adamw")
    assert result["baseline"] == "optim=adamw" and set(result["arms"]) == {"optim=adamw", "optim=muon", "optim=sgd"}
    (muon,) = [c for c in result["comparisons"] if c["arm"] == "optim=muon"]
    half = 4.303 * 0.02 / math.sqrt(3)  # t on 2 degrees of freedom x sd / sqrt(n)
    assert muon["n_pairs"] == 3 and muon["diff_mean"] == pytest.approx(-0.10)
    assert muon["ci95"] == pytest.approx([-0.10 - half, -0.10 + half]) and muon["detectable"] == pytest.approx(half)
    # each seed's arm reaches its baseline's final where its curve crosses it: step 8 + diff / SLOPE of 8
    assert muon["reached"] == {s: pytest.approx((STEPS + d / SLOPE) / STEPS) for s, d in BETTER.items()}
    assert muon["tokens_to_baseline_final"] == pytest.approx(0.875)
    (sgd,) = [c for c in result["comparisons"] if c["arm"] == "optim=sgd"]
    assert sgd["diff_mean"] == pytest.approx(0.05) and sgd["tokens_to_baseline_final"] is None  # never reached
    runs = result["arms"]["optim=muon"]["runs"]
    assert [r["seed"] for r in runs] == [1, 2, 3] and runs[0]["tokens"] == STEPS * PER_STEP
    assert runs[0]["curve"][-1] == [STEPS * PER_STEP, pytest.approx(BASE[1] + BETTER[1])]
    text = ablation.table(result)
    assert "optim=adamw (baseline)" in text.splitlines()[2] and "0.88x" in text and "not reached" in text


def test_the_cli_prints_the_table_and_writes_the_json_and_the_figure(tmp_path, capsys):
    sweep = _sweep(tmp_path, {"optim=adamw": {}, "optim=muon": BETTER})
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert ablation.main([str(sweep), "--baseline", "optim=adamw", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "-0.1000 [-0.1497, -0.0503] (3 pairs)" in printed, printed
    data = json.loads(out.read_text())
    assert set(data) >= {"baseline", "arms", "comparisons"} and data["comparisons"][0]["ci95"][1] < 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_t_multipliers_are_students():
    assert ablation.t975(2) == 4.303 and ablation.t975(30) == 2.042
    assert ablation.t975(40) == pytest.approx(2.0211, abs=1e-3) and ablation.t975(120) == pytest.approx(
        1.9799, abs=1e-3
    )


def _one_error(capsys, argv: list[str], needle: str) -> None:
    assert ablation.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_runs_that_differ_in_a_key_no_override_names_are_refused(tmp_path, capsys):
    sweep = _sweep(tmp_path, {"optim=adamw": {}, "optim=muon": BETTER})
    _job(sweep, ["optim=muon", "train.seed=4"], 3.0, extra_cfg={"seq_len": 128})
    _one_error(capsys, [str(sweep)], "differ in data.seq_len (64 vs 128), which no override of the sweep names")


def test_runs_that_saw_different_tokens_are_refused(tmp_path, capsys):
    sweep = _sweep(tmp_path, {"optim=adamw": {}})
    _job(sweep, ["optim=muon", "train.seed=1"], 3.0, tokens=STEPS * PER_STEP - 1)
    _one_error(capsys, [str(sweep)], "the runs saw different numbers of tokens")


def test_a_run_without_an_eval_at_its_last_step_is_refused(tmp_path, capsys):
    sweep = _sweep(tmp_path, {"optim=adamw": {}})
    _job(sweep, ["optim=muon", "train.seed=1"], 3.0, last_eval=STEPS - 2)
    _one_error(capsys, [str(sweep)], f"no held-out eval at its last step ({STEPS}; its last is at step {STEPS - 2})")


def test_a_baseline_that_is_not_an_arm_is_refused(tmp_path, capsys):
    sweep = _sweep(tmp_path, {"optim=adamw": {}, "optim=muon": BETTER})
    _one_error(capsys, [str(sweep), "--baseline", "optim=lion"], "--baseline optim=lion is not an arm of this sweep")
    # Hydra records a swept `true` as `True`: the baseline is found whichever the user types
    assert ablation.report(sweep, "OPTIM=AdamW")["baseline"] == "optim=adamw"


def test_a_seed_twice_in_one_arm_and_an_empty_sweep_are_refused(tmp_path, capsys):
    _one_error(capsys, [str(tmp_path)], "no sweep jobs here")
    sweep = _sweep(tmp_path, {"optim=adamw": {}})
    _job(sweep, ["optim=adamw", "train.seed=1"], 3.0, name="7")  # numbered job dirs: `train.seed=1,1` makes two
    _one_error(capsys, [str(sweep)], "has seed 1 twice")


def _plant_evals(sweep: Path, values: dict[str, dict[int, dict[str, float]]], step: int = STEPS) -> None:
    """``eval/step_N/eval_results.json`` for each job, as ``python eval.py run_dir=JOB tasks=[fim,infill]`` writes it."""
    for d in sweep.iterdir():
        arm, seed = (o.strip("- \n") for o in (d / ".hydra" / "overrides.yaml").read_text().splitlines())
        tasks: dict[str, dict] = {}
        for key, v in values[arm][int(seed.split("=")[1])].items():
            task, metric = key.split("/", 1)
            tasks.setdefault(task, {})[metric] = v
        out = d / "eval" / f"step_{step:08d}" / "eval_results.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"step": step, "tasks": tasks}))


def test_post_hoc_evaluations_are_paired_by_seed_with_their_interval(tmp_path, capsys):
    sweep = _sweep(tmp_path, {"data.path=d0": {}, "data.path=d50": BETTER})
    infill = {1: 0.05, 2: 0.07, 3: 0.06}  # the FIM arm's planted pass@1 gain: mean 0.06, sd 0.01
    values = {
        "data.path=d0": {s: {"infill/pass@1": 0.03, "fim/all/psm/middle_loss": 5.0} for s in BASE},
        "data.path=d50": {s: {"infill/pass@1": 0.03 + g, "fim/all/psm/middle_loss": 4.0} for s, g in infill.items()},
    }
    _plant_evals(sweep, values)
    result = ablation.report(sweep, "data.path=d0")
    (c,) = result["comparisons"]
    half = 4.303 * 0.01 / math.sqrt(3)
    assert c["evals"]["infill/pass@1"]["diff_mean"] == pytest.approx(0.06)
    assert c["evals"]["infill/pass@1"]["ci95"] == pytest.approx([0.06 - half, 0.06 + half])
    assert c["evals"]["fim/all/psm/middle_loss"]["diff_mean"] == pytest.approx(-1.0)
    assert "fim/single_line/psm/exact_match" not in c["evals"]  # no run has it
    text = ablation.eval_table(result)
    assert "(empty completions: 0.0261)" in text and "+0.0600 [" in text, text
    # an eval of another checkpoint than the run's last is not the run's final model's: not read
    _plant_evals(sweep, {a: {s: {"infill/pass@1": 0.9} for s in BASE} for a in values}, step=STEPS - 1)
    assert ablation.report(sweep, "data.path=d0")["comparisons"][0]["evals"]["infill/pass@1"]["diff_mean"] == (
        pytest.approx(0.06)
    )


def test_the_table_goes_to_wandb_when_the_runs_logged_there(tmp_path, monkeypatch):
    sweep = _sweep(tmp_path, {"optim=adamw": {}, "optim=muon": BETTER})
    result = ablation.report(sweep, "optim=adamw")
    assert ablation.wandb_settings(result) is None  # the runs did not log to wandb: no run is started for them
    for cfg_path in sweep.glob("*/config.yaml"):
        cfg = json.loads(cfg_path.read_text())
        cfg["logger"] = {"wandb": True, "wandb_mode": "offline", "wandb_project": "abl"}
        cfg_path.write_text(json.dumps(cfg))
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = ablation.wandb_settings(result)
    assert settings == {"project": "abl", "mode": "offline"}
    png = ablation.plot(result, tmp_path / "f.png")
    where = Path(ablation.log_wandb(result, settings, png))
    assert where.is_relative_to(sweep) and list(sweep.glob("wandb/offline-run-*/run-*.wandb"))


def test_the_dry_run_says_what_each_ablation_settled_from_its_report_json(tmp_path):
    """``plan/evidence.py`` reads the verdict from the committed report JSON: better, worse, or an interval that
    includes zero; a missing JSON says so rather than claiming anything."""
    from types import SimpleNamespace

    from ultrascale.plan import evidence

    (opt, fim, mask) = evidence.ABLATIONS
    (tmp_path / "docs" / "results").mkdir(parents=True)

    def plant(a, lo, hi):
        comp = {"arm": a.arm, "diff_mean": (lo + hi) / 2, "ci95": [lo, hi], "n_pairs": 3}
        (tmp_path / a.result).write_text(json.dumps({"baseline": "b", "comparisons": [comp]}))

    plant(opt, -0.2, -0.1)
    plant(fim, -0.01, 0.02)
    assert evidence.verdict(opt, tmp_path).endswith("the arm is better")
    assert evidence.verdict(fim, tmp_path).endswith("the interval includes zero, the proxy could not tell them apart")
    assert evidence.verdict(mask, tmp_path).startswith("not yet measured")
    plant(mask, 0.05, 0.07)
    assert evidence.verdict(mask, tmp_path).endswith("the baseline is better")
    cfg = SimpleNamespace(optim=SimpleNamespace(name="adamw"),
                          data=SimpleNamespace(path="data/x", document_masking=True))  # fmt: skip
    lines = evidence.evidence_lines(cfg, tmp_path)
    assert len(lines) == 5 and lines[1].startswith("optim.name             adamw here;") and "+0.0600" in lines[3]
