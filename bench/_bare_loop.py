"""Baseline for bench/train_overhead.py: the least code that trains the same model with DeepSpeed.

Same model config, same DeepSpeed JSON (read from the train.py run), same shards, same batch; no
metrics, no checkpoints, no loggers. Prints one JSON line with the mean tokens/s (first step excluded).
Run under torchrun; not a user-facing tool.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    run_dir, data_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import deepspeed
    from omegaconf import OmegaConf

    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist

    from ultrascale.model.build import build_model

    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    ds = json.loads(Path(run_dir, "ds_config.json").read_text())
    model = build_model(cfg.model, seed=cfg.train.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    manifest = json.loads(Path(data_dir, "manifest.json").read_text())
    arr = np.load(os.path.join(data_dir, manifest["splits"]["train"]["shards"][0]["path"]), mmap_mode="r")
    mb, gas, rank, world = (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        dist.get_rank(),
        dist.get_world_size(),
    )
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for m in range(gas):
            start = ((step * gas + m) * world + rank) * mb % (len(arr) - mb)
            ids = torch.from_numpy(np.asarray(arr[start : start + mb], dtype=np.int64))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - t0)
    tokens = ds["train_batch_size"] * cfg.data.seq_len
    if rank == 0:
        print(json.dumps({"tokens_per_s": tokens / (sum(times[1:]) / len(times[1:])), "loss": loss.item()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
