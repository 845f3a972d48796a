"""Every entry point as a new user meets it: ``--help`` that reads like train.py's, and bad input answered in
one ``error:`` line naming the key or file, with no traceback, a non-zero exit within seconds, and no file
written. Each command runs as its own process from a scratch directory: ``--help`` from a fresh interpreter, the
bad inputs forked warm (``conftest.run_py``: the same program with torch already imported, which is what a bad
input that is refused after the imports would otherwise spend its seconds on)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT, TEST_ENV, check, run_py

PY = sys.executable

# (id, command after the interpreter, a line its --help must print, a key its --help documents)
HELP = [
    ("train", "train.py", "Train a Hugging Face causal LM", "train.checkpoint_interval"),
    ("eval", "eval.py", "Evaluate a training run's checkpoint", "humaneval.n_samples"),
    ("plan", "plan.py", "Plan a training layout", "cluster.gpus_per_node"),
    ("data_prep", "-m data_prep", "prepare a packed dataset", "output_dir"),
    ("data_prep.show", "-m data_prep.show", "decode packed samples", "output_dir"),
    ("launch.slurm", "-m launch.slurm", "Slurm batch script", "launcher.slurm.partition"),
    ("launch.hostfile", "-m launch.hostfile", "DeepSpeed hostfile", "--slots"),
    ("launch.sweep", "-m launch.sweep", "sweeps where every job", "sweep_dir"),
    ("report", "-m ultrascale.report", "run_dir=DIR", "report.md"),
    ("export", "-m ultrascale.export", "DeepSpeed checkpoint -> Hugging Face", "max_shard_size"),
    ("ssd", "-m ultrascale.ssd", "Self-distillation rounds", "sample.temperature"),
    ("gguf_import", "-m ultrascale.model.gguf_import", "GGUF", "--dtype"),
    ("checkpoint", "-m ultrascale.train.checkpoint", "to_universal", "RUN_DIR"),
    ("demo", "-m ultrascale.demo", "make demo", "--nproc"),
    ("peak", "-m ultrascale.runtime.peak", "calibrated GEMM rate", "--remeasure"),
    ("memprobe", "-m ultrascale.train.memprobe", "costs in host memory", "OUT.rankN"),
]


@pytest.mark.parametrize("name, cmd, intro, key", HELP, ids=[h[0] for h in HELP])
def test_every_entry_point_answers_help(name, cmd, intro, key):
    proc = subprocess.run([PY, *cmd.split(), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**_env(), "COLUMNS": "120"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert intro in proc.stdout and key in proc.stdout, proc.stdout[:3000]
    assert "Traceback" not in proc.stdout + proc.stderr
    if "=" in proc.stdout and "Keys (override with key=value" in proc.stdout:  # a composed tool: values and docs
        line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith(key))
        doc = proc.stdout.splitlines()[proc.stdout.splitlines().index(line) + 1]
        assert doc.startswith("      ") and doc.strip(), (line, doc)
    assert not re.search(r" = \[[^\]]*<", proc.stdout), proc.stdout  # list values as typed, not <Enum.x: 'x'> reprs


def _env() -> dict:
    import os

    return {**os.environ, **TEST_ENV}


@pytest.fixture(scope="module")
def inputs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """Broken things a user hands the tools: a corrupt manifest, a bad recipe, a garbage hostfile, ..."""
    root = tmp_path_factory.mktemp("bad_inputs")
    corrupt = root / "corrupt_data"
    shutil.copytree(tiny_data, corrupt)
    (corrupt / "manifest.json").write_text('{"format": ')
    conf = root / "conf" / "recipe"
    conf.mkdir(parents=True)
    (conf / "broken.yaml").write_text("# @package _global_\ntrain: {steps: [1, 2\n")
    (root / "hostfile").write_text("node1 slots=2\nthis is not a host line\n")
    (root / "empty_ckpts" / "checkpoints").mkdir(parents=True)
    return {"data": tiny_data, "corrupt": corrupt, "conf": root / "conf", "hostfile": root / "hostfile",
            "root": root, "missing": root / "does_not_exist"}  # fmt: skip


T = "train.py"
# (id, script args with {placeholders}, what the error line must name)
BAD = [
    ("misspelt key", f"{T} optim.lrr=1e-3", "optim.lrr"),
    ("plus unknown key", f"{T} +any.key=1", "'any'"),
    ("plus unknown nested key", f"{T} +train.bogus=2", "train.bogus"),
    ("negative checkpoint interval", f"{T} train.checkpoint_interval=-1", "train.checkpoint_interval=-1"),
    ("negative lr", f"{T} optim.lr=-1e-3", "optim.lr"),
    ("zero stage 4", f"{T} zero.stage=4", "zero.stage=4"),
    ("wrong type", f"{T} data.micro_batch=four", "data.micro_batch"),
    ("unknown group option", f"{T} zero=stage9", "zero/stage9"),
    ("hydra run dir in a single run", f"{T} hydra.run.dir={{out}}", "output_dir"),
    (
        "cross-group rule",
        f"{T} parallel.pp=2 zero=stage3 launcher.nproc_per_node=2 dry_run=true",
        "parallel.pp=2 needs zero.stage<=1",
    ),
    ("missing data", f"{T} data.path={{missing}} data.prepare_if_missing=false", "data.path"),
    ("misspelt data path (not the built-in corpus)", f"{T} data.path={{missing}}", "python -m data_prep input="),
    ("corrupt manifest", f"{T} data.path={{corrupt}}", "manifest.json"),
    ("seq_len mismatch", f"{T} data.path={{data}} data.seq_len=128", "data.seq_len=128"),
    ("vocab larger than model", f"{T} data.path={{data}} model.config.vocab_size=100", "model.config.vocab_size"),
    ("missing pretrained model", f"{T} data.path={{data}} model.pretrained_path={{missing}}", "model.pretrained_path"),
    ("missing resume checkpoint", f"{T} data.path={{data}} train.resume={{missing}}", "train.resume"),
    ("bad recipe YAML", f"{T} --config-dir {{conf}} recipe=broken", "broken.yaml"),
    ("bad recipe YAML in a sweep", f"{T} -m --config-dir {{conf}} recipe=broken train.steps=1,2", "broken.yaml"),
    ("missing config dir", f"{T} --config-dir {{missing}} recipe=cpu_smoke", "--config-dir"),
    ("garbage hostfile", f"{T} launcher=deepspeed launcher.nnodes=2 launcher.hostfile={{hostfile}}", "hostfile line 2"),
    (
        "missing hostfile",
        f"{T} launcher=deepspeed launcher.nnodes=2 launcher.hostfile={{missing}}",
        "launcher.hostfile",
    ),
    ("plan without GPUs", "plan.py cluster.gpus_per_node=0", "cluster.gpus_per_node=0"),
    ("plan negative nodes", "plan.py cluster.nodes=-1", "cluster.nodes=-1"),
    (
        "plan where nothing fits",
        "plan.py model=starcoder2_15b cluster.gpu_memory_gib=1 search.offload=false",
        "cluster.nodes",
    ),
    ("eval without a model", "eval.py", "run_dir"),
    ("eval missing model dir", "eval.py model_dir={missing} tasks=[humaneval]", "model_dir"),
    ("eval misspelt key", "eval.py model_dir=x humaneval.limt=3", "humaneval.limt"),
    ("eval negative limit", "eval.py model_dir=x humaneval.limit=-2", "humaneval.limit=-2"),
    ("data prep missing input", "-m data_prep input={missing} output_dir={out}", "input="),
    ("data prep unknown key", "-m data_prep bogus=1 output_dir={out}", "bogus"),
    ("show missing dataset", "-m data_prep.show output_dir={missing}", "does_not_exist"),
    ("slurm bad option", "-m launch.slurm zero=stage9", "zero/stage9"),
    ("hostfile zero slots", "-m launch.hostfile --slots 0 a b", "slots=0"),
    ("sweep summary of nothing", "-m launch.sweep {missing}", "does_not_exist"),
    ("report of nothing", "-m ultrascale.report run_dir={missing}", "does_not_exist"),
    ("export of nothing", "-m ultrascale.export run_dir={missing} out={out}", "does_not_exist"),
    ("ssd zero rounds", "-m ultrascale.ssd rounds=0", "rounds=0"),
    ("universal of nothing", "-m ultrascale.train.checkpoint to_universal {missing}", "does_not_exist"),
    ("gguf of nothing", "-m ultrascale.model.gguf_import {missing} {out}", "does_not_exist"),
    # -m sweeps: every job is composed and checked before the first one starts
    ("sweep misspelt key", f"{T} -m optim.lrr=1e-3,2e-3", "optim.lrr"),
    ("sweep plus unknown key", f"{T} -m +any.key=1 train.steps=1,2", "'any'"),
    ("sweep value out of range", f"{T} -m train.checkpoint_interval=5,-1", "train.checkpoint_interval=-1"),
    ("sweep unknown group option", f"{T} -m zero=stage1,stage9", "zero/stage9"),
    # + keys on every composed tool
    ("eval plus unknown key", "eval.py model_dir=x +bogus.key=1", "bogus"),
    ("plan plus unknown key", "plan.py +bogus=1", "bogus"),
    ("data prep plus unknown key", "-m data_prep +bogus=1 output_dir={out}", "bogus"),
    (
        "plan where nothing fits, with outputs",
        "plan.py model=starcoder2_15b cluster.gpu_memory_gib=1 "
        "search.offload=false output_json={out}/plan.json plot={out}/plan.png",
        "cluster.nodes",
    ),
    # flag-style tools: argparse's usage errors are one line too
    ("hostfile without slots", "-m launch.hostfile a b", "--slots"),
    ("sweep summary without a directory", "-m launch.sweep", "sweep_dir"),
    ("gguf without arguments", "-m ultrascale.model.gguf_import", "source"),
    ("gguf bad dtype", "-m ultrascale.model.gguf_import a b --dtype bogus", "--dtype"),
    ("peak bad dtype", "-m ultrascale.runtime.peak --dtype float64", "--dtype"),
    ("memprobe without output", "-m ultrascale.train.memprobe", "the following arguments are required: out"),
    ("checkpoint unknown command", "-m ultrascale.train.checkpoint convert {missing}", "to_universal"),
    ("demo bad rank count", "-m ultrascale.demo --nproc two", "--nproc"),
]


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.exists() else set()


# Not the tools' to write, or written by Python itself on import: the environment, git, tool caches, bytecode.
_UNWATCHED = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (data/, runs/, .cache/, models/ ... included) with its size and mtime, so a
    write into an existing directory shows, not only a new top-level name."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _UNWATCHED]
        for f in filenames:
            st = os.lstat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), root)] = (st.st_size, st.st_mtime_ns)
        out.update({os.path.relpath(os.path.join(dirpath, d), root) + "/": (0, 0) for d in dirnames})
    return out


@pytest.mark.parametrize("name, args, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_error_line_and_writes_nothing(name, args, needle, inputs, tmp_path):
    out = tmp_path / "out"
    argv = shlex.split(args.format(out=out, **{k: str(v) for k, v in inputs.items()}))
    if argv[0] == T:  # the case's own overrides come last, so they win
        argv = [T, *FAST, f"output_dir={out}", *argv[1:]]
    if argv[0].endswith(".py"):
        argv[0] = str(ROOT / argv[0])  # run from a scratch directory, as a user elsewhere would
    before_inputs, before_root = _files(inputs["root"]), _files(ROOT)
    # 60 s is a hang guard, not a speed claim: a bad input must be refused before anything is built or trained
    proc = run_py(argv, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr[-3000:]
    assert needle in errors[0], errors[0]
    if name.startswith("plan where nothing fits"):  # the planner's table of why every layout was dropped
        assert " layouts: 0 fit" in proc.stdout and "dropped (commonest reasons)" in proc.stdout, proc.stdout
        assert "error" not in proc.stdout, proc.stdout[-2000:]
    else:  # the refusal is the only thing said, on stderr
        assert proc.stdout.strip() == "", proc.stdout[-2000:]
    assert not out.exists(), sorted(_tree(out))  # nothing written for a run that could not start
    assert _tree(tmp_path) == set(), sorted(_tree(tmp_path))
    after_inputs, after_root = _files(inputs["root"]), _files(ROOT)
    assert after_inputs == before_inputs, _changed(before_inputs, after_inputs)
    assert after_root == before_root, _changed(before_root, after_root)


def _changed(before: dict, after: dict) -> dict:
    return {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def test_plans_best_command_dry_runs_to_the_planned_layout(tmp_path):
    plan = run_py(["plan.py", "model=tiny", "cluster=h100_8x", "precision=fp16", "data.seq_len=512",
                   f"output_json={tmp_path / 'plan.json'}"], timeout=300)  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    best = json.loads((tmp_path / "plan.json").read_text())["best"]
    line = plan.stdout.split("best:\n", 1)[1].splitlines()[0].strip()
    argv = shlex.split(line)
    assert argv[:2] == ["python", "train.py"]
    fresh = [f"output_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}"]  # data: 'not here' (a note)
    dry = run_py([*argv[1:], "dry_run=true", *fresh], timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    lay = best["layout"]
    topo = dry.stdout.split("== topology ==\n", 1)[1].splitlines()[0]
    for k in ("dp", "tp", "pp", "sp", "ep"):
        assert f"{k}={lay[k]}" in topo, (k, topo)
    ds = json.loads(dry.stdout.split("== DeepSpeed JSON ==\n", 1)[1])
    assert ds["train_micro_batch_size_per_gpu"] == lay["micro_batch"] and ds["train_batch_size"] == lay["global_batch"]
    assert ds["zero_optimization"]["stage"] == lay["zero_stage"] and ds["fp16"]["enabled"] is True
    assert "seq_len: 512" in dry.stdout and lay["world"] == 8
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def test_a_sweep_started_outside_the_repo_writes_its_summary(tiny_data, tmp_path):
    proc = run_py([str(ROOT / "train.py"), "-m", *FAST, f"data.path={tiny_data}", "train.steps=1", "optim.lr=1e-3,2e-3"],
                  timeout=600, cwd=tmp_path)  # fmt: skip
    check(proc)
    (summary,) = list(tmp_path.glob("multirun/*/*/sweep_summary.csv"))
    rows = summary.read_text().splitlines()
    assert len(rows) == 3 and all(",done," in r for r in rows[1:]), rows


@pytest.mark.parametrize(
    "config_name, argv, root",
    [
        ("train", ["recipe=cpu_smoke", "train.steps=3", "output_dir=${oc.env:HOME}/x"], "RootConfig"),
        ("plan", ["model=tiny", "cluster=cpu_local"], "PlanRootConfig"),
        ("eval", ["model_dir=some/model", "tasks=[perplexity]"], "EvalConfig"),
        (
            "plan",
            ["-m", "model=tiny", "cluster=cpu_local", "zero=stage1,stage2", "hydra.sweep.dir={tmp}"],
            "PlanRootConfig",
        ),
    ],
    ids=["train", "plan", "eval", "plan sweep"],
)
def test_main_is_handed_the_typed_config_resolved(config_name, argv, root, tmp_path, monkeypatch):
    """The composed DictConfig is converted once, in ``run_app``: ``main`` (and everything it calls) reads the
    group dataclasses, interpolations resolved, on the single-run path and under Hydra's ``-m`` alike."""
    import dataclasses

    from ultrascale.cli import run_app
    from ultrascale.config.root import PlanRootConfig, RootConfig
    from ultrascale.eval.config import EvalConfig, register_eval_configs

    register_eval_configs()
    monkeypatch.chdir(tmp_path)
    seen: list = []
    argv = [a.replace("{tmp}", str(tmp_path / "sweep")) for a in argv]
    assert run_app(config_name, seen.append, help_text="", argv=argv) == 0
    want = {"RootConfig": RootConfig, "PlanRootConfig": PlanRootConfig, "EvalConfig": EvalConfig}[root]
    assert seen and all(type(c) is want for c in seen)
    for c in seen:  # every group is its dataclass, not a DictConfig node
        assert all(not type(getattr(c, f.name)).__module__.startswith("omegaconf") for f in dataclasses.fields(c))
    if config_name == "train":
        assert seen[0].train.steps == 3 and seen[0].output_dir == f"{os.environ['HOME']}/x"
    if "-m" in argv:
        assert sorted(int(c.zero.stage) for c in seen) == [1, 2]
