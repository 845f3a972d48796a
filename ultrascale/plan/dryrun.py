"""``train.py dry_run=true``: everything needed to sanity-check a run before booking the machines, computed
without building a weight: the resolved config, the topology, parameters and FLOPs, the planner's host-memory
figures for this layout, every decision with its reason, what preflight found, and the DeepSpeed JSON.

It lives with the planner because it is the planner's view of one composed layout; the training path
(``ultrascale.train``) never imports the planner.
"""

from __future__ import annotations

import json
from pathlib import Path
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


def checkpoint_line(cfg: Any, d: Decisions) -> str:
    """The suggested checkpoint interval (Young/Daly) for this layout: from the run's own measured saves and
    steps when its output_dir has them, else from the planner's step time and checkpoint size on the default
    cluster (``plan.py``'s ``cluster`` group: node MTBF, storage rate) at this launcher's node count."""
    from ultrascale.config.compose import resolve_path
    from ultrascale.config.schema import ClusterConfig, SearchConfig
    from ultrascale.plan.checkpointing import advise, checkpoint_bytes
    from ultrascale.plan.memory import DTYPE_BYTES
    from ultrascale.plan.timing import step_time

    c = ClusterConfig(nodes=cfg.launcher.nnodes, gpus_per_node=cfg.launcher.nproc_per_node)
    arch, lay = arch_from_hf(d.hf_config), decided(layout_from_cfg(cfg, d.topo.world), d)
    total = checkpoint_bytes(arch.total_params, DTYPE_BYTES[lay.dtype], lay.zero_stage)
    background = bool(cfg.train.checkpoint_async)
    measured = _measured_saves(resolve_path(cfg.output_dir) / "metrics.jsonl")
    s = SearchConfig()
    step_s = measured["step_s"] if measured else step_time(arch, lay, c, overlap=s.overlap,
                                                           recompute_overhead=s.recompute_overhead).step  # fmt: skip
    adv = advise(total / c.nodes, total / lay.world, step_s, c.nodes, c.node_mtbf_hours, c.storage_write_gbps,
                 c.host_link_gbps, background)  # fmt: skip
    if measured:  # the run's own stall and write times replace the estimates
        from dataclasses import replace

        from ultrascale.plan.checkpointing import lost_share, young_daly

        mtbf_s = adv.mtbf_h * 3600
        interval = max(young_daly(measured["stall_s"], mtbf_s), measured["write_s"], step_s)
        steps = max(1, round(interval / step_s))
        save, rework = lost_share(steps * step_s, measured["stall_s"], mtbf_s, measured["write_s"])
        adv = replace(adv, stall_s=measured["stall_s"], write_s=measured["write_s"], interval_s=steps * step_s,
                      interval_steps=steps, save_share=save, rework_share=rework)  # fmt: skip
    src = (f"measured in {cfg.output_dir}/metrics.jsonl" if measured else
           f"planner estimate for {c.name} x {c.nodes} node(s): python plan.py ... cluster.node_mtbf_hours=H "
           "cluster.storage_write_gbps=G to change")  # fmt: skip
    return adv.describe(cfg.train.checkpoint_interval or None) + f"\n({src})"


def _measured_saves(metrics: Path) -> dict | None:
    """Median step time, checkpoint stall and background write time of an existing run, if it has saved."""
    import statistics

    if not metrics.is_file():
        return None
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    steps = [r["step_s"] for r in rows if "event" not in r and r.get("step_s")]
    stalls = [r["checkpoint_s"] for r in rows if r.get("event") == "checkpoint" and r.get("checkpoint_s")]
    writes = [r["write_s"] for r in rows if r.get("event") == "checkpoint_written" and r.get("write_s")]
    if not steps or not stalls:
        return None
    stall = statistics.median(stalls)
    return {"step_s": statistics.median(steps), "stall_s": stall, "write_s": statistics.median(writes or [stall])}


def mixture_lines(cfg: DictConfig) -> list[str]:
    """The mixture and the tokens each source gives over ``train.steps`` (nothing for one source)."""
    from ultrascale.data.sources import is_mixture, stage_table, tokens_per_source

    if not is_mixture(cfg.data):
        return []
    steps = int(cfg.train.steps)
    per = tokens_per_source(cfg.data, steps)
    total = max(sum(per.values()), 1)
    return ["== data mixture ==", *stage_table(cfg.data, steps),
            *(f"{n:<10} {t:,} tokens over {steps} steps ({t / total:.1%})" for n, t in per.items())]  # fmt: skip


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
        *mixture_lines(cfg),
        "== host memory per rank (planner, fp32 build) ==",
        host_memory_line(cfg, d),
        "== checkpointing ==",
        checkpoint_line(cfg, d),
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
