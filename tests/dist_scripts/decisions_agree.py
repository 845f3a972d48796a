"""Two ranks train on a planted GPU node that reads differently per rank (run by tests/test_decisions_agree.py).

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/decisions_agree.py OUT_DIR TRAIN_OVERRIDES...

Each rank decides before the process group exists, from its own GPU: ``levers.rules.validate`` runs on a planted
node (``detect_backend`` says nccl; ``ultrascale.runtime.gpu.detect`` describes device N with :data:`FREE` [N]
free, as a node whose GPU 0 is busier than GPU 1 would), so the two ranks' fused-loss chunks differ and an nccl
run's checkpoint staging is ``pinned``. Then the real ``train.py`` runs on gloo ranks: ``train/run.py`` must make
every rank run rank 0's decisions, and the trainer must hand the staging decision to its checkpointer and
pre-stage the pinned buffers after the first step (``Trainer._after_step`` -> ``Checkpointer.prestage``), not
inside the first save's measured stall. What a CPU cannot run is planted as tests/test_ckpt_slab.py plants it:
the trainer's staging is rebuilt in the mode the checkpointer was handed, on a "device" with the strict
``cudart`` recorder. Last, ``python -m ultrascale.train.memprobe``'s probe runs on the same planted node, and its
records must show rank 0's decisions on both ranks too.

Each rank writes OUT_DIR/rankN.json: the devices it asked ``detect`` for, its decisions as validated
("before"), the trainer's ("after"), the staging string the checkpointer got, and the planted staging's
registrations at the top of steps 1 and 2; the probe writes OUT_DIR/mem.json.rankN.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
FREE = {0: 70 * GIB, 1: 6 * GIB}
"""Free memory of each planted device: the tiny model's fused-loss chunk differs between the two."""
GOT: dict[str, Any] = {"asked": []}
CUDART: list = []


def levers(d) -> dict:
    """The per-machine decisions a rank runs, by name: [on, value]."""
    return {k: [c.on, c.value] for k, c in d.features().items()} | {
        "staging": [d.checkpoint_staging.on, d.checkpoint_staging.value],
        "flat_batches": d.flat_batches,
    }


def plant_gpu_node() -> None:
    """``validate`` (train.py's and memprobe's) decides on the planted node; the process group stays gloo."""
    from ultrascale.levers import rules
    from ultrascale.runtime import dist, gpu

    def planted_detect(device: int | None = None) -> gpu.GpuInfo:
        idx = 0 if device is None else device  # before set_device the current device is GPU 0 on every rank
        GOT["asked"].append(device)
        return gpu.GpuInfo("NVIDIA H100 80GB HBM3", 81559 * 2**20, (9, 0), 2, FREE[idx], 132, index=idx)

    real_validate, real_backend, real_detect = rules.validate, dist.detect_backend, gpu.detect

    def planted_validate(cfg, world_size, backend=None, gpu_info=None):
        dist.detect_backend, gpu.detect = (lambda: "nccl"), planted_detect
        try:
            d = real_validate(cfg, world_size, backend, gpu_info)
        finally:
            dist.detect_backend, gpu.detect = real_backend, real_detect
        GOT.setdefault("before", levers(d))
        return d

    rules.validate = planted_validate


def at_step(trainer, step: int) -> None:
    """The trainer's step hook: before step 1, what the trainer runs and the planted staging in the mode its
    checkpointer was handed; before step 2 (step 1 done, nothing saved yet), what that staging holds."""
    import torch

    from tests.test_ckpt_slab import StrictCudart, planted_staging
    from ultrascale.train.ckpt_writer import Staging

    ck = trainer.checkpointer
    if step == 0:
        GOT.update(after=levers(trainer.decisions), gpu_free_after=trainer.decisions.gpu.free_bytes,
                   handed=ck.staging)  # fmt: skip
        CUDART.append(StrictCudart())
        torch.cuda.cudart = lambda: CUDART[0]
        st = planted_staging(CUDART[0]) if Staging(ck.staging, cuda=True).mode == "pinned" else Staging(ck.staging)
        ck.writer.staging = st
    elif step == 1:
        st = ck.writer.staging
        GOT["before_step_2"] = {"mode": st.mode, "registers": len(CUDART[0].registers()),
                                "allocations": st.allocations, "saved": ck.last_saved}  # fmt: skip


def main() -> None:
    from ultrascale.cli import run_app
    from ultrascale.runtime import dist
    from ultrascale.train import memprobe
    from ultrascale.train.hooks import STEP_HOOK_ENV

    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    sys.path.insert(0, str(ROOT))  # the hook imports test_ckpt_slab's planted cudart
    plant_gpu_node()
    os.environ[STEP_HOOK_ENV] = f"{__name__}:at_step"
    spec = importlib.util.spec_from_file_location("train_entry", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    real_shutdown, dist.shutdown = dist.shutdown, lambda: None  # the group outlives train.py's run, for the probe
    rc = run_app("train", train.main, help_text="", argv=overrides)
    dist.shutdown = real_shutdown
    rank = int(os.environ["RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps(GOT, indent=1))
    if rc:
        raise SystemExit(rc)
    memprobe._probe(str(out / "mem.json"), overrides)  # decides on the planted node again, and ends the group


if __name__ == "__main__":
    main()
