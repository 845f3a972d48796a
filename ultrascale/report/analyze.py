"""Where a run's time went, and the shape of its stalls: the numbers behind ``report.md`` and ``report.png``.

Averages hide the comb. A run that waits on data for a third of every step after step 400 looks merely
"a bit slow" in its mean tokens/s, so besides the shares over the whole run this finds *where* the largest
stall lives: the step window in which its share of step time is highest (:func:`find_window`).

A stall is any time not spent in forward/backward compute: inside a step the data wait, communication,
optimizer and "other" parts; between steps the checkpoint saves, the evaluations, and whatever else the wall
clock shows (start-up, logging), which is estimated as the remainder. They are ranked by estimated seconds of
wall time, so a 4 s checkpoint every 30 steps and a 30 ms data wait every step compete on equal terms.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

from ultrascale.report.load import Run, finite
from ultrascale.train.parts import COMPUTE, MEASURED, OTHER, PARTS, RL

LABELS = {
    "data_wait_s": "data wait",
    "gen_s": "generation",
    "reward_s": "reward",
    "sync_s": "weight sync",
    "fwd_s": "forward",
    "bwd_s": "backward",
    "comm_s": "communication",
    "opt_s": "optimizer",
    "other_s": "other",
    "checkpoint": "checkpointing",
    "eval": "evaluation",
    "warmup": "warm-up",
    "outside": "outside logged steps",
    "lost": "lost to failures",
}
# Events drawn as markers and listed one by one (checkpoints and evals are counted and timed instead).
MARKED = ("skip", "lr_cut", "rollback", "stop", "resume")
# At most this many bins in the window search (O(bins^2)), so thousands of rows stay in milliseconds.
MAX_BINS = 120
# A window is reported only if it explains this much of the share's variance and moves it this much.
MIN_GAIN, MIN_SHIFT = 0.5, 0.05


@dataclass
class Tick:
    """One slot of the comb, in file order: a logged step, a checkpoint, an eval, or the time before the first
    logged step of a start or resume (``start``). Other events take no slot (``pos`` between two slots)."""

    pos: float
    step: int
    kind: str
    seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    steady: bool = True
    represents: int = 1
    row: dict = field(default_factory=dict)


@dataclass
class Breakdown:
    """Mean seconds and share of step time per part; shares are time-weighted (sum of part / sum of step)."""

    n: int
    step_s: float
    mean: dict[str, float]
    frac: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.frac.values())


@dataclass
class Window:
    """Where a part's share of step time is highest. ``kind``: after, until, between or throughout."""

    kind: str
    first: int
    last: int
    share_in: float
    share_out: float | None
    pos: tuple[float, float]

    def phrase(self) -> str:
        s_in, s_out = pct(self.share_in), pct(self.share_out or 0.0)
        if self.kind == "after":
            return f"{s_in} of step time after step {self.first} ({s_out} before)"
        if self.kind == "until":
            return f"{s_in} of step time until step {self.last} ({s_out} after)"
        if self.kind == "between":
            return f"{s_in} of step time from step {self.first} to step {self.last} ({s_out} elsewhere)"
        where = f"step {self.first}" if self.first == self.last else f"steps {self.first}–{self.last}"
        return f"{s_in} of step time throughout ({where})"


@dataclass
class Stall:
    key: str
    seconds: float
    wall_frac: float
    step_frac: float | None = None
    window: Window | None = None
    detail: str = ""

    @property
    def label(self) -> str:
        return LABELS[self.key]

    def sentence(self) -> str:
        """The stall in words, e.g. 'data wait 31 % of step time after step 400 (2 % before), 25 % of wall time'."""
        if self.window is not None:
            return f"{self.label} {self.window.phrase()}, {pct(self.wall_frac)} of wall time"
        return f"{self.label} took {pct(self.wall_frac)} of wall time ({self.detail})"


@dataclass
class Stat:
    mean: float
    p50: float
    min: float
    max: float


@dataclass
class Analysis:
    run: Run
    comb: list[Tick]
    parts: tuple[str, ...]
    all: Breakdown | None
    steady: Breakdown | None
    wall_s: float
    resumes: int
    steps_run: int
    step_time_s: float
    compute_frac: float | None
    stalls: list[Stall]
    stats: dict[str, Stat]
    events: Counter
    marked: list[dict]
    final_loss: float | None
    final_step: int
    min_loss: float | None
    evals: list[dict]
    restarts: int = 0
    """Restarts after a lost rank (the launcher's count) and Slurm requeues, the highest seen."""
    requeues: int = 0
    steps_lost: int = 0
    """Steps run past a checkpoint by an attempt that then died: run again after the restart."""
    lost_s: float = 0.0

    @property
    def largest(self) -> Stall | None:
        return self.stalls[0] if self.stalls else None

    @property
    def breakdown(self) -> Breakdown | None:
        return self.steady or self.all


def pct(x: float) -> str:
    """31 %, 2.4 %, 0.3 %: whole points where the first decimal is noise."""
    x *= 100
    return f"{x:.0f} %" if abs(x) >= 10 else f"{x:.1f} %"


def secs_str(x: float) -> str:
    """4.1 s, 0.12 s: two significant digits below a second, where one decimal would print 0.1 for 0.14."""
    return f"{x:.1f} s" if x >= 1 else f"{x:.2g} s"


def _num(v) -> float | None:
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _step_parts(row: dict) -> tuple[float, dict[str, float]] | None:
    """The disjoint parts of one step row; ``other_s`` is recomputed (clamped at 0) if the row lacks it."""
    step_s = _num(row.get("step_s"))
    if step_s is None or step_s <= 0:
        return None
    parts = {p: _num(row.get(p)) or 0.0 for p in MEASURED}
    other = _num(row.get("other_s"))
    parts["other_s"] = other if other is not None else max(0.0, step_s - sum(parts.values()))
    return step_s, parts


def _comb(run: Run) -> tuple[list[Tick], float, int, int]:
    """File order as comb slots; also wall time (time_s restarts at each resume), resumes, steps executed."""
    comb: list[Tick] = []
    wall, seg_max, resumes, executed = 0.0, 0.0, 0, 0
    cur, warm, pos = 0, True, 0
    for r in run.rows:
        ev = r.get("event")
        if ev == "resume":
            wall, seg_max = wall + seg_max, 0.0
            resumes += 1
            cur, warm = int(_num(r.get("from_step")) or r["step"]), True
        seg_max = max(seg_max, _num(r["time_s"]) or 0.0)
        if ev is None:
            sp = _step_parts(r)
            gap = r["step"] - cur
            executed += max(gap, 0)
            if sp is not None:
                if warm:  # a slot for the time before it (start-up, unlogged warm-up), sized in analyze()
                    comb.append(Tick(pos, r["step"], "start"))
                    pos += 1
                comb.append(Tick(pos, r["step"], "step", sp[0], sp[1], steady=not warm, represents=max(gap, 1), row=r))
                pos += 1
            cur, warm = r["step"], False
        elif ev in ("checkpoint", "eval"):
            secs = _num(r.get(f"{ev}_s")) or 0.0
            comb.append(Tick(pos, r["step"], ev, secs, row=r))
            pos += 1
        else:
            if ev == "rollback":
                cur = int(_num(r.get("to_step")) or cur)
            comb.append(Tick(pos - 0.5, r["step"], ev, row=r))
    return comb, wall + seg_max, resumes, executed


def breakdown(ticks: list[Tick], parts: tuple[str, ...]) -> Breakdown | None:
    if not ticks:
        return None
    total = sum(t.seconds for t in ticks)
    sums = {p: sum(t.parts[p] for t in ticks) for p in parts}
    n = len(ticks)
    return Breakdown(n, total / n, {p: s / n for p, s in sums.items()}, {p: s / total for p, s in sums.items()})


def find_window(ticks: list[Tick], part: str) -> Window:
    """The step window where ``part``'s share of step time is highest, or 'throughout' if there is none.

    Every contiguous window of rows is a candidate model "one level inside, one outside"; the least-squares
    best wins if it explains MIN_GAIN of the variance and moves the share by MIN_SHIFT. Shares are weighted
    by step time, so one slow step counts for its seconds. Long runs are searched on MAX_BINS bin edges and
    the two chosen edges then refined row by row, which keeps thousands of rows in milliseconds.
    """
    n = len(ticks)
    w, x, q = [0.0], [0.0], [0.0]  # prefix sums of weight (step s), weight*share (part s), weight*share^2
    for t in ticks:
        p = t.parts[part]
        w.append(w[-1] + t.seconds)
        x.append(x[-1] + p)
        q.append(q[-1] + p * p / t.seconds)
    flat = Window("throughout", ticks[0].step, ticks[-1].step, x[n] / w[n], None, (ticks[0].pos, ticks[-1].pos))

    def sse(ws: float, xs: float, qs: float) -> float:
        return qs - xs * xs / ws if ws > 0 else 0.0

    def fit(i: int, j: int) -> tuple[float, float, float] | None:
        """Error of 'rows [i, j) at one level, the rest at another', if the inside is the higher one."""
        if j - i < min_len or (i == 0 and j == n):
            return None
        wi, xi, qi = w[j] - w[i], x[j] - x[i], q[j] - q[i]
        wo, xo, qo = w[n] - wi, x[n] - xi, q[n] - qi
        if wi <= 0 or wo <= 0 or xi / wi <= xo / wo:
            return None
        return sse(wi, xi, qi) + sse(wo, xo, qo), xi / wi, xo / wo

    base = sse(w[n], x[n], q[n])
    if n < 3 or base <= 1e-12:
        return flat
    min_len = 2 if n >= 6 else 1
    nb = min(n, MAX_BINS)
    edges = sorted({k * n // nb for k in range(nb + 1)})
    best = None
    for a, i in enumerate(edges):
        for j in edges[a + 1 :]:
            f = fit(i, j)
            if f is not None and (best is None or f[0] < best[0][0]):
                best = (f, i, j)
    if best is None:
        return flat
    span = n // nb + 1
    for _ in range(2):  # refine each edge to the row, between its neighbouring bin edges, the other held
        f, i, j = best
        for i2 in range(max(0, i - span), min(j, i + span + 1)):
            f2 = fit(i2, j)
            if f2 is not None and f2[0] < best[0][0]:
                best = (f2, i2, j)
        f, i, j = best
        for j2 in range(max(i + 1, j - span), min(n, j + span) + 1):
            f2 = fit(i, j2)
            if f2 is not None and f2[0] < best[0][0]:
                best = (f2, i, j2)
    (err, s_in, s_out), i, j = best
    if 1 - err / base < MIN_GAIN or s_in - s_out < MIN_SHIFT:
        return flat
    pos = (ticks[i].pos, ticks[j - 1].pos)
    if j == n:
        return Window("after", ticks[i - 1].step, ticks[-1].step, s_in, s_out, pos)
    if i == 0:
        return Window("until", ticks[0].step, ticks[j - 1].step, s_in, s_out, pos)
    return Window("between", ticks[i].step, ticks[j - 1].step, s_in, s_out, pos)


def _stat(values: list[float]) -> Stat | None:
    if not values:
        return None
    return Stat(statistics.fmean(values), statistics.median(values), min(values), max(values))


def _event_stall(key: str, ticks: list[Tick], denom: float, noun: str) -> Stall | None:
    if not ticks:
        return None
    secs = [t.seconds for t in ticks]
    total, mean = sum(secs), statistics.fmean(secs)
    slow = max(ticks, key=lambda t: t.seconds)
    detail = f"{len(ticks)} {noun}{'s' if len(ticks) != 1 else ''}, {secs_str(mean)} each"
    if len(ticks) > 1 and slow.seconds > 1.5 * mean:
        detail += f", slowest {secs_str(slow.seconds)} at step {slow.step}"
    return Stall(key, total, total / denom, detail=detail)


def analyze(run: Run) -> Analysis:
    """The shares, stalls and windows of one run.

    Step rows are samples (one every ``train.log_interval`` steps), so a row stands for the steps since the
    previous one. The first step row after a start or resume carries warm-up and compilation; the "steady"
    numbers leave it out, and its extra time is not multiplied by the steps it stands for."""
    comb, wall, resumes, executed = _comb(run)
    steps = [t for t in comb if t.kind == "step"]
    has_comm = any("comm_s" in t.row for t in steps)
    # With the breakdown off (train.step_breakdown=false, or a pipeline run) rows carry only the data wait,
    # communication and step time: "other" then holds forward, backward and optimizer and is no stall.
    timed = any(k in t.row for t in steps for k in COMPUTE)
    rl = {p for p in RL if any(p in t.row for t in steps)}  # a GRPO run's generation, reward and weight sync
    parts = tuple(
        p
        for p in PARTS
        if (p != "comm_s" or has_comm) and (timed or p not in (*COMPUTE, "opt_s")) and (p not in RL or p in rl)
    )
    steady_ticks = [t for t in steps if t.steady]
    all_bd, steady_bd = breakdown(steps, parts), breakdown(steady_ticks, parts)
    ref = steady_bd or all_bd

    # Seconds per part over every executed step: a row stands for the steps since the previous row. A
    # warm-up row counts as a steady step for the steps it stands for, and its excess over the steady mean
    # (compilation, allocator and cache warm-up) is billed as warm-up, not as compute.
    part_s = dict.fromkeys(parts, 0.0)
    warm_s, warm = 0.0, [t for t in steps if not t.steady]
    for t in steps:
        for p in parts:
            if t.steady or steady_bd is None:
                part_s[p] += t.parts[p] * t.represents
            else:
                m = steady_bd.mean[p]
                part_s[p] += min(t.parts[p], m) + (t.represents - 1) * m
                warm_s += max(0.0, t.parts[p] - m)
    step_time = sum(part_s.values()) + warm_s
    resumed = [r for r in run.events if r["event"] == "resume"]
    steps_lost = sum(int(_num(r.get("steps_lost")) or 0) for r in resumed)
    lost_s = sum(_num(r.get("lost_s")) or 0.0 for r in resumed)
    wall += lost_s  # the dead attempts' rows were dropped at the resume; their time was still spent
    ckpts = [t for t in comb if t.kind == "checkpoint"]
    evals = [t for t in comb if t.kind == "eval"]
    ckpt_s, eval_s = sum(t.seconds for t in ckpts), sum(t.seconds for t in evals)
    denom = max(wall, step_time + ckpt_s + eval_s, 1e-9)

    stalls: list[Stall] = []
    window_ticks = steady_ticks or steps
    for p in parts:
        if p in COMPUTE or (p == OTHER and not timed) or not steps:
            continue
        win = find_window(window_ticks, p)
        stalls.append(Stall(p, part_s[p], part_s[p] / denom, ref.frac[p], win))
    for key, ticks, noun in (("checkpoint", ckpts, "save"), ("eval", evals, "eval")):
        st = _event_stall(key, ticks, denom, noun)
        if st is not None:
            stalls.append(st)
    if lost_s > 0:
        restarts = max((int(_num(r.get("restart")) or 0) for r in resumed), default=0)
        stalls.append(Stall("lost", lost_s, lost_s / denom, detail=f"{steps_lost} steps run again after "
                            f"{len([r for r in resumed if r.get('steps_lost')])} failure(s) ({restarts} restart(s)): "
                            "the part of a checkpoint interval a failure costs"))  # fmt: skip
    if warm_s > 0 and steady_bd is not None:
        first = ", ".join(f"{secs_str(t.seconds)} at step {t.step}" for t in warm[:3]) + (
            ", ..." if len(warm) > 3 else ""
        )
        detail = (
            f"first logged step after a start or resume: {first} vs {secs_str(steady_bd.step_s)} steady; "
            f"compilation, allocator and cache warm-up"
        )
        stalls.append(Stall("warmup", warm_s, warm_s / denom, detail=detail))
    # The time before each segment's first logged step: its time_s, less that step and the unlogged steps
    # before it at the steady pace (step 1's compilation usually lives here). The comb draws it as a bar.
    # The pace is the local one (the median of the next few logged steps), not the run's mean, which a
    # later stall would inflate.
    starts = {t.pos + 1: t for t in comb if t.kind == "start"}
    for k, t in enumerate(steps):
        if not t.steady and t.pos in starts:
            after = [u.seconds for u in steps[k + 1 : k + 4] if u.steady]
            pace = statistics.median(after) if after else ref.step_s
            t_pre = (_num(t.row["time_s"]) or 0.0) - t.seconds - (t.represents - 1) * pace
            starts[t.pos].seconds = max(0.0, t_pre)
    outside = max(0.0, wall - step_time - ckpt_s - eval_s)
    # without step times there is no remainder to speak of; below 0.5 % it is rounding
    if steps and outside > 0.005 * denom:
        pre = min(sum(t.seconds for t in starts.values()), outside)
        detail = (
            f"{pre:.1f} s before the first logged step: start-up, compilation, warm-up of the unlogged first "
            f"steps; {outside - pre:.1f} s between logged steps: logging, unlogged steps slower than logged ones"
        )
        stalls.append(Stall("outside", outside, outside / denom, detail=detail))
    stalls.sort(key=lambda s: s.seconds, reverse=True)

    stat_rows = [t.row for t in (steady_ticks or steps)] or run.step_rows
    stats = {}
    for key in ("tokens_per_s", "tflops", "mfu", "mem_gb", "step_s"):
        st = _stat(finite([r.get(key) for r in stat_rows]))
        if st is not None:
            stats[key] = st

    curve = run.curve()
    losses = [(r["step"], _num(r.get("loss"))) for r in curve]
    losses = [(s, v) for s, v in losses if v is not None]
    final_loss = losses[-1][1] if losses else _num(run.summary.get("final_loss"))
    last_eval: dict[int, dict] = {}
    for r in run.events:
        if r["event"] == "eval":
            last_eval[r["step"]] = r
    return Analysis(
        run=run,
        comb=comb,
        parts=parts,
        all=all_bd,
        steady=steady_bd,
        wall_s=wall,
        resumes=resumes,
        steps_run=executed,
        step_time_s=step_time,
        compute_frac=sum(part_s[p] for p in COMPUTE) / denom if timed else None,
        stalls=stalls,
        stats=stats,
        events=Counter(r["event"] for r in run.events),
        marked=[r for r in run.events if r["event"] in MARKED],
        final_loss=final_loss,
        final_step=curve[-1]["step"],
        min_loss=min(v for _, v in losses) if losses else None,
        evals=[last_eval[s] for s in sorted(last_eval)],
        restarts=max((int(_num(r.get("restart")) or 0) for r in resumed), default=0),
        requeues=max((int(_num(r.get("requeue")) or 0) for r in resumed), default=0),
        steps_lost=steps_lost,
        lost_s=lost_s,
    )
