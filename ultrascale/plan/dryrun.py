"""``train.py dry_run=true``: everything needed to sanity-check a run before booking the machines, computed
without building a weight: the resolved config, the topology, parameters and FLOPs, the planner's host-memory
figures for this layout, every decision with its reason, what preflight found, and the DeepSpeed JSON.

It lives with the planner because it is the planner's view of one composed layout; the training path
(``ultrascale.train``) never imports the planner.
"""

from __future__ import annotations

import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ultrascale.config.decide import Decisions
from ultrascale.model.arch import arch_from_hf
from ultrascale.plan.memory import GIB, construction_bytes, host_step_bytes
from ultrascale.plan.search import decided, layout_from_cfg
from ultrascale.train.banner import batch_line, zero_line


def host_memory_line(cfg: Any, d: Decisions) -> str:
    """The planner's host-memory figures for this layout: what building the model costs beside the steady state."""
    arch, lay = arch_from_hf(d.hf_config), decided(layout_from_cfg(cfg, d.topo.world), d)
    build = construction_bytes(arch, lay) / GIB
    how = ("partitioned from the first byte (ZeRO-3)" if d.zero3_init.on else
           "this stage's layers only" if d.pipeline else
           "the whole model: DeepSpeed 0.19.8's AutoTP shards it inside initialize(); measured 1.95 GiB per rank "
           "for a 0.51B model at tp=2, make bench-scale" if d.topo.tp > 1 else
           "the whole model")  # fmt: skip
    return (f"construction peak ~{build:.2f} GiB ({how}); model states between steps on a CPU rank "
            f"~{host_step_bytes(arch, lay) / GIB:.2f} GiB")  # fmt: skip


def dry_run_report(cfg: DictConfig, d: Decisions, ds_config: dict, found: dict[str, str]) -> str:
    """The report, as text (rank 0 prints it)."""
    from ultrascale.model.build import count_params
    from ultrascale.model.flops import train_flops_per_token

    counts = count_params(cfg.model)
    tokens = cfg.data.global_batch * cfg.data.seq_len
    flops = train_flops_per_token(d.hf_config, cfg.data.seq_len, causal=True) * tokens  # what the run's MFU counts
    parts = [
        "== resolved config ==",
        OmegaConf.to_yaml(cfg, resolve=True),
        "== topology ==",
        d.topo.describe(),
        "== parameters ==",
        f"total {counts['total']:,}  (embedding {counts['embedding']:,}, non-embedding {counts['non_embedding']:,})",
        "== batch ==",
        batch_line(cfg, d.topo),
        f"model FLOPs per step {flops:.3e}  ({flops / tokens:.3e} per token; causal attention over the lower triangle)",
        "== host memory per rank (planner, fp32 build) ==",
        host_memory_line(cfg, d),
        "== decisions ==",
        f"{'zero':<10} {zero_line(cfg, d)}",
        *(f"{k:<10} {'on ' if c.on else 'off'} {c.why}" for k, c in d.features().items()),
        "== checked before start ==",
        *(f"{k:<10} {v}" for k, v in found.items()),
        "== DeepSpeed JSON ==",
        json.dumps(ds_config, indent=2),
    ]
    return "\n".join(parts)


def dry_run(cfg: DictConfig, d: Decisions) -> None:
    """Check what a real run would check first (read-only, every rank), then print the report on rank 0."""
    from ultrascale import dist
    from ultrascale.config.deepspeed import build_ds_config
    from ultrascale.train.preflight import preflight

    found = preflight(cfg, d)
    if dist.is_rank0():
        print(dry_run_report(cfg, d, build_ds_config(cfg, d), found.notes))
