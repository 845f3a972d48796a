"""Sweeps on Hydra's own plugins: an Optuna search (``hparams_search=lr_optuna``) that minimizes the runs' final eval
loss, a ``hydra/launcher=submitit_local`` sweep (the ``submitit_slurm`` code path without ``sbatch``), and a plugin
this environment lacks, which is one error line naming its package."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import yaml

from tests.conftest import FAST, run_py
from tests.wandb_files import read_run

SMALL = [*FAST, "train.steps=6", "train.eval_interval=0", "train.checkpoint_interval=0"]
SEARCHED = ("optim.lr=", "optim.sched.warmup_steps=")  # the search's own: FAST's fixed values would pin them


def _sweep(args: list[str], env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return run_py(["train.py", "-m", *args], env=env, timeout=timeout)


def _summaries(sweep: Path) -> dict[str, dict]:
    return {
        d.name: json.loads((d / "summary.json").read_text()) for d in sweep.iterdir() if (d / "summary.json").exists()
    }


def test_an_optuna_search_of_four_trials_returns_the_trial_with_the_lowest_eval_loss(tiny_data, tmp_path):
    sweep = tmp_path / "search"
    proc = _sweep(["hparams_search=lr_optuna", "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sweep}",
                   f"data.path={tiny_data}", *(a for a in SMALL if not a.startswith(SEARCHED)), "logger.wandb=true",
                   "logger.wandb_mode=offline"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = _summaries(sweep)
    assert sorted(runs) == ["0", "1", "2", "3"]
    losses = {job: s["eval_loss"] for job, s in runs.items()}
    best_job = min(losses, key=losses.get)
    optuna = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert optuna["best_value"] == losses[best_job]  # the sweeper minimized what train.py returned
    tried = {job: yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text()) for job in runs}
    assert len({tuple(sorted(t)) for t in tried.values()}) == 4  # four different points, lr and warmup both searched
    assert all(
        any(o.startswith("optim.lr=") for o in t) and any("warmup_steps=" in o for o in t) for t in tried.values()
    )
    best = json.loads((sweep / "best.json").read_text())
    assert best["job"] == best_job and best["eval_loss"] == losses[best_job]
    assert {f"{k}={v}" for k, v in optuna["best_params"].items()} <= set(tried[best_job])
    assert f"best: job {best_job} (" in proc.stdout
    with open(sweep / "sweep_summary.csv", newline="") as f:
        assert [r["job"] for r in csv.DictReader(f) if r["best"] == "True"] == [best_job]
    group = read_run(sweep / best_job)["group"]  # every trial, and the best as a run of its own, in one group
    record = read_run(sweep)
    assert record["group"] == group and record["config"]["best_job"] == best_job


def test_submitit_local_runs_each_job_of_a_two_job_sweep_in_its_own_process(tiny_data, tmp_path):
    sweep = tmp_path / "subm"
    proc = _sweep(["hydra/launcher=submitit_local", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}",
                   f"data.path={tiny_data}", *(a for a in SMALL if not a.startswith("optim.lr="))])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = _summaries(sweep)
    assert sorted(runs) == ["0", "1"] and all(s["complete"] for s in runs.values())
    jobs = [d for d in (sweep / ".submitit").iterdir() if d.name != "%j"]
    assert len(jobs) == 2 and all(list(d.glob("*_result.pkl")) for d in jobs)  # submitit ran and pickled each
    assert "sweep summary" in proc.stdout and "best: job" in proc.stdout


def test_a_missing_hydra_plugin_is_one_error_naming_its_package(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith(('hydra_plugins.hydra_optuna_sweeper', 'hydra_plugins.hydra_submitit_launcher')):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Hide())\n"
    )
    for args, package in ((["hparams_search=lr_optuna"], "hydra-optuna-sweeper"),
                          (["hydra/launcher=submitit_local", "optim.lr=1e-3,2e-3"], "hydra-submitit-launcher")):  # fmt: skip
        sweep = tmp_path / package
        proc = _sweep([*args, f"hydra.sweep.dir={sweep}", "recipe=cpu_smoke"], env={"PYTHONPATH": str(hide)})
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
        assert lines[0].startswith("error: ") and f"needs the Hydra plugin {package}" in lines[0]
        assert f"pip install {package}==" in lines[0] and not sweep.exists()
