"""A training step whose row is not logged reads nothing off the device but what the protocol needs (issue 46, part 3).

A GPU step is far shorter than a CPU step of the same job, so a device-to-host read the host waits for (``.item()``,
``float(t)``, ``.tolist()``, ``.cpu()``) costs a GPU run much more than this box shows. Two reads a step are the
protocol's and stay: the step's all-reduced loss, which the stability verdict judges before the update, and the
one copy of the all-gathered agreement (verdict, stop request, written checkpoint) every rank adopts. Everything
else (the gradient norm, the memory peak, MoE routing counts, timer events) is read only for a logged row.

CUDA does not run here, so the reads are counted where every kind of tensor goes through: ``torch.Tensor``'s
read methods, patched while ``train.py`` runs on 2 real CPU ranks, counted when ultrascale's own code (the
trainer and its helpers, not DeepSpeed or torch) calls them, per optimizer step.
"""

from __future__ import annotations

import json
import runpy
import sys
from collections import Counter
from pathlib import Path

import pytest

STEPS, LOG_INTERVAL = 6, 3
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
"""Every ``torch.Tensor`` method that hands a value to the host (on a GPU, a wait for the device)."""
PROTOCOL = {"ultrascale/train/step.py:wait __float__", "ultrascale/train/stability.py:agree tolist"}
"""The reads every step makes: the loss the verdict judges, and the agreement every rank adopts."""
HOST_SIDE = ("ultrascale/data/",)
"""The loader's tensors are host tensors by construction (built before ``to_device``): never a device read."""


@pytest.mark.dist
def test_an_unlogged_step_reads_only_the_loss_and_the_agreement(tiny_data, tmp_path):
    from tests.conftest import FAST, check, launch, metrics  # here: this file is also the torchrun worker's script

    out = tmp_path / "run"
    args = [*FAST, f"data.path={tiny_data}", f"output_dir={out}", f"train.steps={STEPS}",
            f"train.log_interval={LOG_INTERVAL}"]  # fmt: skip
    check(launch(["--worker", str(tmp_path), *args], script="tests/test_step_syncs.py", timeout=300))
    logged = {r["step"] for r in metrics(out) if "event" not in r and "loss" in r}
    assert logged == {3, 6}, logged
    for rank in (0, 1):
        reads = {int(k): Counter(v) for k, v in json.loads((tmp_path / f"reads.rank{rank}.json").read_text()).items()}
        assert sorted(reads) == list(range(1, STEPS + 1)), reads
        for step, sites in reads.items():
            if step in logged:  # a logged row reads its figures (the gradient norm at least)
                assert len(sites) > len(PROTOCOL), (rank, step, sites)
            else:
                assert sites == Counter(PROTOCOL), (rank, step, sites)


def _worker(where: Path, overrides: list[str]) -> None:
    """One rank: ``train.py`` as torchrun started it, with the host reads counted per optimizer step."""
    import torch

    import ultrascale
    from ultrascale.train.trainer import Trainer

    pkg = Path(ultrascale.__file__).resolve().parent
    step, reads = [0], {}

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            path = Path(caller.co_filename).resolve()
            if step[0] and path.is_relative_to(pkg):
                site = f"{path.relative_to(pkg.parent).as_posix()}:{caller.co_name} {name}"
                if not site.startswith(HOST_SIDE):
                    reads.setdefault(step[0], []).append(site)
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    train_step = Trainer.train_step

    def numbered(self, s: int):
        step[0] = s + 1  # as logged; the reads after train_step (recording, commits) count for the same step
        return train_step(self, s)

    Trainer.train_step = numbered
    sys.argv = ["train.py", *overrides]
    try:
        runpy.run_path("train.py", run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    rank = int(__import__("os").environ["RANK"])
    (where / f"reads.rank{rank}.json").write_text(json.dumps(reads))


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]), sys.argv[3:])
