"""Two ranks decide one run for GPUs that read differently (run by tests/test_decisions_agree.py).

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/decisions_agree.py OUT

Each rank validates llama_1b_zero0 (``train.activation_checkpointing=auto``) as train.py does, before the process
group exists, on a planted GPU node (``detect_backend`` says nccl; ``ultrascale.runtime.gpu.detect`` describes device N
with :data:`FREE` [N] free, as a node whose GPU 0 is busier than GPU 1 would), then joins a real gloo group and
calls :func:`ultrascale.levers.rules.agree_across_ranks`, as the trainer does. Rank 0 writes OUT (JSON): per
rank, the devices it asked ``detect`` for and its per-machine decisions before and after agreeing.
"""

from __future__ import annotations

import json
import os
import sys

GIB = 2**30
FREE = {0: 70 * GIB, 1: 6 * GIB}
"""Free memory of each planted device: llama_1b's chunk and checkpointing mode differ between the two."""


def main() -> None:
    import torch.distributed as tdist

    from ultrascale.config.compose import compose
    from ultrascale.levers.rules import agree_across_ranks, validate
    from ultrascale.runtime import dist, gpu

    asked = []

    def planted_detect(device: int | None = None) -> gpu.GpuInfo:
        idx = 0 if device is None else device  # before set_device the current device is GPU 0 on every rank
        asked.append(device)
        return gpu.GpuInfo("NVIDIA H100 80GB HBM3", 81559 * 2**20, (9, 0), 2, FREE[idx], 132, index=idx)

    real_backend = dist.detect_backend
    gpu.detect = planted_detect
    dist.detect_backend = lambda: "nccl"
    d = validate(compose(["recipe=llama_1b_zero0", "train.activation_checkpointing=auto"]), 2)
    dist.detect_backend = real_backend
    dist.init_distributed()  # gloo: this box has no GPU
    agreed = agree_across_ranks(d)

    def levers(x) -> dict:
        return {k: [c.on, c.why, c.value] for k, c in x.features().items()} | {"flat_batches": x.flat_batches}

    mine = {"rank": dist.rank(), "local_rank": int(os.environ["LOCAL_RANK"]), "asked": asked,
            "before": levers(d), "after": levers(agreed),
            "gpu_free_after": agreed.gpu.free_bytes}  # fmt: skip
    every = [None] * dist.world_size()
    tdist.all_gather_object(every, mine)
    if dist.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(every, f, indent=1)
    dist.shutdown()


if __name__ == "__main__":
    main()
