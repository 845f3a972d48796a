"""plan.py end to end on the tiny model and this machine's measured cluster: table, JSON, PNG, and a best
layout whose override line composes and validates as a train.py config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ultrascale.config.compose import compose
from ultrascale.levers.rules import validate
from ultrascale.paths import PROJECT_ROOT
from ultrascale.plan.search import plan

SMALL_SEARCH = ["search.micro_batches=[1,2]", "search.tp=[1,2]", "search.pp=[1,2]", "search.sp=[1,2]"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "plan.py", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path_factory.mktemp("plan")
    proc = _run(
        "model=tiny",
        "cluster=cpu_local",
        "data.seq_len=256",
        "data.global_batch=8",
        *SMALL_SEARCH,
        f"output_json={out}/plan.json",
        f"plot={out}/plan.png",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads((out / "plan.json").read_text()), str(out / "plan.png")


def test_prints_table_and_best_line(result) -> None:
    proc, _, _ = result
    assert "tok/s" in proc.stdout and "bottleneck" in proc.stdout
    assert "python train.py model=tiny precision=bf16 parallel.tp=" in proc.stdout


def test_json_has_every_layout_with_terms_or_reason(result) -> None:
    _, doc, _ = result
    assert doc["cluster"]["peak_tflops"] != 0.05  # cpu_local's placeholder was replaced by the measurement
    assert doc["best"]["rejected"] is None
    for c in doc["candidates"]:
        assert (c["rejected"] is None) == (c["memory_bytes"] is not None and c["timing"]["mfu"] > 0) or c["rejected"]
    reasons = {c["rejected"] for c in doc["candidates"] if c["rejected"]}
    assert any("needs zero.stage<=1" in r for r in reasons)  # validate()'s own message, reused verbatim
    speeds = [c["timing"]["tokens_per_s"] for c in doc["candidates"] if not c["rejected"]]
    assert speeds == sorted(speeds, reverse=True)


def test_best_override_line_is_a_valid_train_config(result) -> None:
    _, doc, _ = result
    overrides = doc["best_command"].split()[2:]
    cfg = compose(overrides)
    topo = validate(cfg, world_size=2).topo
    assert topo.tp == doc["best"]["layout"]["tp"] and cfg.zero.stage == doc["best"]["layout"]["zero_stage"]


def test_plot_written(result) -> None:
    _, _, png = result
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_tight_memory_drops_everything_with_the_reason() -> None:
    cfg = compose(
        [
            "model=llama3_8b",
            "cluster=h100_8x",
            "cluster.gpu_memory_gib=4",
            "search.offload=false",
            "data.seq_len=4096",
            "data.global_batch=64",
            "search.micro_batches=[1]",
        ],
        "plan",
    )
    cands = plan(cfg)
    assert cands and not any(c.fits for c in cands)
    assert any("does not fit: needs" in (c.rejected or "") for c in cands)


@pytest.mark.parametrize(("gpu_gib", "stage"), [(80, 0), (30, 1), (23, 2), (21, 3)])
def test_lowest_zero_stage_that_fits_wins(gpu_gib: int, stage: int) -> None:
    """The rule of thumb falls out of the model: each higher stage saves memory and never communicates less."""
    cfg = compose(
        [
            "model=llama_1b",
            "cluster=h100_8x",
            f"cluster.gpu_memory_gib={gpu_gib}",
            "search.tp=[1]",
            "search.pp=[1]",
            "search.sp=[1]",
            "search.micro_batches=[4]",
            "search.recompute=[false]",
            "search.offload=false",
            "data.seq_len=2048",
            "data.global_batch=64",
        ],
        "plan",
    )
    best = next(c for c in plan(cfg) if c.fits)
    assert best.layout.zero_stage == stage


def test_bad_key_is_one_line_error() -> None:
    proc = _run("model=tiny", "cluster.gpu_memory_gb=3")
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown config key 'cluster.gpu_memory_gb'")


def test_the_planner_takes_the_fused_loss_from_the_decision_record_and_refuses_what_validate_refuses():
    """The planner reads the run's Decisions, not the layout it was asked about: the fused loss is off
    wherever decide() turns it off (tp > 1 here, or train.fused_loss=false), and only then does the memory
    model keep the logits. The ZeRO stage is never changed by a decision (decide() keeps zero.stage; a stage
    a layout cannot use is refused by validate, with its message), so that is what is checked for it."""
    from ultrascale.cost.memory import Layout
    from ultrascale.model.arch import arch_from_cfg
    from ultrascale.plan.search import evaluate

    args = ["model=llama_1b", "cluster=h100_8x", "data.seq_len=2048", "data.global_batch=8"]
    cfg = compose(args, "plan")
    arch = arch_from_cfg(cfg.model)
    base = dict(world=8, micro_batch=1, global_batch=8, seq_len=2048, dtype="bf16", zero_stage=1)
    # each layout is asked with the opposite of what decide() settles, so an echo of the request fails
    fused = evaluate(cfg, arch, Layout(**base, fused_loss=False))
    plain = evaluate(cfg, arch, Layout(**base, tp=2, fused_loss=True, loss_chunk_tokens=4096))
    assert fused.fits and plain.fits, (fused.rejected, plain.rejected)
    assert fused.layout.fused_loss  # on (train.fused_loss=true, tp=1), though the layout asked for it off
    assert not plain.layout.fused_loss and plain.layout.loss_chunk_tokens == 0  # off: AutoTP shards the LM head
    refused = evaluate(cfg, arch, Layout(**{**base, "zero_stage": 3}, pp=2))
    assert refused.rejected and "parallel.pp=2 needs zero.stage<=1 (got 3)" in refused.rejected, refused.rejected
    logits = 2048 * arch.vocab * 4  # the fp32 log-softmax of one micro-batch's logits
    unfused = evaluate(compose([*args, "train.fused_loss=false"], "plan"), arch, Layout(**base))
    assert not unfused.layout.fused_loss
    assert unfused.memory.activations - fused.memory.activations > 0.9 * logits
