"""``report.png``: the comb, for people who would rather look than read.

Top: every logged step as a stacked bar of its parts in seconds (compute in blues, stalls in warm colours),
in file order, with checkpoints and evals as their own hatched bars where they happened, so the gaps between
the teeth are where they really were; bars taller than the step-time scale are clipped and labelled. Below:
the same steps as shares of step time with the largest stall's window shaded, then tokens/s with MFU,
memory, and loss, each with the run's events marked. Several runs go side by side with shared y axes.
"""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path

from ultrascale.atomic import atomic_write_bytes
from ultrascale.report.analyze import LABELS, Analysis, Tick

COLORS = {
    "fwd_s": "#1f77b4",
    "bwd_s": "#6baed6",
    "data_wait_s": "#d62728",
    "comm_s": "#ff7f0e",
    "opt_s": "#9467bd",
    "other_s": "#8c8c8c",
    "checkpoint": "#2ca02c",
    "eval": "#17becf",
}
# Stack order: compute at the bottom so the teeth line up, stalls on top where the eye finds them.
STACK = ("fwd_s", "bwd_s", "comm_s", "opt_s", "data_wait_s", "other_s")
EVENT_STYLE = {
    "checkpoint": dict(color="#2ca02c", ls=":", lw=1.0),
    "eval": dict(color="#17becf", ls="--", lw=1.0),
    "skip": dict(color="#ff7f0e", ls="-", lw=1.2),
    "lr_cut": dict(color="#9467bd", ls="-.", lw=1.2),
    "rollback": dict(color="#d62728", ls="-", lw=2.0),
    "resume": dict(color="#555555", ls="--", lw=1.5),
    "stop": dict(color="black", ls="-", lw=2.0),
}
_BARS_UP_TO = 300  # more slots than this are drawn as filled stairs (one artist per part, not one per bar)
_ROWS = 5


def _p95(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(0.95 * len(v)))] if v else 1.0


def _xticks(ax, steps: list[Tick]) -> None:
    if not steps:
        return
    k = max(1, math.ceil(len(steps) / 8))
    chosen = steps[::k]
    ax.set_xticks([t.pos for t in chosen], [str(t.step) for t in chosen])


def _stack(ax, a: Analysis, values, n_slots: int) -> None:
    """Stacked parts at their comb slots: bars when few, filled stairs when many."""
    steps = [t for t in a.comb if t.kind == "step"]
    bottom = {t.pos: 0.0 for t in steps}
    for p in STACK:
        if p not in a.parts:
            continue
        vals = {t.pos: values(t, p) for t in steps}
        if n_slots <= _BARS_UP_TO:
            xs = list(vals)
            ax.bar(
                xs,
                [vals[x] for x in xs],
                bottom=[bottom[x] for x in xs],
                width=0.8,
                color=COLORS[p],
                label=LABELS[p],
                linewidth=0,
            )
        else:
            lo, hi = [0.0] * n_slots, [0.0] * n_slots
            for x, v in vals.items():
                lo[int(x)], hi[int(x)] = bottom[x], bottom[x] + v
            ax.stairs(
                hi, [i - 0.5 for i in range(n_slots + 1)], baseline=lo, fill=True, color=COLORS[p], label=LABELS[p]
            )
        for x, v in vals.items():
            bottom[x] += v


def _markers(ax, a: Analysis, by_step: bool, seen: set[str]) -> None:
    """Vertical lines for events: at their comb slot (file order) or at their step (curve panels)."""
    for t in a.comb:
        if t.kind == "step" or (not by_step and t.kind in ("checkpoint", "eval")):
            continue
        label = t.kind.replace("_", " ") if t.kind not in seen else None
        seen.add(t.kind)
        ax.axvline(t.step if by_step else t.pos, alpha=0.8, label=label, **EVENT_STYLE.get(t.kind, {}))


def _comb_panel(ax, a: Analysis, cap: float) -> None:
    n_slots = int(max((t.pos for t in a.comb), default=0)) + 1
    _stack(ax, a, lambda t, p: min(t.parts[p], cap), n_slots)
    for kind in ("checkpoint", "eval"):
        ticks = [t for t in a.comb if t.kind == kind]
        if ticks:
            ax.bar(
                [t.pos for t in ticks],
                [min(t.seconds, cap) for t in ticks],
                width=0.8,
                color=COLORS[kind],
                hatch="//",
                edgecolor="white",
                linewidth=0,
                label=LABELS[kind],
            )
    for t in a.comb:
        if t.seconds > cap and t.kind in ("step", "checkpoint", "eval"):
            ax.annotate(f"{t.seconds:.1f} s", (t.pos, cap), ha="center", va="bottom", fontsize=7, rotation=90)
    _markers(ax, a, by_step=False, seen={"checkpoint", "eval"})
    ax.set_ylim(0, cap * 1.15)
    ax.set_ylabel("seconds")
    ax.set_title("the comb: each logged step's parts, checkpoints and evals (file order)", fontsize=9)
    _xticks(ax, [t for t in a.comb if t.kind == "step"])


def _share_panel(ax, a: Analysis) -> None:
    n_slots = int(max((t.pos for t in a.comb), default=0)) + 1
    _stack(ax, a, lambda t, p: t.parts[p] / t.seconds, n_slots)
    s = a.largest
    if s is not None and s.window is not None and s.window.kind != "throughout":
        lo, hi = s.window.pos
        ax.axvspan(lo - 0.5, hi + 0.5, color=COLORS.get(s.key, "k"), alpha=0.12, lw=0)
        ax.annotate(f"{s.label}: {s.window.phrase()}", ((lo + hi) / 2, 1.02), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("share of step time")
    ax.set_title("shares of step time (gaps = checkpoints, evals)", fontsize=9)
    _xticks(ax, [t for t in a.comb if t.kind == "step"])


def _curve(ax, a: Analysis, key: str, scale: float = 1.0, **kw):
    pts = [(r["step"], r[key] * scale) for r in a.run.curve() if isinstance(r.get(key), int | float)]
    if pts:
        ax.plot(*zip(*pts), **kw)
    return pts


def plot(analyses: list[Analysis], out_path: Path, title: str = "") -> Path:
    """Draw the report figure for one or more runs; written atomically so a reader never sees half a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncol = len(analyses)
    fig, axes = plt.subplots(
        _ROWS,
        ncol,
        figsize=(8 * ncol, 17),
        sharey="row",
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2, 2, 1.5, 2.5]},
    )
    steps_s = [t.seconds for a in analyses for t in a.comb if t.kind == "step"]
    cap = 3 * _p95(steps_s) if steps_s else 1.0
    cap = min(cap, max([t.seconds for a in analyses for t in a.comb] + [1e-9]))
    mfu_axes = []
    for c, a in enumerate(analyses):
        col = axes[:, c]
        _comb_panel(col[0], a, cap)
        _share_panel(col[1], a)

        ax = col[2]
        _curve(ax, a, "tokens_per_s", color="C0", lw=1.2, label="tokens/s")
        ax.set_ylabel("tokens/s")
        if any("mfu" in r for r in a.run.step_rows):
            tw = ax.twinx()
            _curve(tw, a, "mfu", 100.0, color="C3", lw=0.9, alpha=0.8, label="MFU")
            tw.set_ylabel("MFU %", color="C3")
            mfu_axes.append(tw)
        ax.set_title("throughput (MFU in red)", fontsize=9)

        ax = col[3]
        _curve(ax, a, "mem_gb", color="C2", lw=1.2)
        ax.set_ylabel("memory GiB")
        ax.set_title("memory per rank", fontsize=9)

        ax = col[4]
        _curve(ax, a, "loss", color="C0", lw=1.1, label="train loss")
        ev = [(e["step"], e["eval_loss"]) for e in a.evals if isinstance(e.get("eval_loss"), int | float)]
        if ev:
            ax.plot(*zip(*ev), "o-", color="C1", lw=1.4, label="eval loss")
        skips = [
            (t.step, t.row["loss"])
            for t in a.comb
            if t.kind == "skip" and isinstance(t.row.get("loss"), int | float) and math.isfinite(t.row["loss"])
        ]
        if skips:
            ax.plot(*zip(*skips), "x", color=EVENT_STYLE["skip"]["color"], ms=8, mew=2, label="skipped step loss")
        ax.set_ylabel("loss")
        ax.set_title("loss (the surviving history after rollbacks)", fontsize=9)

        for ax in col[2:]:  # the legend is on the loss panel, so only it labels the event lines
            _markers(ax, a, by_step=True, seen=set() if ax is col[4] else set(EVENT_STYLE))
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        col[0].grid(alpha=0.3, axis="y")
        s = a.largest
        head = f"{a.run.label}\nlargest stall: {s.sentence()}" if s else a.run.label
        col[0].text(0.0, 1.12, textwrap.fill(head, 95), transform=col[0].transAxes, fontsize=10, va="bottom")
        if c == 0:
            col[0].legend(loc="upper left", fontsize=7, ncol=4, framealpha=0.8)
            if col[4].get_legend_handles_labels()[0]:
                col[4].legend(loc="upper right", fontsize=7, ncol=2, framealpha=0.8)
    if len(mfu_axes) > 1:
        lo = min(ax.get_ylim()[0] for ax in mfu_axes)
        hi = max(ax.get_ylim()[1] for ax in mfu_axes)
        for ax in mfu_axes:
            ax.set_ylim(lo, hi)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    atomic_write_bytes(out_path, buf.getvalue())
    return out_path
