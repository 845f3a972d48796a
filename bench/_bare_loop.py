"""Baseline for bench/train_overhead.py: the least code that trains the same model with DeepSpeed.

Same model config, same DeepSpeed JSON (read from the train.py run), same shards, same batch, the same
warmup + schedule (set by hand each step); a plain torch AdamW over all parameters; no metrics, no
checkpoints, no loggers. Reads consecutive rows, rank-interleaved, in order.

Timed like the other two sides: wall clock from the end of optimizer step 1 to the end of step N, so
whatever the loop does between steps counts. Run under torchrun as ``_bare_loop.py RUN_DIR DATA_DIR STEPS``;
prints one JSON line (tokens/s, per-step losses) on rank 0. Not a user-facing tool.
"""

import json
import os
import sys
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    run_dir, data_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import deepspeed
    from omegaconf import OmegaConf

    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist

    from ultrascale.data.shards import open_split
    from ultrascale.model.build import build_model
    from ultrascale.runtime.dist import shutdown
    from ultrascale.train.optim import lr_multiplier

    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    ds = json.loads(Path(run_dir, "ds_config.json").read_text())
    ds["wall_clock_breakdown"] = False  # train.py's step-breakdown timers are one of its extras, not the baseline's
    model = build_model(cfg.model, seed=cfg.train.seed)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    split = open_split(data_dir, "train", verify=False)
    mb, gas, rank, world = (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        dist.get_rank(),
        dist.get_world_size(),
    )
    losses, stamps = [], []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = o.lr * lr_multiplier(step, o.sched, steps)
        for m in range(gas):
            start = ((step * gas + m) * world + rank) * mb % (len(split) - mb)
            ids = torch.from_numpy(split.get(np.arange(start, start + mb)))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        stamps.append(time.perf_counter())
        if step == 0:
            first_step_unix = time.time()
    # Outside the timed window: each step's loss, mean over micro-steps and ranks (what train.py logs).
    per_step = torch.stack(losses).float().reshape(steps, gas).mean(1)
    dist.all_reduce(per_step)
    per_step /= world
    tokens = ds["train_batch_size"] * cfg.data.seq_len * (steps - 1)
    if rank == 0:
        out = {
            "tokens_per_s": tokens / (stamps[-1] - stamps[0]),
            "steps_timed": steps - 1,
            "first_step_unix": first_step_unix,
            "step_intervals_s": [round(b - a, 5) for a, b in pairwise(stamps)],
            "loss": float(per_step[-1]),
            "losses": [round(float(x), 5) for x in per_step],
        }
        print(json.dumps(out), flush=True)
    engine.destroy()
    shutdown()


if __name__ == "__main__":
    main()
