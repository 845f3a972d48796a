"""Single-process pieces of the trainer: schedules, param groups, step-addressed data, shards, checkpoints."""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import write_byte_dataset
from ultrascale.data.loader import StepBatches, eval_batches
from ultrascale.data.shards import open_split
from ultrascale.errors import CheckpointError, DataError
from ultrascale.train import checkpoint
from ultrascale.train.optim import lr_multiplier, param_groups


def sched(**kw):
    base = {"name": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1, "decay_fraction": 0.2, "total_steps": None}
    return OmegaConf.create({**base, **kw})


def test_cosine_warms_up_then_decays_to_floor():
    s = sched()
    lrs = [lr_multiplier(i, s, 100) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_wsd_is_flat_then_decays_linearly():
    s = sched(name="wsd", min_lr_ratio=0.0)
    lrs = [lr_multiplier(i, s, 100) for i in range(101)]
    assert lrs[10:80] == [1.0] * 70
    assert lrs[90] == pytest.approx(0.5) and lrs[100] == pytest.approx(0.0)


def test_total_steps_pins_the_schedule():
    s = sched(total_steps=50)
    assert lr_multiplier(30, s, 10) == lr_multiplier(30, s, 1000)


def test_no_weight_decay_on_norms_and_biases():
    from transformers import AutoConfig, AutoModelForCausalLM

    m = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "starcoder2",
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_bias=True,
        )
    )
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert all(p.ndim >= 2 for p in decay["params"])
    nd = {names[id(p)] for p in no_decay["params"]}
    assert any(n.endswith(".bias") for n in nd) and any("norm" in n for n in nd)
    assert no_decay["weight_decay"] == 0.0


@pytest.fixture
def split(tmp_path):
    return open_split(write_byte_dataset(tmp_path / "d", seq_len=32, max_files=10), "train")


def test_step_batches_cover_each_step_once_for_any_layout(split):
    """The samples of a step are the same set whatever (dp, grad-accum) splits them: universal resume needs it."""

    def step_set(step, dp, mb, gb):
        out = []
        for r in range(dp):
            b = StepBatches(split, mb, gb, r, dp, seed=7)
            for m in range(b.grad_accum):
                out.extend(b.indices(step, m).tolist())
        return sorted(out)

    a, b, c = step_set(3, 1, 8, 16), step_set(3, 2, 4, 16), step_set(3, 4, 2, 16)
    assert a == b == c and len(set(a)) == 16
    assert step_set(3, 2, 4, 16) != step_set(4, 2, 4, 16)


def test_step_batches_are_deterministic_and_wrap_epochs(split):
    b = StepBatches(split, 4, 8, 0, 1, seed=1)
    assert torch.equal(b.get(5, 1).input_ids, StepBatches(split, 4, 8, 0, 1, seed=1).get(5, 1).input_ids)
    steps_per_epoch = len(split) // 8
    first_epoch = {int(i) for s in range(steps_per_epoch) for m in range(2) for i in b.indices(s, m)}
    assert len(first_epoch) == steps_per_epoch * 8  # no repeats within an epoch
    assert b.get(steps_per_epoch + 1, 0).input_ids.shape == (4, 32)  # keeps going into epoch 2


def test_eval_batches_equal_count_per_rank(split):
    counts = [len(list(eval_batches(split, 2, 3, r, 3))) for r in range(3)]
    assert counts == [3, 3, 3]


@pytest.mark.parametrize("micro, dp", [(4, 3), (3, 2), (8, 4)])
def test_a_whole_split_eval_scores_every_sample_once_and_runs_equal_forwards(split, micro, dp):
    """``data.eval_batches=0``: every held-out sample is a target row exactly once over the ranks, and every rank
    runs the same number of forwards (the short ones padded with rows that have no targets)."""
    assert len(split) % (micro * dp)  # a split that does not divide: the padding is exercised
    per_rank = [list(eval_batches(split, micro, 0, r, dp)) for r in range(dp)]
    assert len({len(b) for b in per_rank}) == 1 and all(x.input_ids.shape[0] == micro for b in per_rank for x in b)
    scored = sorted(tuple(row.tolist()) for b in per_rank for x in b for row, lab in zip(x.input_ids, x.labels)
                    if (lab != -100).any())  # fmt: skip
    everything = sorted(tuple(row.tolist()) for row in split.get(np.arange(len(split))))
    assert scored == everything


def test_corrupt_and_truncated_shards_are_named(tmp_path):
    d = write_byte_dataset(tmp_path / "d", seq_len=32, max_files=10)
    shard = d / json.loads((d / "manifest.json").read_text())["splits"]["train"]["shards"][0]["path"]
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"shard .*shard_00000.npy is corrupt \(sha256"):
        open_split(d, "train")
    shard.write_bytes(bytes(raw[:200]))
    with pytest.raises(DataError, match=r"truncated or not a .npy file"):
        open_split(d, "train", verify=False)
    with pytest.raises(DataError, match=r"does not exist"):
        open_split(tmp_path / "nope", "train")


def test_checkpoint_verify_names_missing_and_truncated_files(tmp_path):
    tag = tmp_path / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.verify(tag)
    (tag / checkpoint.META).write_text(json.dumps({"step": 4, "files": {"mp_rank_00_model_states.pt": 100}}))
    assert checkpoint.verify(tag)["step"] == 4
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    with pytest.raises(CheckpointError, match=r"truncated: mp_rank_00_model_states.pt has 10 bytes, expected 100"):
        checkpoint.verify(tag)
    (tag / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        checkpoint.verify(tag)


def test_find_resume_uses_latest_only(tmp_path):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    assert checkpoint.find_resume(ck, "auto", False) is None
    (ck / "step_00000002").mkdir()
    (ck / "step_00000002" / checkpoint.META).write_text(json.dumps({"step": 2, "files": {}}))
    (ck / "step_00000004").mkdir()  # a save that was killed: no meta, and latest never pointed at it
    (ck / "latest").write_text("step_00000002")
    assert checkpoint.find_resume(ck, "auto", False).name == "step_00000002"
    assert checkpoint.find_resume(ck, "never", False) is None
    with pytest.raises(CheckpointError, match="to_universal"):
        checkpoint.find_resume(ck, "auto", True)


def test_byte_samples_are_real_code():
    from tests.conftest import byte_samples

    text = bytes(np.asarray(byte_samples(64, max_files=2)[0], dtype=np.uint8)).decode("utf-8", "replace")
    assert any(w in text for w in ("import", "def ", '"""', "#"))


def test_fused_adamw_is_the_same_update_as_the_foreach_one():
    """optim.fused: torch's single-kernel AdamW, same math as the default (multi-tensor) path."""
    from ultrascale.config.compose import compose
    from ultrascale.train.optim import build_optimizer

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))]
    models.append(copy.deepcopy(models[0]))
    opts = [build_optimizer(m, compose([f"optim.fused={f}"]).optim) for m, f in zip(models, ("true", "false"))]
    assert opts[0].defaults["fused"] is True and not opts[1].defaults["fused"]
    x = torch.randn(32, 8)
    for _ in range(3):
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _planted_gemm(monkeypatch, tmp_path) -> list:
    """``gemm_rate`` replaced by fixed readings (fp32 50, bf16 200 GFLOP/s) over an empty peak cache; returns the
    list of the dtypes it is asked to measure, in order."""
    import torch

    from ultrascale.runtime import peak

    calls = []

    def fake_rate(dtype=torch.float32, **_):
        calls.append(dtype)
        return {"flops": 5e10 if dtype == torch.float32 else 2e11, "min": 4e10, "max": 6e10, "windows": 9}

    monkeypatch.setenv("ULTRASCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak, "gemm_rate", fake_rate)
    return calls


def test_cpu_peak_is_measured_once_per_cpu_dtype_threads_and_ranks(tmp_path, monkeypatch):
    """The calibrated peak is stored by (CPU model, dtype, threads, ranks) and read back, not re-measured."""
    import torch

    from ultrascale.runtime import peak

    calls = _planted_gemm(monkeypatch, tmp_path)
    first, _ = peak.cpu_peak(torch.float32)
    again, src = peak.cpu_peak(torch.float32)
    assert first == again == 5e10 and len(calls) == 1 and "calibrated 20" in src
    assert peak.cpu_peak(torch.bfloat16)[0] == 2e11 and len(calls) == 2  # another dtype is another key
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    peak.cpu_peak(torch.float32)  # two ranks share the cores: measured again
    assert len(calls) == 3
    peak.cpu_peak(torch.float32, remeasure=True)
    assert len(calls) == 4 and len(json.loads((tmp_path / "peak_flops.json").read_text())) == 3


@pytest.mark.parametrize("native", [True, False])
def test_a_bf16_run_divides_by_the_bf16_peak_only_where_the_cpu_multiplies_bf16_natively(tmp_path, monkeypatch,
                                                                                       native):  # fmt: skip
    """Without AMX or AVX-512 BF16, bf16 matmuls are emulated through fp32: MFU's peak is the fp32 GEMM's, and the
    emulated bf16 GEMM is never calibrated (on an AVX2 EPYC it ran at 0.3 GFLOP/s: over 5 minutes of start-up in
    every fresh run with autocast, and MFU 900 %)."""
    import dataclasses

    import torch

    from ultrascale.runtime import cpu, peak

    real = cpu.detect()
    flags = (real.flags - {"amx_bf16", "avx512_bf16"}) | ({"avx512_bf16"} if native else set())
    monkeypatch.setattr(cpu, "detect", lambda: dataclasses.replace(real, flags=frozenset(flags)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = _planted_gemm(monkeypatch, tmp_path)
    flops, src = peak.device_peak_flops(torch.bfloat16)
    assert calls == [torch.bfloat16 if native else torch.float32], calls
    assert flops == (2e11 if native else 5e10) and ("emulated" in src) == (not native), src
    assert peak.device_peak_flops(torch.float32)[0] == 5e10 and len(calls) == (2 if native else 1)


def test_gemm_rate_is_the_median_of_five_or_more_windows_timed_after_an_untimed_warm_up():
    """What the reading is made of, counted by torch's profiler: products ran before the first timed window
    (the warm-up, so cold caches and the thread pool's start are not in it), at least 5 windows even with no
    time to measure, and the rate is their median, not their mean or the first."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from ultrascale.runtime.peak import gemm_rate

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = gemm_rate(n=256, warmup_s=0.05, measure_s=0.0)
    products = sum(e.count for e in prof.key_averages() if e.key == "aten::mm")
    assert got["windows"] == len(got["rates"]) == 5, got
    assert products > got["windows"], (products, got["windows"])
    rates = got["rates"]
    assert got["flops"] == statistics.median(rates) and (got["min"], got["max"]) == (min(rates), max(rates))
    got = gemm_rate(n=256, warmup_s=0.0, measure_s=0.2)
    assert got["windows"] > 5 and got["flops"] == statistics.median(got["rates"])


TRAINER_MAX_LINES = 50
"""The design goal for ``ultrascale/train/trainer.py``: no function longer than this, its ``def`` line to its last
(issue 54: ``Trainer.fit`` had grown to 60)."""


def test_every_function_of_the_trainer_fits_in_50_lines():
    import ast

    from tests.conftest import ROOT

    tree = ast.parse((ROOT / "ultrascale" / "train" / "trainer.py").read_text())
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > TRAINER_MAX_LINES}  # fmt: skip
    assert not long, f"trainer.py functions over {TRAINER_MAX_LINES} lines (def to last line): {long}"
