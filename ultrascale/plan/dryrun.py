"""``train.py dry_run=true``: everything needed to sanity-check a run before booking the machines, computed
without building a weight: the resolved config, the topology, parameters and FLOPs, the planner's memory
figures for this layout, every decision with its reason, what preflight found, and the DeepSpeed JSON.

It speaks for the hardware the run is for, not the box it is typed on. A recipe's ``cluster`` (``cluster=h100_8x``;
every GPU recipe names its own) makes it decide as the cluster's ranks will (``nccl``, the card's
:class:`~ultrascale.runtime.gpu.GpuInfo`: attention and loss kernels, activation checkpointing) and add the planner's HBM
per GPU and predicted step time and MFU, with a line saying what this machine is instead. Without a cluster it
describes this machine, as a CPU recipe wants.

It lives with the planner because it is the planner's view of one composed layout; the training path
(``ultrascale.train``) never imports the planner.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from ultrascale.cost.memory import (
    GIB,
    Layout,
    Memory,
    checkpoint_staging_bytes,
    construction_bytes,
    host_step_bytes,
    memory,
)
from ultrascale.cost.timing import Timing
from ultrascale.errors import ConfigError
from ultrascale.levers.decide import Decisions
from ultrascale.levers.length import describe as run_length
from ultrascale.model.arch import arch_from_hf
from ultrascale.plan.search import decided, layout_from_cfg, plain_node
from ultrascale.runtime.gpu import GpuInfo
from ultrascale.train.banner import batch_line, zero_line

if TYPE_CHECKING:
    from ultrascale.config.cluster import ClusterConfig
    from ultrascale.config.precision import PrecisionConfig
    from ultrascale.config.root import RootConfig


@dataclass(frozen=True)
class Target:
    """The hardware a dry run speaks for: a planned GPU cluster, or (``cluster`` None) this machine."""

    world: int
    cluster: ClusterConfig | None = None
    """The recipe's ``cluster`` group as a plain ``ClusterConfig``, its ``nodes`` and ``gpus_per_node`` the
    launcher's (``launcher.nnodes`` x ``launcher.nproc_per_node``): the preset says what a node is, the launcher
    how many of them the run takes."""
    gpu: GpuInfo | None = None
    """The cluster's card (:meth:`GpuInfo.from_cluster`); None for this machine (validate detects its own)."""

    @property
    def backend(self) -> str | None:
        """``nccl`` for a GPU cluster; None: this machine's (``validate`` detects it)."""
        return "nccl" if self.cluster is not None else None


def target(cfg: RootConfig) -> Target:
    """The recipe's cluster where it names one with a GPU card, else this machine. Raises ConfigError for a
    launcher that asks a node for more GPUs than the cluster's nodes have, or a card the datasheet table lacks."""
    from ultrascale.runtime.dist import planned_world_size

    world = planned_world_size(cfg)
    c = cfg.cluster
    if c is None or not c.card:  # no cluster, or CPU ranks (cluster=cpu_local): this machine
        return Target(world)
    gpn = min(int(cfg.launcher.nproc_per_node), world)
    if gpn > c.gpus_per_node:
        raise ConfigError(
            f"launcher.nproc_per_node={gpn} but cluster={c.name} has {c.gpus_per_node} GPUs per node: lower "
            f"launcher.nproc_per_node, raise cluster.gpus_per_node, or pick another cluster"
        )
    plain = replace(plain_node(c), nodes=-(-world // gpn), gpus_per_node=gpn)
    try:
        gpu = GpuInfo.from_cluster(plain, str(c.card))
    except ValueError as e:
        raise ConfigError(f"cluster.card={c.card!r} (cluster={c.name}): {e}") from None
    return Target(world, plain, replace(gpu, count=gpn))


def this_machine() -> str:
    """This machine in one line: its GPU, or its CPU when it has no CUDA device."""
    from ultrascale.runtime import gpu
    from ultrascale.runtime.cpu import detect

    here = gpu.detect()
    return here.describe() if here is not None else f"{detect().describe()}, no CUDA device"


def target_lines(d: Decisions, t: Target) -> list[str]:
    """Whose decisions these are: the planned cluster and its card (and that this machine is not it), or this
    machine's CPU or GPU."""
    if t.cluster is None:
        from ultrascale.runtime.dist import detect_backend

        what = d.gpu.describe() if d.gpu is not None else this_machine()
        return [f"this machine: {what}; {d.topo.world} rank(s), {detect_backend()} (no cluster= given: the "
                "decisions are this machine's; cluster=h100_8x plans for one)"]  # fmt: skip
    from ultrascale.runtime import gpu

    c, here = t.cluster, gpu.detect()
    card = t.gpu.identified().card
    same = here is not None and card is not None and here.identified().card == card
    one = replace(t.gpu, count=1).describe()
    verdict = ("this machine has the cluster's card" if same else
               "this machine is not that cluster: every decision, memory figure and time below is planned for the "
               "cluster's card (GpuInfo.from_cluster), not measured")  # fmt: skip
    return [f"cluster {c.name}: {c.nodes} node(s) x {c.gpus_per_node} GPUs, each {one}; nccl",
            f"{verdict}; this machine: {this_machine()}"]  # fmt: skip


def planned_layout(cfg: RootConfig, d: Decisions) -> Layout:
    """The layout the run takes as the planner counts it: the config's knobs with what :class:`Decisions`
    settled (ZeRO stage, fused loss and its chunk, activation checkpointing)."""
    return decided(layout_from_cfg(cfg, d.topo.world), d)


def plan_memory(cfg: RootConfig, d: Decisions, t: Target) -> Memory:
    """Bytes per GPU of this layout (:func:`ultrascale.cost.memory.memory`), with the planner's fragmentation
    headroom and the cluster's runtime reserve."""
    from ultrascale.config.search import SearchConfig

    reserved = float(t.cluster.reserved_gib) * GIB if t.cluster is not None else 0.0
    return memory(arch_from_hf(d.hf_config), planned_layout(cfg, d), SearchConfig().fragmentation, reserved)


def plan_timing(cfg: RootConfig, d: Decisions, t: Target) -> Timing:
    """One optimizer step of this layout on the cluster (:func:`ultrascale.cost.timing.step_time`)."""
    from ultrascale.config.search import SearchConfig
    from ultrascale.cost.timing import step_time

    s = SearchConfig()
    return step_time(arch_from_hf(d.hf_config), planned_layout(cfg, d), t.cluster, overlap=s.overlap,
                     recompute_overhead=s.recompute_overhead)  # fmt: skip


def hbm_line(cfg: RootConfig, d: Decisions, t: Target) -> str:
    """The planner's peak HBM per GPU, by term, against the card's memory."""
    m = plan_memory(cfg, d, t)
    cap = t.gpu.memory_bytes if t.gpu is not None else d.gpu.memory_bytes
    act = m.activations + m.activation_peak_extra
    work = (f"activations {act / GIB:.1f} (saved {m.activations / GIB:.1f}, peak extra "
            f"{m.activation_peak_extra / GIB:.1f})" if act >= m.step_transient else
            f"optimizer-step transient {m.step_transient / GIB:.1f}")  # fmt: skip
    reserve = f" + runtime reserve {m.reserved / GIB:.1f}" if m.reserved else ""
    verdict = (f"fits, {(cap - m.total) / GIB:.1f} GiB to spare" if m.total <= cap else
               f"DOES NOT FIT by {(m.total - cap) / GIB:.1f} GiB: `python plan.py` with this model and cluster "
               "lists layouts that do")  # fmt: skip
    lines = [f"model states {m.model_states / GIB:.1f} (params {m.params / GIB:.1f}, grads {m.grads / GIB:.1f}, "
             f"optimizer {m.optimizer / GIB:.1f}) + {work} + buffers {m.buffers / GIB:.1f} + fragmentation "
             f"{m.fragmentation / GIB:.1f}{reserve} = {m.total / GIB:.1f} GiB per GPU of {cap / GIB:.1f} GiB: "
             f"{verdict}"]  # fmt: skip
    if t.cluster is not None:
        lines += host_lines(cfg, d, m, t.cluster.gpus_per_node, t.cluster.host_memory_gib)
    return "\n".join(lines)


def host_lines(cfg: RootConfig, d: Decisions, m: Memory, gpus_per_node: int, host_gib: float) -> list[str]:
    """Host memory per node at steady state: offloaded state plus the background checkpoint writer's staging copy
    (:func:`ultrascale.cost.memory.checkpoint_staging_bytes`), against the node's RAM."""
    staging = checkpoint_staging_bytes(arch_from_hf(d.hf_config), planned_layout(cfg, d)) \
        if cfg.train.checkpoint_async else 0.0  # fmt: skip
    if not m.host and not staging:
        return []
    node = (m.host + staging) * gpus_per_node
    room = "fits" if node <= host_gib * GIB else "DOES NOT FIT"
    parts = [f"offloaded state {m.host / GIB:.1f}"] if m.host else []
    if staging:
        parts.append(f"the background checkpoint writer's copy {staging / GIB:.1f} (train.checkpoint_async; "
                     "false: no copy, each save stalls for its write)")  # fmt: skip
    return [f"host memory: {' + '.join(parts)} = {(m.host + staging) / GIB:.1f} GiB per GPU, {node / GIB:.0f} GiB "
            f"per node of {host_gib:g} GiB: {room}"]  # fmt: skip


TIMING_TERMS = (
    ("compute", "compute"),
    ("dp_exposed", "ZeRO/DP exposed"),
    ("tp_comm", "TP"),
    ("sp_comm", "SP"),
    ("ep_comm", "EP"),
    ("pp_p2p", "PP sends"),
    ("pp_bubble", "PP bubble"),
    ("offload", "offload"),
)
"""The step's terms as :class:`~ultrascale.cost.timing.Timing` sums them, in words."""


def step_line(cfg: RootConfig, d: Decisions, t: Target) -> str:
    """The planner's predicted step time, throughput and MFU on the cluster. MFU divides by the card's datasheet
    peak for the run's matmul dtype (``ultrascale.runtime.peak.gpu_peak``), the figure the run's own MFU divides by."""
    import torch

    from ultrascale.runtime.peak import gpu_peak, matmul_dtype

    tm, c = plan_timing(cfg, d, t), t.cluster
    parts = {**{k: getattr(tm, k) for k, _ in TIMING_TERMS}, "compute": tm.compute + tm.recompute}
    terms = [f"{name} {parts[k]:.3g} s" for k, name in TIMING_TERMS if parts[k] > 0]
    if tm.recompute:
        terms[0] += f" (of which recompute {tm.recompute:.3g} s)"
    column = matmul_dtype(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.precision.dtype,
                                                                                     "float32")),
                          torch.backends.cuda.matmul.allow_tf32)  # fmt: skip
    peak, src = gpu_peak(t.gpu, column)
    flops = tm.mfu * tm.step * t.world * c.peak_tflops * 1e12  # the step's model FLOPs, as the planner counts them
    mfu = f"MFU {flops / (tm.step * t.world * peak):.1%} of {src.split(' (')[0]}" if peak else src
    return (
        f"step {tm.step:.3g} s = {' + '.join(terms)}; bottleneck {tm.bottleneck}\n"
        f"{tm.tokens_per_s:,.0f} tokens/s ({tm.tokens_per_s / t.world:,.0f} per GPU); {mfu}\n"
        f"(cluster {c.name}: matmuls at {c.matmul_efficiency:g} x {c.peak_tflops:g} TFLOP/s, "
        f"{c.intra_node_gbps:g}/{c.inter_node_gbps:g} GB/s inside/across nodes; cluster.* to change)"
    )


def host_memory_line(cfg: RootConfig, d: Decisions, on_gpu: bool = False) -> str:
    """The planner's host-memory figures for this layout: what building the model costs beside the steady state
    (which, on GPUs, is the HBM section's)."""
    arch, lay = arch_from_hf(d.hf_config), planned_layout(cfg, d)
    build = construction_bytes(arch, lay) / GIB
    how = ("partitioned from the first byte (ZeRO-3)" if d.zero3_init.value == "all" else
           f"the routed experts partitioned over the {d.topo.world} ranks, the rest whole as ZeRO-{d.zero_stage} holds "
           "it; AutoEP then gathers one layer's experts at a time" if d.zero3_init.value == "experts" else
           "this stage's layers only" if d.pipeline else
           "the whole model: DeepSpeed 0.19.8's AutoTP shards it inside initialize(); measured 1.95 GiB per rank "
           "for a 0.51B model at tp=2, make bench-scale" if d.topo.tp > 1 else
           "the whole model")  # fmt: skip
    if on_gpu:
        return f"construction peak ~{build:.2f} GiB ({how}) of host memory per rank while the model is built"
    return (f"construction peak ~{build:.2f} GiB ({how}); model states between steps on a CPU rank "
            f"~{host_step_bytes(arch, lay) / GIB:.2f} GiB")  # fmt: skip


def checkpoint_line(cfg: RootConfig, d: Decisions, cluster: ClusterConfig | None = None) -> str:
    """The suggested checkpoint interval (Young/Daly) for this layout: from the run's own measured saves and
    steps when its output_dir has them (:func:`ultrascale.cost.save_interval.from_saves`, what
    ``train.checkpoint_interval=auto`` runs on its first save), else from the planner's step time and checkpoint
    size on ``cluster`` (the dry run's target: storage rate), or without one the default cluster at this
    launcher's node count; the node MTBF is ``train.node_mtbf_hours``, else the cluster's."""
    from ultrascale.config.cluster import ClusterConfig
    from ultrascale.config.search import SearchConfig
    from ultrascale.config.train import AUTO
    from ultrascale.cost.memory import DTYPE_BYTES
    from ultrascale.cost.save_interval import AUTO_FIRST_SAVE_STEP, advise, checkpoint_bytes, from_saves, node_mtbf
    from ultrascale.cost.timing import step_time
    from ultrascale.paths import resolve_path

    c = cluster or ClusterConfig(nodes=cfg.launcher.nnodes, gpus_per_node=cfg.launcher.nproc_per_node)
    mtbf_h, mtbf_from = node_mtbf(cfg.train.node_mtbf_hours, cluster)
    arch, lay = arch_from_hf(d.hf_config), planned_layout(cfg, d)
    total = checkpoint_bytes(arch.total_params, DTYPE_BYTES[lay.dtype], lay.zero_stage)
    measured = _measured_saves(resolve_path(cfg.output_dir) / "metrics.jsonl")
    if measured:  # the run's own step, stall and write times replace the estimates
        adv = from_saves(total / c.nodes, measured["stall_s"], measured["write_s"], measured["step_s"], c.nodes,
                         mtbf_h)  # fmt: skip
    else:
        s = SearchConfig()
        step_s = step_time(arch, lay, c, overlap=s.overlap, recompute_overhead=s.recompute_overhead).step
        adv = advise(total / c.nodes, total / lay.world, step_s, c.nodes, mtbf_h, c.storage_write_gbps,
                     c.host_link_gbps, bool(cfg.train.checkpoint_async))  # fmt: skip
    src = (f"measured in {cfg.output_dir}/metrics.jsonl" if measured else
           f"planner estimate for {c.name} x {c.nodes} node(s): python plan.py ... cluster.storage_write_gbps=G "
           "to change")  # fmt: skip
    every = cfg.train.checkpoint_interval
    auto = (f"\ntrain.checkpoint_interval=auto: the run measures its save after step {AUTO_FIRST_SAVE_STEP} and "
            "takes the interval from it, as above" if every == AUTO else "")  # fmt: skip
    return (adv.describe(every if every != AUTO and every else None) + auto
            + f"\n({src}; node MTBF {mtbf_h:g} h: {mtbf_from})")  # fmt: skip


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


def mixture_lines(cfg: RootConfig) -> list[str]:
    """The mixture and the tokens each source gives over ``train.steps`` (nothing for one source)."""
    from ultrascale.data.sources import is_mixture, stage_table, tokens_per_source

    if not is_mixture(cfg.data):
        return []
    steps = int(cfg.train.steps)
    per = tokens_per_source(cfg.data, steps)
    total = max(sum(per.values()), 1)
    return ["== data mixture ==", *stage_table(cfg.data, steps),
            *(f"{n:<10} {t:,} tokens over {steps} steps ({t / total:.1%})" for n, t in per.items())]  # fmt: skip


def finetune_lines(cfg: RootConfig, d: Decisions) -> list[str]:
    """``finetune=lora``: the adapters' trainable parameters against the total and the memory they save."""
    if not d.finetune.on:
        return []
    from ultrascale.model.adapters import planned_params
    from ultrascale.train.banner import finetune_line

    return [finetune_line(cfg, d, *planned_params(d.hf_config, cfg.finetune))]


def dry_run_report(
    cfg: RootConfig, d: Decisions, ds_config: dict, found: dict[str, str], t: Target | None = None
) -> str:
    """The report, as text (rank 0 prints it). ``t``: the hardware ``d`` was decided for (default: this
    machine). The report opens with ``cfg``'s resolved YAML."""
    from ultrascale.model.build import count_params
    from ultrascale.model.flops import train_flops_per_token
    from ultrascale.plan.evidence import evidence_lines
    from ultrascale.plan.grpo import grpo_lines

    t = t or Target(d.topo.world)
    counts = count_params(cfg.model)
    tokens = cfg.data.global_batch * cfg.data.seq_len
    flops = train_flops_per_token(d.hf_config, cfg.data.seq_len, causal=True) * tokens  # what the run's MFU counts
    on_gpu = d.gpu is not None
    gpu_parts = []
    if on_gpu:
        gpu_parts = ["== HBM per GPU (planner: ultrascale/cost/memory.py) ==", hbm_line(cfg, d, t)]
    if t.cluster is not None:
        gpu_parts += [f"== predicted step on {t.cluster.name} (planner: ultrascale/cost/timing.py) ==",
                      step_line(cfg, d, t)]  # fmt: skip
    parts = [
        "== resolved config ==",
        OmegaConf.to_yaml(cfg, resolve=True),  # a composed DictConfig or a RootConfig dataclass alike
        "== target ==",
        *target_lines(d, t),
        "== topology ==",
        d.topo.describe(),
        "== parameters ==",
        f"total {counts['total']:,}  (embedding {counts['embedding']:,}, non-embedding {counts['non_embedding']:,})",
        *finetune_lines(cfg, d),
        "== batch ==",
        batch_line(cfg.data, d.topo),
        f"length {run_length(cfg)}",
        f"model FLOPs per step {flops:.3e}  ({flops / tokens:.3e} per token; causal attention over the lower triangle)",
        *mixture_lines(cfg),
        f"== host memory per rank (planner, {'build' if on_gpu else 'fp32 build'}) ==",
        host_memory_line(cfg, d, on_gpu),
        *gpu_parts,
        *grpo_lines(cfg, d, t, planned_layout(cfg, d)),
        "== checkpointing ==",
        checkpoint_line(cfg, d, t.cluster),
        "== settled by ablation (ultrascale/plan/evidence.py) ==",
        *evidence_lines(cfg),
        "== decisions ==",
        f"{'zero':<10} {zero_line(cfg.zero, d)}",
        f"{'precision':<10} {precision_line(cfg.precision, d)}",
        *(f"{k:<10} {'on ' if c.on else 'off'} {c.why}" for k, c in d.features().items()),
        "== checked before start ==",
        *(f"{k:<10} {v}" for k, v in found.items()),
        "== DeepSpeed JSON ==",
        json.dumps(ds_config, indent=2),
    ]
    return "\n".join(parts)


def precision_line(precision: PrecisionConfig, d: Decisions) -> str:
    """The weights' dtype and, on a GPU, the tensor-core rate its matmuls run at on this card."""
    dtype = str(precision.dtype)
    if d.gpu is None:
        return f"{dtype} weights on the CPU" + (f", autocast {precision.autocast}"
                                                 if precision.autocast != "none" else "")  # fmt: skip
    card = d.gpu.identified().card
    rate = card.tflops.get(dtype) if card is not None else None
    if dtype == "fp32":
        return f"fp32 weights on {d.gpu.name}: plain fp32 (or TF32 where torch allows it) matmuls"
    if rate is None:
        return f"{dtype} on {d.gpu.name}: no {dtype} tensor-core figure for this card in ultrascale.runtime.gpu.CARDS"
    return f"{dtype} weights and matmuls on {card.name}'s tensor cores ({rate:g} TFLOP/s dense, datasheet)"


def data_note(cfg: RootConfig, found: dict[str, str], t: Target) -> dict[str, str]:
    """``found`` with the data line qualified for a cluster: the built-in stdlib corpus a real run would
    prepare on first use is a CPU demo corpus, not one for this model on that cluster."""
    from ultrascale.data.prepare import is_builtin_corpus
    from ultrascale.data.sources import sources

    if t.cluster is None or not any(is_builtin_corpus(s.path) for s in sources(cfg.data)):
        return found
    return {**found, "data": found["data"] + f" (the built-in stdlib corpus is a CPU demo corpus: for "
                                             f"{cfg.model.name} on {t.cluster.name} set data.path to a data_prep "
                                             "output)"}  # fmt: skip


def dry_run_text(cfg: RootConfig) -> str:
    """Validate for the target hardware (:func:`target`), check what a real run would check first (read-only:
    nothing is prepared or written), and return the report."""
    from ultrascale.levers.deepspeed import build_ds_config
    from ultrascale.levers.rules import validate
    from ultrascale.train.preflight import preflight

    t = target(cfg)
    d = validate(cfg, t.world, backend=t.backend, gpu=t.gpu)
    found = data_note(cfg, preflight(cfg, d).notes, t)
    return dry_run_report(cfg, d, build_ds_config(cfg, d), found, t)


def dry_run(cfg: RootConfig) -> None:
    """The report, printed on rank 0; every rank runs the read-only checks."""
    from ultrascale.runtime import dist

    text = dry_run_text(cfg)
    if dist.is_rank0():
        print(text)
