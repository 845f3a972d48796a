"""Train the same tiny model under each activation-checkpointing mode on 2 ranks (run by tests/test_gpu_levers.py).

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/checkpointing_modes.py OUT STEPS ARM=OVERRIDES...
(each ARM is ``name=override,override``).

Each arm is built as train.py builds a run (compose, validate, decide, a real DeepSpeed engine from
``build_engine``) from the same seed, then trains STEPS steps on the same batches in this one process, so the
arms differ only in what the backward keeps and recomputes. What each arm really did is counted, so an arm that
silently ran without checkpointing, or with full instead of selective, shows: the selective policy's forward
decisions (ops kept, ops left to recompute), and two forward ops seen *during the backward*: the MLP's SiLU
(recomputed by selective and full; never run by a backward without checkpointing) and the attention kernel
(recomputed only by full: selective keeps its output). Rank 0 writes OUT (JSON): per arm, the mean loss of every
step over both ranks, the decision's value and the counts.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

IN_BACKWARD = {"aten.silu.default": "silu", "aten._scaled_dot_product_flash_attention_for_cpu.default": "attention"}


class BackwardOps(TorchDispatchMode):
    """Counts the forward ops of :data:`IN_BACKWARD` that run while it is active (around ``engine.backward``)."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = IN_BACKWARD.get(str(func))
        if name:
            self.counts[f"backward_{name}"] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    arms = dict(a.split("=", 1) for a in sys.argv[3:])
    from omegaconf import OmegaConf
    from torch.utils.checkpoint import CheckpointPolicy

    from ultrascale.config.compose import compose
    from ultrascale.data.loader import StepBatches
    from ultrascale.data.shards import load_manifest, open_split
    from ultrascale.levers.deepspeed import build_ds_config
    from ultrascale.levers.rules import validate
    from ultrascale.model import recompute
    from ultrascale.runtime import dist
    from ultrascale.train.engine import build_engine
    from ultrascale.train.optim import apply_lr

    counts: Counter = Counter()
    plain = recompute.selective_policy

    def counted(ctx, func, *args, **kwargs):
        policy = plain(ctx, func, *args, **kwargs)
        counts["kept" if policy == CheckpointPolicy.MUST_SAVE else "dropped"] += 1
        return policy

    recompute.selective_policy = counted
    dist.init_distributed()
    result = {}
    for name, overrides in arms.items():
        counts.clear()
        cfg = compose(overrides.split(",") if overrides else [])
        d = validate(cfg, dist.world_size())
        typed = OmegaConf.to_object(cfg)
        engine, _ = build_engine(typed, d, build_ds_config(typed, d))
        data = typed.data
        split = open_split(data.path, "train", verify=False)
        eos = int(load_manifest(data.path)["eos_token_id"])
        rank = torch.distributed.get_rank(engine.data_parallel_group)
        batches = StepBatches(split, data.micro_batch, data.global_batch, rank, d.topo.dp, typed.train.seed,
                              eos_id=eos, document_masking=d.document_masking.on)  # fmt: skip
        losses = []
        for step in range(steps):
            apply_lr(engine.optimizer, step, typed.optim.sched, steps, 1.0)
            for m in range(batches.grad_accum):
                loss = engine(**batches.get(step, m).model_inputs()).loss
                with BackwardOps(counts):
                    engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
        per_step = torch.stack(losses).float().reshape(steps, batches.grad_accum).mean(1)
        torch.distributed.all_reduce(per_step)
        per_step /= torch.distributed.get_world_size()
        result[name] = {"losses": [float(x) for x in per_step], "mode": d.activation_checkpointing.value,
                        "why": d.activation_checkpointing.why, "counts": dict(counts)}  # fmt: skip
        engine.destroy()
    if dist.is_rank0():
        out.write_text(json.dumps(result, indent=1))
    dist.shutdown()


if __name__ == "__main__":
    main()
