"""Each parallelism lever trains on 2 CPU ranks through the real ``train.py`` and computes the right thing.

pp, tp and sp at world 2 all have dp=1, so they read exactly the micro-batches of a 1-rank run: their
losses must equal its losses (fp32). One reference run serves all three. Resume tests restart from a
mid-run checkpoint into a fresh run directory and must continue identically.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT, check, launch, losses, metrics

pytestmark = pytest.mark.dist

STEPS = 6
BASE = [*FAST, "model.config.vocab_size=257", f"train.steps={STEPS}"]
TOL = 1e-4


def _run(tiny_data: Path, out: Path, extra: list[str], nproc: int = 2, launcher: str = "torchrun") -> Path:
    check(launch([*BASE, f"data.path={tiny_data}", f"output_dir={out}", *extra], nproc=nproc, launcher=launcher))
    return out


def _resume_from(run: Path, step: int, out: Path, tiny_data: Path, extra: list[str]) -> dict[int, float]:
    """Start a fresh run dir from ``run``'s checkpoint at ``step`` and return the continued losses."""
    tag = f"step_{step:08d}"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / tag, out / "checkpoints" / tag)
    (out / "checkpoints" / "latest").write_text(tag)
    _run(tiny_data, out, extra)
    return losses(out)


def _grad_norms(run: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in metrics(run) if "grad_norm" in r}


def _assert_close(got: dict[int, float], want: dict[int, float], tol: float, what: str) -> None:
    assert sorted(got) == sorted(want), what
    diffs = {s: abs(got[s] - want[s]) for s in want}
    assert max(diffs.values()) <= tol, f"{what}: |loss - reference| per step {diffs}"


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    """The plain 1-rank run (no pipeline, no sharding): what pp/tp/sp must reproduce."""
    return _run(tiny_data, tmp_path_factory.mktemp("ref") / "run", [], nproc=0, launcher="python")


def _matches_reference(run: Path, reference: Path, what: str) -> None:
    """Same losses and same gradient norms (the norm catches a gradient scaled by a constant, which
    Adam plus clipping would hide from the loss curve)."""
    _assert_close(losses(run), losses(reference), TOL, f"{what}: loss")
    _assert_close(_grad_norms(run), _grad_norms(reference), 1e-3, f"{what}: grad norm")


def _falls(curve: dict[int, float]) -> None:
    assert curve[STEPS] < curve[1] - 0.3, f"loss did not fall: {curve}"


def test_pipeline_matches_unpipelined_and_resumes_identically_with_recompute(tiny_data, tmp_path, reference):
    pp = ["parallel=pp2", "train.checkpoint_interval=3"]
    run = _run(tiny_data, tmp_path / "pp", pp)
    curve = losses(run)
    _falls(curve)
    _matches_reference(run, reference, "pp=2 vs the unpipelined model on the same micro-batches")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS
    # each stage saved its own layers
    layer_files = sorted(p.name for p in (run / "checkpoints" / "step_00000003").glob("layer_*-model_states.pt"))
    assert layer_files == [f"layer_{i:02d}-model_states.pt" for i in range(6)]  # embed, 4 decoders, norm (head is tied)
    # The continuation recomputes every decoder layer in backward (activation checkpointing inside the
    # stages): recompute must not change a single number, so it must still match the uninterrupted run.
    ckpt = [*pp, "parallel.pipeline.activation_checkpoint_interval=1"]
    resumed = _resume_from(run, 3, tmp_path / "pp_resumed", tiny_data, ckpt)
    _assert_close({s: resumed[s] for s in (4, 5, 6)}, {s: curve[s] for s in (4, 5, 6)}, 1e-6, "pp resume + recompute")


def test_tensor_parallel_matches_single_rank(tiny_data, tmp_path, reference):
    run = _run(tiny_data, tmp_path / "tp", ["parallel=tp2"])
    curve = losses(run)
    _falls(curve)
    _matches_reference(run, reference, "tp=2 vs tp=1")
    assert "AutoTP tp=2" in (run / "logs" / "rank00000.log").read_text()


def test_sequence_parallel_matches_single_rank(tiny_data, tmp_path, reference):
    run = _run(tiny_data, tmp_path / "sp", ["parallel=sp2"])
    curve = losses(run)
    _falls(curve)
    _matches_reference(run, reference, "sp=2 vs sp=1")
    assert "each rank holds 32 of 64 tokens" in (run / "logs" / "rank00000.log").read_text()


def test_expert_parallel_shards_experts_logs_balance_and_resumes(tiny_data, tmp_path):
    ep = ["model=tiny_moe", "model.config.vocab_size=257", "parallel=ep2", "train.checkpoint_interval=3"]
    run = _run(tiny_data, tmp_path / "ep", ep)
    curve = losses(run)
    _falls(curve)
    summary = json.loads((run / "summary.json").read_text())
    shards = summary["moe_local_experts"]  # per rank: {layer: [global expert ids]}
    assert len(shards) == 2 and len(shards[0]) == 2, shards  # 2 ranks x 2 MoE layers
    for layer in shards[0]:
        mine, theirs = set(shards[0][layer]), set(shards[1][layer])
        assert len(mine) == len(theirs) == 2 and not mine & theirs, shards  # half of 4 experts each, disjoint
    assert summary["moe_nonexpert_agree"], summary["moe_nonexpert_digests"]
    assert summary["moe_expert_digests"][0] != summary["moe_expert_digests"][1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "loss" in r)
    assert row["moe/aux_loss_coef"] == pytest.approx(0.02)
    assert row["moe/aux_loss"] > 0
    for layer in (0, 1):
        shares = [row[f"moe/L{layer}/e{e}"] for e in range(4)]
        assert sum(shares) == pytest.approx(1.0)
        assert row[f"moe/L{layer}/max_load"] >= 1.0
    assert 0.0 <= row["moe/over_capacity_frac"] < 1.0
    resumed = _resume_from(run, 3, tmp_path / "ep_resumed", tiny_data, ep)
    _assert_close({s: resumed[s] for s in (4, 5, 6)}, {s: curve[s] for s in (4, 5, 6)}, 1e-6, "ep resume")


def _weight_reads(trace: Path, rank: int, files: dict[str, str]) -> list[str]:
    """The tensors ``rank`` read from the checkpoint's safetensors files, each checked to come from the file the
    index names (``tests/weights_trace``: every read, whoever made it, ours or a ``from_pretrained``)."""
    reads = [ln.split("\t") for ln in Path(f"{trace}.rank{rank}").read_text().splitlines()]
    assert reads, f"stage {rank} read no tensor"
    assert all(key != "*" for _, key in reads), f"stage {rank} read a whole safetensors file"
    assert all(files.get(key) == path for path, key in reads), f"stage {rank} read from another file: {reads}"
    return [key for _, key in reads]


def test_pipeline_stages_load_only_their_tensors_from_a_pretrained_model(tiny_data, tmp_path):
    """model.pretrained_path under pp=2: each stage reads its own tensors from the safetensors (by the index),
    shown by every tensor each rank took from the files (traced at safetensors itself, so a stray
    ``from_pretrained`` shows too), and the pipelined model is the pretrained one: its first loss equals the
    unpipelined model's."""
    from ultrascale.config.compose import compose
    from ultrascale.model.build import build_model

    cfg = compose([*BASE])
    pretrained = tmp_path / "pretrained"
    build_model(cfg.model, seed=4321).save_pretrained(pretrained, max_shard_size="200KB")  # several files + index
    assert (pretrained / "model.safetensors.index.json").exists()
    index = json.loads((pretrained / "model.safetensors.index.json").read_text())["weight_map"]
    files = {k: str((pretrained / f).resolve()) for k, f in index.items()}
    model = [f"model.pretrained_path={pretrained}", "train.steps=2"]
    trace, out = tmp_path / "reads", tmp_path / "pp"
    tracer = os.pathsep.join(filter(None, [str(ROOT / "tests" / "weights_trace"), os.environ.get("PYTHONPATH")]))
    check(launch([*BASE, f"data.path={tiny_data}", f"output_dir={out}", *model, "parallel=pp2"],
                 env={"WEIGHTS_TRACE": str(trace), "PYTHONPATH": tracer}))  # fmt: skip
    pp = losses(out)
    every = set(index)
    reads = [_weight_reads(trace, r, files) for r in range(2)]
    layers = [{k for k in keys if k.startswith("model.layers.")} for keys in reads]
    n_layers = cfg.model.config.num_hidden_layers
    for rank, keys in enumerate(reads):
        assert len(keys) == len(set(keys)), f"stage {rank} read a tensor twice"
        assert set(keys) < every, f"stage {rank} read every tensor"
        own = {int(k.split(".")[2]) for k in layers[rank]}
        assert len(own) == n_layers // 2, (rank, sorted(own))  # its half of the layers, whole
        assert all(f"{k}" in keys for k in every if k.startswith("model.layers.") and int(k.split(".")[2]) in own)
    assert not layers[0] & layers[1], "a layer's tensors were read by both stages"
    assert set(reads[0]) | set(reads[1]) == every
    assert {k for k in reads[1] if not k.startswith("model.layers.")} >= {"model.norm.weight"}
    assert not any(k.startswith("model.norm.") for k in reads[0])
    whole = losses(_run(tiny_data, tmp_path / "whole", model, nproc=0, launcher="python"))
    assert pp[1] == pytest.approx(whole[1], abs=1e-5), (pp, whole)
    fresh = losses(_run(tiny_data, tmp_path / "fresh", ["train.steps=2"], nproc=0, launcher="python"))
    assert abs(fresh[1] - whole[1]) > 1e-3  # the weights really came from the checkpoint (seed 4321, not 1234)
