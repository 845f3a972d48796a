"""Baseline for bench/train_overhead.py: train.py's engine with none of train.py's extras (equal levers).

The engine is built by the same code as train.py's (``compose`` -> ``validate`` -> ``build_engine`` from the
same overrides): the same model, compile, fused loss, attention kernel, document masking, optimizer and
DeepSpeed JSON. The loop then does only forward, backward and step on the same batches train.py reads
(``StepBatches``), with the lr set per step. No metrics, no loss all-reduce, no stability verdicts, no
breakdown timers, no checkpoint or eval hooks, no progress bar: ``ultrascale / this`` is what those cost.

Timed like the other sides (end of step 1 to end of step N). Run under torchrun as
``_equal_loop.py STEPS OVERRIDE...``; prints one JSON line on rank 0. Not a user-facing tool.
"""

import json
import sys
import time
from itertools import pairwise

import torch


def main() -> None:
    steps, overrides = int(sys.argv[1]), [*sys.argv[2:], "train.step_breakdown=false"]  # the timers are an extra
    from omegaconf import OmegaConf

    from ultrascale.config.compose import compose
    from ultrascale.data.loader import StepBatches
    from ultrascale.data.shards import load_manifest, open_split
    from ultrascale.levers.deepspeed import build_ds_config
    from ultrascale.levers.rules import validate
    from ultrascale.runtime import dist
    from ultrascale.train.engine import build_engine
    from ultrascale.train.optim import apply_lr

    cfg = compose(overrides)
    d = validate(cfg, dist.world_size())
    dist.init_distributed()
    typed = OmegaConf.to_object(cfg)
    ds = build_ds_config(typed, d)
    engine, _ = build_engine(typed, d, ds)
    data = typed.data
    split = open_split(data.path, "train", verify=False)
    eos = int(load_manifest(data.path)["eos_token_id"])
    rank = torch.distributed.get_rank(engine.data_parallel_group) if d.topo.dp > 1 else 0
    batches = StepBatches(split, data.micro_batch, data.global_batch, rank, d.topo.dp, typed.train.seed,
                          eos_id=eos, document_masking=d.document_masking.on)  # fmt: skip
    gas, losses, stamps = batches.grad_accum, [], []
    for step in range(steps):
        apply_lr(engine.optimizer, step, typed.optim.sched, steps, 1.0)
        for m in range(gas):
            loss = engine(**batches.get(step, m).model_inputs()).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        stamps.append(time.perf_counter())
        if step == 0:
            first_step_unix = time.time()
    per_step = torch.stack(losses).float().reshape(steps, gas).mean(1)  # outside the window, as in the bare loop
    torch.distributed.all_reduce(per_step)
    per_step /= torch.distributed.get_world_size()
    if dist.is_rank0():
        tokens = data.global_batch * data.seq_len * (steps - 1)
        print(json.dumps({"tokens_per_s": tokens / (stamps[-1] - stamps[0]), "steps_timed": steps - 1,
                          "step_intervals_s": [round(b - a, 5) for a, b in pairwise(stamps)],
                          "first_step_unix": first_step_unix, "loss": float(per_step[-1]),
                          "losses": [round(float(x), 5) for x in per_step],
                          "levers": {k: str(c.why) for k, c in d.features().items()}}), flush=True)  # fmt: skip
    engine.destroy()
    dist.shutdown()


if __name__ == "__main__":
    main()
