"""The data mixture as a run realized it, from ``metrics.jsonl``'s ``data/`` group: per logging interval, the
share of the samples read that came from each source, the share asked, and where the stages changed.

A mixture that is off (a source exhausted and repeating, a stage boundary in the wrong place, a weight typo) is
visible at a glance as a band of the wrong height or a step in the wrong place; a table of final shares would
average it away.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

_TOKENS = re.compile(r"^data/(.+)/tokens$")


@dataclass
class MixtureSeries:
    sources: list[str]
    steps: list[int] = field(default_factory=list)
    """The logged step closing each interval."""
    realized: dict[str, list[float]] = field(default_factory=dict)
    """Per source: the share of the interval's samples it gave."""
    asked: dict[str, list[float]] = field(default_factory=dict)
    """Per source: the share its stage asked for at that step."""
    in_stage: dict[str, list[float]] = field(default_factory=dict)
    """Per source: the share of all samples read since its stage began (converges on ``asked``)."""
    boundaries: list[tuple[int, int]] = field(default_factory=list)
    """(first logged step of a stage, stage number), the first stage included."""
    tokens: dict[str, float] = field(default_factory=dict)
    """Per source: tokens read by the last logged step."""
    epochs: dict[str, float] = field(default_factory=dict)


def mixture_series(rows: list[dict]) -> MixtureSeries | None:
    """The series from the step rows (``None`` for a one-source run: nothing to show)."""
    rows = [r for r in rows if "data/stage" in r]
    if not rows:
        return None
    names = [m.group(1) for k in rows[0] if (m := _TOKENS.match(k))]
    s = MixtureSeries(names)
    prev = dict.fromkeys(names, 0.0)
    stage = None
    for r in sorted(rows, key=lambda r: r["step"]):
        got = {n: float(r[f"data/{n}/tokens"]) - prev[n] for n in names}
        total = sum(got.values())
        if total <= 0:  # a row repeated by a resume: same tokens, nothing new read
            continue
        s.steps.append(r["step"])
        for n in names:
            s.realized.setdefault(n, []).append(got[n] / total)
            s.asked.setdefault(n, []).append(float(r.get(f"data/{n}/asked", 0.0)))
            s.in_stage.setdefault(n, []).append(float(r.get(f"data/{n}/share", 0.0)))
        if r["data/stage"] != stage:
            stage = int(r["data/stage"])
            s.boundaries.append((r["step"], stage))
        prev = {n: float(r[f"data/{n}/tokens"]) for n in names}
    last = rows[-1]
    s.tokens = {n: float(last[f"data/{n}/tokens"]) for n in names}
    s.epochs = {n: float(last.get(f"data/{n}/epoch", 0.0)) for n in names}
    return s


def draw(ax, s: MixtureSeries) -> None:
    """Stacked bands of the realized shares per interval; the shares read since the stage began as solid edges, the
    asked ones dashed (the solid edges close on the dashed: exact apportionment); stage changes as lines."""
    import numpy as np

    x = np.asarray(s.steps)
    real = np.asarray([s.realized[n] for n in s.sources])
    asked = np.cumsum(np.asarray([s.asked[n] for n in s.sources]), axis=0)
    ax.stackplot(x, real, labels=s.sources, step="pre", alpha=0.75)
    in_stage = np.cumsum(np.asarray([s.in_stage[n] for n in s.sources]), axis=0)
    for edge in asked[:-1]:
        ax.step(x, edge, where="pre", color="black", ls="--", lw=0.9)
    starts = [i for i, step in enumerate(s.steps) if step in {b for b, _ in s.boundaries}] + [len(x)]
    for lo, hi in itertools.pairwise(starts):  # one line per stage: its share restarts with it
        for edge in in_stage[:-1]:
            ax.plot(x[lo:hi], edge[lo:hi], color="black", lw=1.3)
    for step, stage in s.boundaries[1:]:
        ax.axvline(step - 0.5, color="black", lw=1.6)
        ax.annotate(f"stage {stage}", (step - 0.5, 1.0), xytext=(3, -12), textcoords="offset points", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of samples")
    ax.set_title(
        "data mixture: realized per interval (bands), since the stage began (solid), asked (dashed)", fontsize=9
    )
    ax.legend(loc="lower left", fontsize=7, ncol=len(s.sources), framealpha=0.8)


def table(s: MixtureSeries) -> list[list[str]]:
    """source | tokens read | realized share over the run | asked in the last stage | epochs."""
    total = sum(s.tokens.values()) or 1.0
    return [[n, f"{s.tokens[n]:,.0f}", f"{s.tokens[n] / total:.1%}", f"{s.asked[n][-1]:.1%}", f"{s.epochs[n]:.3g}"]
            for n in s.sources]  # fmt: skip
