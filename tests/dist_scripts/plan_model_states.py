"""2-rank measurement of DeepSpeed's real model-state tensors for ZeRO 0-3 (run by tests/test_plan_model_states.py).

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/plan_model_states.py OUT.jsonl 'OVERRIDES|...' ...
Each argument after OUT is one scenario: Hydra overrides joined by spaces. For each, the engine is built from
the project's own config stack (compose -> validate -> build_ds_config), one step is taken (optimizer state
exists), then one more micro-step's forward/backward (gradients exist, mid-accumulation when GA > 1), and every
rank appends one JSON line with
the bytes of the engine's parameter, gradient and optimizer tensors, deduplicated by (address, size).
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from ultrascale.config.compose import compose
from ultrascale.levers.deepspeed import build_ds_config
from ultrascale.levers.rules import validate
from ultrascale.model.build import build_hf_config
from ultrascale.runtime.dist import shutdown


class Tally:
    """Bytes covered by a set of tensors: the union of their address ranges, so views into one buffer
    (a flat partition and the per-parameter views of it) count once."""

    def __init__(self) -> None:
        self.ranges: set[tuple[int, int]] = set()

    def add(self, obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.numel():
                self.ranges.add((obj.data_ptr(), obj.data_ptr() + obj.numel() * obj.element_size()))
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                self.add(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                self.add(o)

    @property
    def total(self) -> int:
        total, end = 0, -1
        for lo, hi in sorted(self.ranges):
            if hi > end:
                total += hi - max(lo, end)
                end = hi
        return total


def measure(engine: deepspeed.DeepSpeedEngine, stage: int) -> dict[str, int]:
    opt = engine.optimizer
    params, grads, optim = Tally(), Tally(), Tally()
    for p in engine.module.parameters():
        if stage == 3:
            params.add(p.ds_tensor)
        params.add(p.data)  # stage 3: empty when released; whole when persistent
    if stage == 0:
        grads.add([p.grad for p in engine.module.parameters() if p.grad is not None])
        optim.add(opt.fp32_groups)
    elif stage in (1, 2):
        grads.add(opt.averaged_gradients)
        grads.add(getattr(opt, "all_grad_tensors", None))  # stage 2 between accumulation boundaries
        grads.add([p.grad for p in engine.module.parameters() if p.grad is not None])  # stage 1 accumulating
        optim.add(opt.single_partition_of_fp32_groups)
    else:
        grads.add(opt.grad_partitions_flat_buffer)
        optim.add(opt.fp32_partitioned_groups_flat)
    for state in opt.optimizer.state.values():
        optim.add({k: v for k, v in state.items() if k != "step"})
    return {"params": params.total, "grads": grads.total, "optimizer": optim.total}


def main() -> None:
    out_path, scenarios = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    from transformers import AutoModelForCausalLM

    for scenario in scenarios:
        overrides = scenario.split()
        cfg = compose(overrides)
        d = validate(cfg, dist.get_world_size())
        ds = build_ds_config(cfg, d)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(build_hf_config(cfg.model)).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
        ids = torch.randint(0, 256, (cfg.data.micro_batch, cfg.data.seq_len))
        ga = engine.gradient_accumulation_steps()
        for i in range(ga + 1):  # one full optimizer step, then one more micro-step's backward
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            if i < ga:
                engine.step()
        row = {"scenario": scenario, "rank": rank, **measure(engine, int(cfg.zero.stage))}
        with open(f"{out_path}.{rank}", "a") as f:
            f.write(json.dumps(row) + "\n")
        engine.destroy()
        del engine, model, optimizer
    shutdown()


if __name__ == "__main__":
    main()
