"""Turn ranked candidates into what a person reads: a table, the winning override line, JSON and a PNG."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ultrascale.config.convert import plain
from ultrascale.cost.budget import BudgetPlan, Point
from ultrascale.model.arch import Arch
from ultrascale.plan.search import GIB, Candidate

if TYPE_CHECKING:
    from ultrascale.config.root import PlanRootConfig

MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "buffers", "fragmentation", "reserved")
CKPT_TAG = {"none": "", "selective": " sel-ckpt", "full": " ckpt"}
"""How a layout's activation checkpointing reads in its name."""


def _layout_name(c: Candidate) -> str:
    lay = c.layout
    off = "+opt_off" if lay.offload_optimizer else ""
    off += "+par_off" if lay.offload_param else ""
    return (
        f"dp{lay.dp} tp{lay.tp} pp{lay.pp} sp{lay.sp} ep{lay.ep} z{lay.zero_stage}{off} "
        f"mb{lay.micro_batch}{CKPT_TAG[lay.activation_checkpointing]}"
    )


def table(cands: list[Candidate], top_n: int) -> str:
    """The top ``top_n`` fitting layouts with each memory term (GiB), the host memory a rank needs while the
    model is built (``build``), and the time model's outputs."""
    head = (
        f"{'#':>3} {'layout':<38} {'params':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'buffer':>6} "
        f"{'total':>6} {'build':>6} {'step_s':>7} {'tok/s':>9} {'MFU':>5}  bottleneck"
    )
    rows = [head, "-" * len(head)]
    for i, c in enumerate([c for c in cands if c.fits][:top_n], 1):
        m, t = c.memory, c.timing
        act = max(m.step_transient, m.activations + m.activation_peak_extra)
        rows.append(
            f"{i:>3} {_layout_name(c):<38} {m.params / GIB:7.1f} {m.grads / GIB:6.1f} {m.optimizer / GIB:6.1f} "
            f"{act / GIB:6.1f} {m.buffers / GIB:6.1f} {m.total / GIB:6.1f} {c.build_host / GIB:6.1f} {t.step:7.3f} "
            f"{t.tokens_per_s:9.0f} "
            f"{t.mfu:5.1%}  {t.bottleneck}"
        )
    return "\n".join(rows)


def rejection_summary(cands: list[Candidate], limit: int = 6) -> str:
    """The commonest reasons layouts were dropped, so a user sees why a layout they expected is missing."""
    reasons = Counter(c.rejected for c in cands if c.rejected)
    lines = [f"  {n:4d} x {why}" for why, n in reasons.most_common(limit)]
    return "\n".join(lines)


def override_line(cfg: PlanRootConfig, best: Candidate) -> str:
    """A ready command that runs what was planned: the model, the layout, the precision, the sequence length
    and the world (the launcher: one node spawns deepspeed, several go through Slurm)."""
    c = cfg.cluster
    if c.nodes > 1:
        launcher = f"launcher=slurm launcher.nnodes={c.nodes} launcher.nproc_per_node={c.gpus_per_node}"
    else:
        launcher = f"launcher=deepspeed launcher.nproc_per_node={c.gpus_per_node}"
    return (
        f"python train.py model={cfg.model.name} precision={cfg.precision.dtype} "
        + " ".join(best.overrides)
        + f" {launcher}"
    )


def header(cfg: PlanRootConfig, arch: Arch) -> str:
    c = cfg.cluster
    return (
        f"model {cfg.model.name}: {arch.total_params / 1e9:.2f} B params ({arch.expert_params / 1e9:.2f} B in "
        f"experts), seq {cfg.data.seq_len}, global batch {cfg.data.global_batch} | cluster {c.name}: "
        f"{c.nodes}x{c.gpus_per_node} x {c.gpu_memory_gib:g} GiB, {c.peak_tflops:g} TFLOP/s peak"
    )


def write_json(path: str | Path, cfg: PlanRootConfig, arch: Arch, cands: list[Candidate]) -> None:
    """The whole result as JSON: every layout with its terms and rejection reason, the best one, and the
    cluster and search settings that produced them (resolved)."""
    best = next((c for c in cands if c.fits), None)
    doc: dict[str, Any] = {
        "model": {
            "name": cfg.model.name,
            "type": arch.model_type,
            "total_params": arch.total_params,
            "expert_params": arch.expert_params,
            "active_matmul_params": arch.active_matmul_params,
        },
        "cluster": plain(cfg.cluster),
        "search": plain(cfg.search),
        "best": best.as_dict() if best else None,
        "best_command": override_line(cfg, best) if best else None,
        "candidates": [c.as_dict() for c in cands],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))


def plot(path: str | Path, cfg: PlanRootConfig, cands: list[Candidate], top_n: int) -> None:
    """Stacked per-rank memory bars for the top layouts against the GPU limit, predicted tokens/s on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [c for c in cands if c.fits][:top_n]
    if not shown:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(shown) + 2), 5))
    bottoms = [0.0] * len(shown)
    for term in MEMORY_TERMS:
        vals = []
        for c in shown:
            m = c.memory
            v = (
                max(m.step_transient, m.activations + m.activation_peak_extra)
                if term == "activations"
                else getattr(m, term)
            )
            vals.append(v / GIB)
        ax.bar(range(len(shown)), vals, bottom=bottoms, label=term)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.axhline(cfg.cluster.gpu_memory_gib, color="red", linestyle="--", label="GPU limit")
    for i, c in enumerate(shown):
        ax.text(i, bottoms[i] + 0.5, f"{c.timing.tokens_per_s:,.0f}\ntok/s", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([_layout_name(c).replace(" ", "\n", 5) for c in shown], fontsize=6)
    ax.set_ylabel("GiB per rank")
    ax.set_ylim(0, max(cfg.cluster.gpu_memory_gib, max(bottoms)) * 1.45)  # room for labels and legend
    ax.set_title(f"{cfg.model.name} on {cfg.cluster.name}: top {len(shown)} layouts")
    ax.legend(fontsize=7, ncol=4, loc="upper right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _count(x: float) -> str:
    """Three significant figures with a unit: 13.0 B, 619 B, 1.30 T."""
    if x < 1:
        return f"{x:g}"
    unit, scale = next(
        (u, k) for u, k in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0)) if x >= k * 0.9995
    )
    v = x / scale
    return f"{v:.{2 if v < 9.995 else 1 if v < 99.95 else 0}f} {unit}".rstrip()


def budget_table(bp: BudgetPlan) -> str:
    """Chinchilla's point beside the inference-aware ones: sizes, loss, FLOPs and GPU-hours, then the saving."""
    c, pts = bp.costing, (bp.chinchilla, bp.same_loss, bp.same_cost)
    rows: list[tuple[str, Callable[[Point], str]]] = [
        ("params N", lambda p: _count(p.params)),
        ("training tokens D", lambda p: _count(p.train_tokens)),
        ("tokens per param D/N", lambda p: f"{p.tokens_per_param:.1f}"),
        ("loss", lambda p: f"{p.loss:.4f}"),
        ("training FLOPs", lambda p: f"{p.train_flops:.3e}"),
        ("inference FLOPs", lambda p: f"{p.inference_flops:.3e}"),
        ("total FLOPs", lambda p: f"{p.total_flops:.3e}"),
        ("training GPU-hours", lambda p: f"{c.train_gpu_hours(p):,.0f}"),
        ("inference GPU-hours", lambda p: f"{c.inference_gpu_hours(p):,.0f}"),
        ("total GPU-hours", lambda p: f"{c.gpu_hours(p):,.0f}"),
    ]
    if c.usd_per_gpu_hour is not None:
        rows.append(
            (f"total $ at ${c.usd_per_gpu_hour:g}/GPU-h", lambda p: f"${c.gpu_hours(p) * c.usd_per_gpu_hour:,.0f}")
        )
    best = bp.same_loss
    lines = [
        f"inference-aware sizing (Sardana et al. 2024), fit {bp.law.describe()}",
        f"loss bar: {bp.bar}; {_count(best.inference_tokens)} tokens served",
        f"GPU-hours at {c.peak_flops / 1e12:g} TFLOP/s peak, MFU {c.train_mfu:.0%} training / "
        f"{c.inference_mfu:.0%} serving",
        "",
        f"{'':<28}{'Chinchilla':>16}{'inference-aware':>18}{'inference-aware':>18}",
        f"{'':<28}{'compute-optimal':>16}{'same loss':>18}{'same total cost':>18}",
    ]
    lines += [f"{name:<28}{f(pts[0]):>16}{f(pts[1]):>18}{f(pts[2]):>18}" for name, f in rows]
    if best.inference_tokens == 0:
        lines += ["", "no tokens served: the Chinchilla point is already the cheapest (budget.inference_tokens=...)"]
        return "\n".join(lines)
    lines += [
        "",
        f"suggestion: {_count(best.params)} params on {_count(best.train_tokens)} tokens "
        f"({best.tokens_per_param:.0f} tokens/param) reaches the Chinchilla loss for {bp.saving:.1%} less total "
        f"cost (GPU-hours; {1 - best.total_flops / bp.chinchilla.total_flops:.1%} fewer FLOPs)",
    ]
    return "\n".join(lines)


def write_budget_json(path: str | Path, bp: BudgetPlan) -> None:
    """The budget table as numbers: each point with its FLOPs and GPU-hours, the fit and the costing."""
    import dataclasses

    c = bp.costing

    def point(p: Point) -> dict[str, float]:
        return {**dataclasses.asdict(p), "tokens_per_param": p.tokens_per_param, "train_flops": p.train_flops,
                "inference_flops": p.inference_flops, "total_flops": p.total_flops,
                "train_gpu_hours": c.train_gpu_hours(p), "inference_gpu_hours": c.inference_gpu_hours(p),
                "total_gpu_hours": c.gpu_hours(p)}  # fmt: skip

    doc = {
        "law": dataclasses.asdict(bp.law),
        "costing": dataclasses.asdict(c),
        "bar": bp.bar,
        "chinchilla": point(bp.chinchilla),
        "same_loss": point(bp.same_loss),
        "same_cost": point(bp.same_cost),
        "saving": bp.saving,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))


def checkpoint_advice(cfg: PlanRootConfig, arch: Arch, best: Candidate) -> str:
    """How often the best layout should checkpoint (Young/Daly), from the checkpoint's size and the cluster's
    storage rate and node MTBF."""
    from ultrascale.cost.memory import DTYPE_BYTES
    from ultrascale.cost.save_interval import advise, checkpoint_bytes

    c, lay = cfg.cluster, best.layout
    total = checkpoint_bytes(arch.total_params, DTYPE_BYTES[lay.dtype], lay.zero_stage)
    adv = advise(total / c.nodes, total / lay.world, best.timing.step, c.nodes, c.node_mtbf_hours,
                 c.storage_write_gbps, c.host_link_gbps, background=bool(cfg.train.checkpoint_async))  # fmt: skip
    how = "background writer (train.checkpoint_async)" if cfg.train.checkpoint_async else "synchronous save"
    return (
        f"checkpointing ({how}; cluster.node_mtbf_hours={c.node_mtbf_hours:g}, "
        f"cluster.storage_write_gbps={c.storage_write_gbps:g}):\n  " + adv.describe().replace("\n", "\n  ")
    )
