"""``report.png``: the comb, for people who would rather look than read.

Top: every logged step as a stacked bar of its parts in seconds (compute in blues, stalls in warm colours),
in file order, with checkpoints and evals as their own bars (green, cyan) where they happened, so the gaps between
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
from ultrascale.report.load import finite
from ultrascale.report.mixture import draw as draw_mixture
from ultrascale.report.mixture import mixture_series
from ultrascale.train.parts import DATA_WAIT, MEASURED, OTHER

COLORS = {
    "gen_s": "#2ca02c",
    "reward_s": "#bcbd22",
    "sync_s": "#e377c2",
    "fwd_s": "#1f77b4",
    "bwd_s": "#6baed6",
    "data_wait_s": "#d62728",
    "comm_s": "#ff7f0e",
    "opt_s": "#9467bd",
    "other_s": "#8c8c8c",
    "checkpoint": "#2ca02c",
    "eval": "#17becf",
    "start": "#c7c7c7",
}
# Stack order: compute at the bottom so the teeth line up, stalls on top where the eye finds them.
STACK = (*(p for p in MEASURED if p != DATA_WAIT), DATA_WAIT, OTHER)
EVENT_STYLE = {
    "checkpoint": dict(color="#2ca02c", ls=":", lw=1.0),
    "eval": dict(color="#17becf", ls="--", lw=1.0),
    "skip": dict(color="#ff7f0e", ls="-", lw=1.2),
    "lr_cut": dict(color="#9467bd", ls="-.", lw=1.2),
    "rollback": dict(color="#d62728", ls="-", lw=2.0),
    "resume": dict(color="#555555", ls="--", lw=1.5),
    "stop": dict(color="black", ls="-", lw=2.0),
}
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


def _bars(ax, x: list[float], bottom: list[float], height: list[float], **kw) -> None:
    """Vertical bars as one PolyCollection: a Rectangle per bar costs seconds once there are thousands."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    if not x:
        return
    half = 0.4 if max(x) < 300 else 0.5  # narrow bars leave visible gaps; many slots touch instead
    x, lo = np.asarray(x, float), np.asarray(bottom, float)
    hi = lo + np.asarray(height, float)
    verts = np.stack([np.stack([x - half, lo], 1), np.stack([x - half, hi], 1),
                      np.stack([x + half, hi], 1), np.stack([x + half, lo], 1)], 1)  # fmt: skip
    coll = PolyCollection(verts, linewidths=0, **kw)
    coll.set_in_layout(False)  # inside the axes anyway; measuring thousands of polygons for the layout is slow
    ax.add_collection(coll)
    ax.update_datalim([(x.min() - half, 0), (x.max() + half, hi.max())])
    ax.autoscale_view()


def _stack(ax, a: Analysis, values) -> None:
    """Each logged step's parts stacked at its comb slot."""
    steps = [t for t in a.comb if t.kind == "step"]
    bottom = [0.0] * len(steps)
    for p in STACK:
        if p not in a.parts:
            continue
        h = [values(t, p) for t in steps]
        _bars(ax, [t.pos for t in steps], bottom, h, facecolors=COLORS[p], label=LABELS[p])
        bottom = [b + v for b, v in zip(bottom, h)]


def _markers(ax, a: Analysis, by_step: bool, label: bool) -> None:
    """Vertical lines for events: at their comb slot (file order) or at their step (curve panels)."""
    kinds: dict[str, list[float]] = {}
    for t in a.comb:
        if t.kind in ("step", "start") or (not by_step and t.kind in ("checkpoint", "eval")):
            continue
        kinds.setdefault(t.kind, []).append(t.step if by_step else t.pos)
    for kind, xs in kinds.items():
        style = EVENT_STYLE.get(kind, {"color": "k", "ls": "-", "lw": 1.0})
        ax.vlines(xs, 0, 1, transform=ax.get_xaxis_transform(), colors=style["color"], linestyles=style["ls"],
                  linewidths=style["lw"], alpha=0.8, label=kind.replace("_", " ") if label else None)  # fmt: skip


def _comb_panel(ax, a: Analysis, cap: float) -> None:
    _stack(ax, a, lambda t, p: min(t.parts[p], cap))
    for kind in ("checkpoint", "eval", "start"):
        ticks = [t for t in a.comb if t.kind == kind and t.seconds > 0]
        heights = [min(t.seconds, cap) for t in ticks]
        label = LABELS[kind] if kind != "start" else "before first log"
        _bars(ax, [t.pos for t in ticks], [0.0] * len(ticks), heights, facecolors=COLORS[kind], label=label)
    clipped = [t for t in a.comb if t.seconds > cap and t.kind in ("step", "checkpoint", "eval", "start")]
    for t in clipped[:40]:
        ax.annotate(f"{t.seconds:.1f} s", (t.pos, cap), xytext=(0, 2), textcoords="offset points", ha="center",
                    va="bottom", fontsize=7, rotation=90)  # fmt: skip
    _markers(ax, a, by_step=False, label=True)
    ax.set_ylim(0, cap * 1.3)
    ax.set_ylabel("seconds")
    ax.set_xlabel("logged steps in file order; checkpoints and evals as their own bars (taller ones clipped, labelled)")
    _xticks(ax, [t for t in a.comb if t.kind == "step"])


def _share_panel(ax, a: Analysis) -> None:
    _stack(ax, a, lambda t, p: t.parts[p] / t.seconds)
    s = a.largest
    if s is not None and s.window is not None and s.window.kind != "throughout":
        lo, hi = s.window.pos
        ax.plot([lo - 0.5, hi + 0.5], [1.03, 1.03], color=COLORS.get(s.key, "k"), lw=4, solid_capstyle="butt")
        ax.annotate(f"{s.label}: {s.window.phrase()}", ((lo + hi) / 2, 1.05), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("share of step time")
    ax.set_xlabel("the same steps as shares (gaps: checkpoints, evals)")
    _xticks(ax, [t for t in a.comb if t.kind == "step"])


def _finite(v) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


def _curve(ax, a: Analysis, key: str, scale: float = 1.0, **kw) -> list[tuple[int, float]]:
    pts = [(r["step"], r[key] * scale) for r in a.run.curve() if _finite(r.get(key))]
    if pts:
        ax.plot(*zip(*pts), **kw)
    return pts


def _loss_range(analyses: list[Analysis]) -> tuple[float | None, float | None]:
    """The loss panels' shared y range: every run's train and eval loss, not a skipped step's spike."""
    ys = [y for a in analyses for y in finite([r.get("loss") for r in a.run.curve()])]
    ys += [y for a in analyses for y in finite([e.get("eval_loss") for e in a.evals])]
    if not ys:
        return None, None
    pad = max(ys) - min(ys) + 1e-9
    return min(ys) - 0.05 * pad, max(ys) + 0.1 * pad


def plot(analyses: list[Analysis], out_path: Path, title: str = "") -> Path:
    """Draw the report figure for one or more runs; written atomically so a reader never sees half a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncol = len(analyses)
    mixes = [mixture_series(a.run.step_rows) for a in analyses]
    rows = _ROWS + any(mixes)  # a mixture's panel, below the loss, where any run has one
    fig, axes = plt.subplots(
        rows,
        ncol,
        figsize=(8 * ncol, 17 + 2.5 * (rows - _ROWS)),
        layout="constrained",
        sharey="row",
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2, 2, 1.5, 2.5, 2.5][:rows]},
    )
    steps_s = [t.seconds for a in analyses for t in a.comb if t.kind == "step"]
    cap = 3 * _p95(steps_s) if steps_s else 1.0
    cap = min(cap, max([t.seconds for a in analyses for t in a.comb] + [1e-9]))
    mfu_axes = []
    lo, top = _loss_range(analyses)
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
        ev = [(e["step"], e["eval_loss"]) for e in a.evals if _finite(e.get("eval_loss"))]
        if ev:
            ax.plot(*zip(*ev), "o-", color="C1", lw=1.4, label="eval loss")
        # a skipped step's loss (a 20x spike) would flatten the curve: clip it to the top edge, print its value
        skips = [(t.step, t.row.get("loss")) for t in a.comb if t.kind == "skip" and _finite(t.row.get("loss"))]
        if skips:
            y_at = [min(y, top) if top is not None else y for _, y in skips]
            ax.plot([x for x, _ in skips], y_at, "x", color=EVENT_STYLE["skip"]["color"], ms=8, mew=2,
                    label="skipped step's loss", clip_on=False)  # fmt: skip
            for (x, y), ya in zip(skips, y_at):
                if y > ya:
                    ax.annotate(f"{y:.3g}", (x, ya), xytext=(4, -10), textcoords="offset points", fontsize=7)
        if lo is not None:
            ax.set_ylim(lo, top)
        ax.set_ylabel("loss")
        ax.set_title("loss (the surviving history after rollbacks)", fontsize=9)

        if rows > _ROWS:
            if mixes[c] is not None:
                draw_mixture(col[5], mixes[c])
            else:
                col[5].set_axis_off()
        for ax in col[2:5]:  # the legend is on the loss panel, so only it labels the event lines
            _markers(ax, a, by_step=True, label=ax is col[4])
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        col[0].grid(alpha=0.3, axis="y")
        s = a.largest
        head = f"{a.run.label}: the comb\nlargest stall: {s.sentence()}" if s else a.run.label
        col[0].set_title("\n".join(textwrap.fill(h, 100) for h in head.split("\n")), fontsize=10, loc="left")
        if c == 0:
            # below the panel, where it hides no bar (constrained layout makes room for it)
            col[0].legend(loc="upper left", bbox_to_anchor=(0.0, -0.13), fontsize=7, ncol=5, frameon=False)
        if col[4].get_legend_handles_labels()[0]:  # every column: runs can have different events
            col[4].legend(loc="upper right", fontsize=7, ncol=2, framealpha=0.8)
    if len(mfu_axes) > 1:
        m_lo = min(ax.get_ylim()[0] for ax in mfu_axes)
        m_hi = max(ax.get_ylim()[1] for ax in mfu_axes)
        for ax in mfu_axes:
            ax.set_ylim(m_lo, m_hi)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.get_layout_engine().execute(fig)  # once, then fixed: savefig would run it in a second full draw
    fig.set_layout_engine(None)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    atomic_write_bytes(out_path, buf.getvalue())
    return out_path
