"""2-rank CPU training through the real entry point: ZeRO 0-3 (+offload), kill/resume, universal resume.

Each test launches ``train.py`` on gloo ranks exactly as a user would and reads what the run wrote.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import FAST, check, launch, losses, metrics
from tests.support import faults

pytestmark = pytest.mark.dist

STEPS = 10


def _falls(run_dir, steps=STEPS):
    ls = losses(run_dir)
    assert sorted(ls) == list(range(1, steps + 1)), f"missing steps: {sorted(ls)}"
    first, last = sum(ls[s] for s in (1, 2)) / 2, sum(ls[s] for s in (steps - 1, steps)) / 2
    assert last < first - 0.3, f"loss did not fall: {ls}"
    return ls


@pytest.mark.parametrize(
    "zero",
    [
        "stage0",
        "stage2",
        "stage3",
        pytest.param("stage2_offload", marks=pytest.mark.slow),  # compiles DeepSpeedCPUAdam on first use
        "stage3_offload",
    ],
)
def test_zero_stage_trains_and_replicas_agree(zero, tiny_data, tmp_path):
    out = tmp_path / zero
    check(launch([*FAST, f"zero={zero}", f"data.path={tiny_data}", f"output_dir={out}", f"train.steps={STEPS}"]))
    _falls(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas_agree"] is True and len(summary["param_digests"]) == 2
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == int(zero[5])
    for r in (0, 1):  # nothing is left for interpreter exit to destroy (a gloo group there can SIGABRT the rank)
        assert "no gloo thread left" in (out / "logs" / f"rank0000{r}.log").read_text()


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    """ZeRO-1, fp32, 2 ranks, 10 steps, a checkpoint every 3 steps (all kept)."""
    out = tmp_path_factory.mktemp("runs") / "uninterrupted"
    args = [*FAST, f"data.path={tiny_data}", f"train.steps={STEPS}", "train.checkpoint_interval=3",
            "train.keep_checkpoints=0", f"optim.sched.total_steps={STEPS}"]  # fmt: skip
    check(launch([*args, f"output_dir={out}"]))
    return out, args


def test_zero1_trains_and_keeps_every_checkpoint(uninterrupted):
    out, _ = uninterrupted
    _falls(out)
    tags = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert tags == ["step_00000003", "step_00000006", "step_00000009", "step_00000010"]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000010"


def test_kill_then_resume_equals_uninterrupted(uninterrupted, tmp_path):
    ref_dir, args = uninterrupted
    out = tmp_path / "killed"
    args = [*args, faults.SYNC_SAVES]  # step 3's checkpoint is `latest` before step 4 starts
    killed = launch([*args, f"output_dir={out}"], env=faults.env(kill_at="5"))
    assert killed.returncode != 0, "the fault hook did not kill the run"
    assert (out / "checkpoints" / "latest").read_text() == "step_00000003"
    check(launch([*args, f"output_dir={out}"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == 3
    ref, got = losses(ref_dir), losses(out)
    assert sorted(got) == sorted(ref)
    for step in ref:  # fp32, same ranks, same data and RNG: the curves are identical
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-6), step


def test_universal_checkpoint_resumes_on_one_rank(uninterrupted, tmp_path):
    ref_dir, args = uninterrupted
    src = tmp_path / "src"
    shutil.copytree(ref_dir / "checkpoints", src)
    from ultrascale.train.checkpoint import to_universal

    to_universal(src / "step_00000006")
    out = tmp_path / "one_rank"
    proc = check(
        launch(
            [*args, f"output_dir={out}", f"train.resume={src / 'step_00000006'}", "train.universal_checkpoint=true"],
            nproc=0,
        )
    )
    assert "resumed from" in proc.stdout
    ref, got = losses(ref_dir), losses(out)
    assert sorted(got) == [7, 8, 9, 10]
    for step in got:  # same samples per step; only the reduction order differs (2 ranks x 2 accum vs 1 x 4)
        assert got[step] == pytest.approx(ref[step], abs=2e-4), step


def test_muon_trains_under_zero2(tiny_data, tmp_path):
    out = tmp_path / "muon"
    check(launch([*FAST, "optim=muon", "zero=stage2", "optim.muon_lr=0.02", "optim.sched.warmup_steps=2",
                  f"data.path={tiny_data}", f"output_dir={out}", f"train.steps={STEPS}"]))  # fmt: skip
    _falls(out)


def test_compiled_model_trains_like_eager(tiny_data, tmp_path):
    """train.compile, whole model and layer by layer: the inductor graphs compute the eager step (fp32;
    reassociation-level differences only)."""
    runs, logs = {}, {}
    for name, args in {"eager": ["train.compile=false"], "model": ["train.compile=true"],
                       "layers": ["train.compile=true", "train.compile_scope=layers"]}.items():  # fmt: skip
        out = tmp_path / name
        proc = check(launch([*FAST, f"data.path={tiny_data}", f"output_dir={out}", "train.steps=4", *args]))
        runs[name], logs[name] = losses(out), proc.stdout + proc.stderr
    assert "compile: first step (compile included) took" in logs["layers"]
    assert "torch.compile (inductor) of each decoder layer" in logs["layers"]
    assert "compile: 4 of 4 decoder layers compiled in place" in logs["layers"]
    for step, ref in runs["eager"].items():
        assert runs["model"][step] == pytest.approx(ref, abs=1e-4), step
        assert runs["layers"][step] == pytest.approx(ref, abs=1e-4), step


def test_profile_window_writes_a_table_and_trace_per_rank(tiny_data, tmp_path):
    """train.profile_steps: steps 2-3 profiled on both ranks; the table ranks real operators, the trace parses."""
    out = tmp_path / "profiled"
    proc = check(launch([*FAST, f"data.path={tiny_data}", f"output_dir={out}", "train.steps=4",
                         "train.profile_start=1", "train.profile_steps=2"]))  # fmt: skip
    assert "profile of steps 2..3" in proc.stdout + proc.stderr
    for rank in (0, 1):
        table = (out / "profile" / f"rank{rank:05d}.txt").read_text()
        assert table.startswith(f"torch.profiler, rank {rank}, optimizer steps 2..3") and "aten::mm" in table
        trace = json.loads((out / "profile" / f"rank{rank:05d}.trace.json").read_text())
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert sorted(losses(out)) == [1, 2, 3, 4]


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_zero3_builds_partitioned_from_the_same_weights_as_zero1(tiny_data, tmp_path, model):
    """Weights are keyed by (seed, parameter name), so the model ZeRO-3 builds partitioned (each rank drawing only
    its slices) is the model ZeRO-1 builds whole: the first step's loss is the same to float rounding. The MoE
    model's sparse blocks are ZeRO-3 leaf modules (gathered whole), built under the same zero.Init."""
    runs = {}
    for zero in ("stage1", "stage3"):
        out = tmp_path / zero
        check(launch([*FAST, f"model={model}", "model.config.vocab_size=257", f"zero={zero}",
                      f"data.path={tiny_data}", f"output_dir={out}", "train.steps=4"]))  # fmt: skip
        runs[zero] = losses(out)
    assert runs["stage3"][1] == pytest.approx(runs["stage1"][1], abs=1e-5), runs
    assert runs["stage3"][4] < runs["stage3"][1], runs  # and it trains


def test_zero3_loads_a_pretrained_model_partitioned_to_the_same_weights(tiny_data, tmp_path):
    """model.pretrained_path under ZeRO-3 goes through transformers' ZeRO-3 loader (one checkpoint file and one
    module gathered at a time): the model it partitions is the checkpoint's, so the first loss is ZeRO-1's on the
    same checkpoint, and not a freshly drawn model's."""
    from ultrascale.config.compose import compose
    from ultrascale.model.build import build_model

    cfg = compose([*FAST, "model.config.vocab_size=257"])
    pretrained = tmp_path / "pretrained"
    build_model(cfg.model, seed=4321).save_pretrained(pretrained, max_shard_size="200KB")  # several files + index
    assert (pretrained / "model.safetensors.index.json").exists()
    runs = {}
    for name, extra in {"stage1": [f"model.pretrained_path={pretrained}"],
                        "stage3": [f"model.pretrained_path={pretrained}"], "fresh": []}.items():  # fmt: skip
        out = tmp_path / name
        zero = "stage3" if name == "stage3" else "stage1"
        check(launch([*FAST, "model.config.vocab_size=257", f"zero={zero}", f"data.path={tiny_data}",
                      f"output_dir={out}", "train.steps=2", *extra]))  # fmt: skip
        runs[name] = losses(out)
    assert runs["stage3"][1] == pytest.approx(runs["stage1"][1], abs=1e-5), runs
    assert abs(runs["fresh"][1] - runs["stage1"][1]) > 1e-3, runs  # the weights came from the checkpoint


def test_the_steady_state_rate_ends_with_the_last_update_not_the_closing_checkpoint(tiny_data, tmp_path):
    """``wall_tokens_per_s`` covers steps 2..N like every baseline's window; the run's closing eval and
    checkpoint are its exit. A 4 s checkpoint planted at the last step must not slow the reported rate."""
    out = tmp_path / "window"
    check(launch([*FAST, f"data.path={tiny_data}", f"output_dir={out}", "train.steps=5", "train.log_interval=1"],
                 env={"ULTRASCALE_INJECT": "slow_ckpt@5x4"}))  # fmt: skip
    stamps = {r["step"]: r["time_s"] for r in metrics(out) if "loss" in r and "event" not in r}
    window = stamps[5] - stamps[1]  # end of step 1 to end of step 5, as the step rows were logged
    assert window < 4, window  # the planted stall comes after the last update
    steps_rate = 8 * 64 * 4 / window  # FAST: 8 samples x 64 tokens per step, 4 steps in the window
    rate = json.loads((out / "summary.json").read_text())["wall_tokens_per_s"]
    assert rate == pytest.approx(steps_rate, rel=0.15), (rate, steps_rate)
