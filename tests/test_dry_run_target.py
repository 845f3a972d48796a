"""The dry run speaks for the hardware the run is for (issue 41, part 3).

A GPU recipe names its cluster (``cluster=h100_8x``); typed on this CPU box, its dry run must state what the
cluster's ranks will decide (nccl, the card's GpuInfo: attention and loss kernels, activation checkpointing,
precision), the planner's HBM per GPU and its predicted step time and MFU, and that this machine is not that
cluster. A CPU recipe's dry run keeps describing this CPU. No dry run prepares or writes anything.

In-process (compose + ``dry_run_text``: what ``train.py dry_run=true`` prints), one CLI run for the wiring.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import run_py
from tests.test_recipes import _pretrained_stand_in
from ultrascale.config.compose import compose
from ultrascale.paths import RECIPES_DIR
from ultrascale.runtime.cpu import detect as detect_cpu
from ultrascale.runtime.gpu import CARDS

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
GPU_RECIPES = [
    r for r in RECIPES if re.search(r"^ +- override /cluster: ", (RECIPES_DIR / f"{r}.yaml").read_text(), re.M)
]
CPU_RECIPES = [r for r in RECIPES if r not in GPU_RECIPES]
CPU_WORDS = ("CPU rank", "query blocks", "on this CPU", "AVX", "AMX", "no GPU description", "CUDA only")
"""Wording that belongs to a CPU rank's decisions (the blocked attention, the CPU loss chunk, the host-memory
model of a CPU rank) or to decisions made without the cluster's GPU."""


def _section(text: str, name: str) -> str:
    """The lines under ``== name ...==`` up to the next section."""
    m = re.search(rf"^== {re.escape(name)}[^\n]*==\n(.*?)(?=^== |\Z)", text, re.S | re.M)
    assert m, f"the dry run has no '== {name}' section"
    return m.group(1)


def _compose(name: str, tmp_path: Path, *extra: str):
    over = [f"recipe={name}", f"output_dir={tmp_path / 'run'}", "dry_run=true", *extra]
    cfg = compose(over)
    if cfg.model.pretrained_path:
        cfg = compose([*over, f"model.pretrained_path={_pretrained_stand_in(tmp_path / 'weights')}"])
    return cfg


def _dry_run(name: str, tmp_path: Path, *extra: str) -> tuple[object, str]:
    from ultrascale.plan.dryrun import dry_run_text

    cfg = _compose(name, tmp_path, *extra)
    return cfg, dry_run_text(cfg)


def test_the_recipes_split_into_gpu_and_cpu_ones():
    """Every recipe whose Hardware line names GPUs names its cluster; the CPU ones name none (a recipe that lost
    its cluster= would silently fall back to describing this CPU)."""
    for r in RECIPES:
        hardware = re.search(r"^# Hardware:(.*)$", (RECIPES_DIR / f"{r}.yaml").read_text(), re.M).group(1)
        on_gpus = re.search(r"(?<!no )\b(H100|H200|A100|GPUs?)\b", hardware.split(";")[0]) is not None
        assert (r in GPU_RECIPES) == on_gpus == (compose([f"recipe={r}"]).cluster is not None), (r, hardware)
    assert len(GPU_RECIPES) >= 8 and {"cpu_smoke", "cpu_moe"} <= set(CPU_RECIPES)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_a_gpu_recipe_dry_run_states_its_clusters_gpu_decisions_hbm_and_step(name, tmp_path):
    from ultrascale.cost.memory import GIB, memory
    from ultrascale.cost.timing import step_time
    from ultrascale.levers.rules import validate
    from ultrascale.model.arch import arch_from_hf
    from ultrascale.plan.search import decided, layout_from_cfg
    from ultrascale.runtime.gpu import GpuInfo

    cfg, text = _dry_run(name, tmp_path)
    c = cfg.cluster
    card = next(k for k in CARDS if k.name == c.card)
    nodes, gpn = cfg.launcher.nnodes, cfg.launcher.nproc_per_node

    target = _section(text, "target")
    assert f"cluster {c.name}: {nodes} node(s) x {gpn} GPUs" in target and card.name in target, target
    assert f"sm_{card.capability[0]}{card.capability[1]}" in target and "nccl" in target, target
    assert "this machine is not that cluster" in target and detect_cpu().model_name in target, target

    # the decisions are the cluster's: every line is what decide() says on nccl for its card, and no CPU wording
    # (blocked attention, a CPU's loss chunk, a CPU rank's memory) is left anywhere in what is planned
    hw = replace(OmegaConf.to_object(c), nodes=nodes, gpus_per_node=gpn)
    d = validate(cfg, nodes * gpn, backend="nccl", gpu=GpuInfo.from_cluster(hw, c.card))
    decisions = _section(text, "decisions").splitlines()
    for k, choice in d.features().items():
        assert f"{k:<10} {'on ' if choice.on else 'off'} {choice.why}" in decisions, (k, choice.why)
    assert d.features()["act-ckpt"].value in ("none", "selective", "full")
    planned = text.split("== topology ==", 1)[1].split("== checked before start ==")[0]  # past "this machine: ..."
    for word in CPU_WORDS:
        assert word not in planned, (word, name)
    assert card.name in next(ln for ln in decisions if ln.startswith("precision "))
    if d.fused_loss.on:
        assert "on the GPU" in d.fused_loss.why, d.fused_loss.why  # sized from the card's memory

    # HBM per GPU and the step: the planner's figures for the decided layout on this cluster's card
    lay = decided(layout_from_cfg(cfg, nodes * gpn), d)
    arch = arch_from_hf(d.hf_config)
    mem = memory(arch, lay, 0.1, c.reserved_gib * GIB)
    hbm = _section(text, "HBM per GPU")
    m = re.search(r"= ([\d.]+) GiB per GPU of ([\d.]+) GiB: (fits|DOES NOT FIT)", hbm)
    assert m, hbm
    assert float(m.group(1)) == pytest.approx(mem.total / GIB, abs=0.051) and float(m.group(2)) == c.gpu_memory_gib
    assert (m.group(3) == "fits") == (mem.total <= c.gpu_memory_gib * GIB)
    assert f"runtime reserve {c.reserved_gib:.1f}" in hbm

    tm = step_time(arch, lay, hw)
    step = _section(text, f"predicted step on {c.name}")
    s = re.search(r"^step ([\d.]+) s = ", step, re.M)
    tps = re.search(r"^([\d,]+) tokens/s \(([\d,]+) per GPU\); MFU ([\d.]+)% of " + re.escape(card.name), step, re.M)
    assert s and tps, step
    assert float(s.group(1)) == pytest.approx(tm.step, rel=5e-3)
    assert int(tps.group(1).replace(",", "")) == pytest.approx(tm.tokens_per_s, rel=1e-3)
    flops = tm.mfu * tm.step * nodes * gpn * c.peak_tflops * 1e12
    want = flops / (tm.step * nodes * gpn * card.tflops[cfg.precision.dtype] * 1e12)
    assert float(tps.group(3)) / 100 == pytest.approx(want, abs=6e-4)
    assert not (tmp_path / "run").exists()


def test_cluster_on_the_command_line_retargets_the_dry_run(tmp_path):
    """``cluster=h200_8x`` on an H100 recipe: the card, its memory and the loss chunk sized from it follow."""
    _, h100 = _dry_run("llama_1b_zero0", tmp_path)
    _, h200 = _dry_run("llama_1b_zero0", tmp_path, "cluster=h200_8x")
    assert "H200 SXM 141GB" in _section(h200, "target") and "H100" not in _section(h200, "target")
    assert "GiB per GPU of 141.0 GiB" in _section(h200, "HBM per GPU")
    chunk = [int(re.search(r"(\d+) tokens a chunk", _section(t, "decisions")).group(1)) for t in (h100, h200)]
    assert chunk[1] > chunk[0], chunk


def test_a_launcher_wider_than_the_clusters_nodes_is_one_error(tmp_path):
    from ultrascale.errors import ConfigError
    from ultrascale.plan.dryrun import dry_run_text

    cfg = _compose("llama_1b_zero0", tmp_path, "launcher.nproc_per_node=16", "data.global_batch=512")
    with pytest.raises(ConfigError, match=r"launcher.nproc_per_node=16 but cluster=h100_8x has 8 GPUs per node"):
        dry_run_text(cfg)


@pytest.mark.parametrize("name", CPU_RECIPES)
def test_a_cpu_recipe_dry_run_still_describes_this_cpu(name, tmp_path):
    cfg, text = _dry_run(name, tmp_path)
    assert cfg.cluster is None
    target = _section(text, "target")
    assert target.startswith("this machine: ") and detect_cpu().describe() in target and "gloo" in target, target
    assert "cluster " not in target and "== HBM per GPU" not in text and "== predicted step" not in text
    assert "on a CPU rank" in _section(text, "host memory per rank")
    assert re.search(r"^precision +\w+ weights on the CPU", _section(text, "decisions"), re.M)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["cpu_smoke", "starcoder2_7b_zero3"])
def test_a_dry_run_never_prepares_data(name, tmp_path, monkeypatch):
    """The built-in corpus (the one path a real run prepares by itself) and a missing data.path both stay
    missing: the dry run notes them, prepares nothing and writes nothing."""
    import data_prep.api
    import ultrascale.data.prepare as prep

    def refuse(*a, **k):
        raise AssertionError("a dry run called data preparation")

    monkeypatch.setattr(data_prep.api, "prepare", refuse)
    monkeypatch.setattr(prep, "ensure_prepared", refuse)
    builtin = tmp_path / "stdlib"
    monkeypatch.setattr(prep, "BUILTIN_CORPUS", str(builtin))
    for path in (builtin, tmp_path / "missing"):
        _, text = _dry_run(name, tmp_path, f"data.path={path}")
        found = re.search(r"^data +(.*)$", _section(text, "checked before start"), re.M).group(1)
        if path == builtin:
            assert "rank 0 prepares it from the stdlib" in found, found
            assert ("CPU demo corpus" in found) == (name != "cpu_smoke"), found
        else:
            assert found.startswith("not here: a real run stops with"), found
        assert not path.exists()
    assert {p.name for p in tmp_path.iterdir()} <= {"weights"}  # no run directory, no data


def test_train_py_dry_run_speaks_for_the_recipes_cluster(tmp_path):
    """The command a user types, on this CPU box: the cluster's decisions, not this CPU's, and nothing written."""
    run, data = tmp_path / "run", tmp_path / "data"
    proc = run_py(["train.py", "recipe=starcoder2_7b_zero3", "dry_run=true", f"output_dir={run}", f"data.path={data}"],
                  timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "cluster h100_8x: 2 node(s) x 8 GPUs, each NVIDIA H100 SXM5 80GB" in out
    assert "this machine is not that cluster" in out and "GiB per GPU of 80.0 GiB" in out
    assert re.search(r"MFU [\d.]+% of H100 SXM5 80GB", out) and "on the GPU for one chunk" in out
    assert "CPU rank" not in out and "query blocks" not in out
    assert not run.exists() and not data.exists()
