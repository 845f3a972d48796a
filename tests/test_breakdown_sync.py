"""The step breakdown adds no synchronisation on a GPU step whose row is not logged (issue 42, part 6).

DeepSpeed 0.19.8 reads every engine timer after every micro-step (``_update_wall_clock_timers``): on a GPU
each read is ``end_event.synchronize()``, a host stall per ``engine.step()``. Its throughput timer, on by
default, synchronises the device at every forward and step. The breakdown decided for an nccl run
(``events``) reads the timers only for a logged row and drops them unread otherwise, and the DeepSpeed JSON
turns the throughput timer off.

CUDA events do not run here, so the reads are counted where every timer kind goes through: DeepSpeed's own
``Timer._get_elapsed_msec`` (a host timer on the CPU accelerator, a ``CudaEventTimer`` wait on a GPU), on a
real DeepSpeed engine, with the lazy mode the nccl decision selects.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ultrascale.config.compose import compose

GAS = 2
STEPS = 6
LOGGED = {2, 4, 6}  # 1-based, as the trainer logs them (train.log_interval=2)


def _decisions(backend: str):
    from ultrascale.levers.rules import validate
    from ultrascale.runtime.gpu import GpuInfo

    cfg = compose(["recipe=cpu_smoke", "train.log_interval=10"])
    gpu = GpuInfo(name="NVIDIA H100 80GB HBM3", memory_bytes=80 * 2**30, capability=(9, 0), free_bytes=78 * 2**30)
    return validate(cfg, 2, backend=backend, gpu=gpu if backend == "nccl" else None), cfg


def test_gpu_decision_reads_engine_timers_only_for_logged_rows_and_turns_off_the_throughput_timer():
    from ultrascale.levers.deepspeed import build_ds_config

    gpu, cfg = _decisions("nccl")
    assert gpu.step_breakdown.on and gpu.step_breakdown.value == "events", gpu.step_breakdown
    assert "train.log_interval=10" in gpu.step_breakdown.why and "no synchronisation" in gpu.step_breakdown.why
    cpu, _ = _decisions("gloo")
    assert cpu.step_breakdown.on and cpu.step_breakdown.value == "host", cpu.step_breakdown
    for d in (gpu, cpu):
        assert build_ds_config(cfg, d)["timers"] == {"throughput": {"enabled": False}}


def test_lazy_breakdown_reads_no_timer_on_steps_whose_row_is_not_logged(tmp_path):
    from tests.conftest import check, launch  # here: this file is also the torchrun worker's script

    out = tmp_path / "reads.json"
    check(launch(["--worker", str(out)], nproc=1, script="tests/test_breakdown_sync.py", timeout=300))
    got = json.loads(out.read_text())
    lazy, host = got["lazy"], got["host"]
    for step in range(1, STEPS + 1):
        reads, row = lazy[str(step)]["reads"], lazy[str(step)]["row"]
        if step in LOGGED:
            # one read per engine timer, holding this step's GAS micro-steps only (the unread steps were dropped)
            assert sorted(reads) == sorted([["bwd_inner_microstep", GAS], ["bwd_allreduce_microstep", GAS],
                                            ["step_microstep", GAS]]), (step, reads)  # fmt: skip
            assert row["bwd_s"] > 0 and row["opt_s"] > 0 and row["fwd_s"] > 0, row
            assert sum(row[p] for p in ("data_wait_s", "fwd_s", "bwd_s", "comm_s", "opt_s", "other_s")) <= (
                row["step_s"] * 1.05
            ), row
        else:
            assert reads == [], (step, reads)  # no event read, so no wait, on a step whose row is not logged
            assert "bwd_s" not in row and row["other_s"] <= row["step_s"], row
    # DeepSpeed's own cadence (the host-clock mode a CPU run keeps): every timer read after every micro-step
    for step in range(1, STEPS + 1):
        assert len(host[str(step)]["reads"]) >= 3 * GAS, (step, host[str(step)])


def _worker(out: Path) -> None:
    """One rank: a real engine of the smoke recipe, GAS micro-steps a step, rows logged on LOGGED steps."""
    import torch
    from deepspeed.utils.timer import SynchronizedWallClockTimer

    from ultrascale.levers.deepspeed import build_ds_config
    from ultrascale.levers.rules import validate
    from ultrascale.runtime import dist
    from ultrascale.train.breakdown import StepBreakdown
    from ultrascale.train.engine import build_engine

    dist.configure_env()
    dist.init_distributed()
    reads: list = []
    original = SynchronizedWallClockTimer.Timer._get_elapsed_msec

    def counted(timer):
        if timer.event_timers:
            reads.append([timer.name_, len(timer.event_timers)])
        return original(timer)

    SynchronizedWallClockTimer.Timer._get_elapsed_msec = counted
    cfg = compose(["recipe=cpu_smoke", "data.global_batch=8", "data.micro_batch=4", "train.log_interval=2"])
    d = validate(cfg, 1)
    assert d.step_breakdown.on
    result = {}
    for mode, lazy in (("lazy", True), ("host", False)):
        engine, _ = build_engine(cfg, d, build_ds_config(cfg, d))
        bd = StepBreakdown(engine, True, False, lazy=lazy)
        ids = torch.randint(0, d.hf_config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
        rows = {}
        for step in range(1, STEPS + 1):
            del reads[:]
            bd.start()
            for _ in range(GAS):
                out_ = bd.forward(engine, input_ids=ids, labels=ids)
                bd.engine_call(engine.backward, out_.loss)
                bd.engine_call(engine.step)
                bd.after_micro_step()
            row = bd.finish(read=step in LOGGED)
            rows[step] = {"reads": list(reads), "row": row}
        result[mode] = rows
        engine.destroy()
    out.write_text(json.dumps(result))
    dist.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]))
