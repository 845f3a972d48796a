"""``report.md``: the stall named in the first lines, then the tables that back it up.

One run gets one section; several runs get a comparison first (throughput, MFU, shares, largest stall,
loss, and which is faster by how much) and then one section each, so the same reading order works for both.
"""

from __future__ import annotations

from ultrascale.report.analyze import LABELS, Analysis, pct, secs_str
from ultrascale.report.mixture import mixture_series, table

_STATS = (
    ("tokens_per_s", "tokens/s", "{:,.0f}", 1.0),
    ("tflops", "TFLOP/s", "{:.3g}", 1.0),
    ("mfu", "MFU", "{:.1f} %", 100.0),
    ("mem_gb", "memory GiB", "{:.2f}", 1.0),
    ("step_s", "step time s", "{:.3g}", 1.0),
)
_MAX_EVENT_ROWS = 50


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _f(v: float | None, fmt: str = "{:.4g}") -> str:
    return "–" if v is None else fmt.format(v)


def _what_ran(a: Analysis) -> list[list[str]]:
    run = a.run
    rows = [["run dir", f"`{run.path}`"]]
    model = run.cfg("model.name")
    if model:
        kind = run.cfg("model.type")
        rows.append(["model", f"{model}" + (f" ({kind})" if kind else "")])
    stage = run.meta.get("zero_stage", run.cfg("zero.stage"))  # the checkpoint's record, else the config
    if stage is not None:
        off = [
            f"{w} offload to {run.cfg(f'zero.offload_{w}')}"
            for w in ("optimizer", "param")
            if run.cfg(f"zero.offload_{w}") not in (None, "none")
        ]
        rows.append(["ZeRO", f"stage {stage}" + (f" ({', '.join(off)})" if off else "")])
    precision = run.cfg("precision.dtype", run.meta.get("precision"))
    if precision:
        rows.append(["precision", str(precision)])
    topo = run.summary.get("topology") or run.meta.get("topology") or {}
    world = run.summary.get("world_size") or topo.get("world") or run.meta.get("world_size")
    degrees = " ".join(f"{k}={topo[k]}" for k in ("dp", "tp", "pp", "sp", "ep") if k in topo)
    if not degrees:
        degrees = " ".join(
            f"{k}={run.cfg(f'parallel.{k}')}" for k in ("tp", "pp", "sp", "ep") if run.cfg(f"parallel.{k}") is not None
        )
    if world or degrees:
        rows.append(
            [
                "world",
                (f"{world} ranks" if world else "ranks unknown (no checkpoint meta)")
                + (f" ({degrees})" if degrees else ""),
            ]
        )
    micro, glob, seq = run.cfg("data.micro_batch"), run.cfg("data.global_batch"), run.cfg("data.seq_len")
    if micro and glob and seq:
        dp = topo.get("dp")
        accum = f" × accum {glob // (micro * dp)} × dp {dp}" if dp and glob % (micro * dp) == 0 else ""
        rows.append(["batch", f"micro {micro}{accum} = global {glob} samples × seq {seq} = {glob * seq:,} tokens/step"])
    planned = run.cfg("train.steps")
    interval = run.cfg("train.log_interval")
    logged = len(run.step_rows)
    steps = f"{a.final_step}" + (f" of {planned}" if planned else "")
    steps += f" ({logged} logged row{'s' if logged != 1 else ''}" + (f", every {interval}" if interval else "") + ")"
    rows.append(["steps", steps])
    wall = f"{a.wall_s:,.1f} s"
    if a.resumes:
        wall += f" over {a.resumes + 1} segments ({a.resumes} resume{'s' if a.resumes > 1 else ''})"
    rows.append(["wall time", wall])
    if a.restarts or a.requeues or a.steps_lost:
        failures = [f"{a.restarts} restart{'s' if a.restarts != 1 else ''}"] if a.restarts else []
        failures += [f"{a.requeues} requeue{'s' if a.requeues != 1 else ''}"] if a.requeues else []
        failures.append(f"{a.steps_lost} step{'s' if a.steps_lost != 1 else ''} lost ({secs_str(a.lost_s)} run again)")
        rows.append(["failures", ", ".join(failures)])
    return rows


def _breakdown(a: Analysis) -> list[str]:
    if a.all is None:
        return ["No step breakdown in these rows (no `step_s`): the run predates it or had it off."]
    head = ["part", f"mean s (all {a.all.n})", "share (all)"]
    bds = [a.all]
    if a.steady is not None:
        head += [f"mean s (steady, {a.steady.n})", "share (steady)"]
        bds.append(a.steady)
    rows = []
    for p in a.parts:
        rows.append([LABELS[p]] + [c for bd in bds for c in (f"{bd.mean[p]:.4g}", pct(bd.frac[p]))])
    rows.append(
        ["**sum**"] + [c for bd in bds for c in (f"{sum(bd.mean.values()):.4g}", f"**{bd.total * 100:.1f} %**")]
    )
    rows.append(["step time"] + [c for bd in bds for c in (f"{bd.step_s:.4g}", "100 %")])
    lines = _table(head, rows)
    if "comm_s" not in a.parts:
        lines.append("")
        lines.append("Communication was not measured separately in this run; it is inside the other parts.")
    if "fwd_s" not in a.parts:
        lines.append("")
        lines.append(
            "Forward, backward and optimizer were not timed in this run (`train.step_breakdown=false`, or a "
            "pipeline run): they are inside *other*, which is therefore not counted as a stall."
        )
    lines.append("")
    lines.append(
        "Steady = every logged step but the first after a start or resume (warm-up, compilation). "
        "Shares are each part's seconds over step seconds, so they sum to 1 by construction of the log; "
        "a sum off by more than a few percent means the parts overlapped or were mismeasured."
    )
    return lines


def _stalls(a: Analysis) -> list[str]:
    if not a.stalls:
        return ["No stalls measured."]
    rows = []
    for s in a.stalls:
        where = s.window.phrase() if s.window is not None else s.detail
        share = pct(s.step_frac) if s.step_frac is not None else "–"
        rows.append([s.label, f"{s.seconds:,.1f}", pct(s.wall_frac), share, where])
    lines = _table(["stall", "seconds (est.)", "of wall time", "of step time (steady)", "where / how"], rows)
    lines.append("")
    if a.compute_frac is not None:
        lines.append(
            f"Forward + backward compute filled {pct(a.compute_frac)} of the wall time; everything above is "
            "the gap between the teeth. Step parts are scaled from the logged samples to every step run."
        )
    else:
        lines.append("Step parts are scaled from the logged samples to every step run.")
    return lines


def _stats(a: Analysis) -> list[str]:
    rows = []
    for key, name, fmt, scale in _STATS:
        st = a.stats.get(key)
        if st is not None:
            rows.append([name] + [fmt.format(v * scale) for v in (st.mean, st.p50, st.min, st.max)])
    if not rows:
        return ["No throughput columns in these rows."]
    return _table(["metric (steady)", "mean", "p50", "min", "max"], rows)


def _loss(a: Analysis) -> list[str]:
    lines = [f"- final train loss {_f(a.final_loss)} at step {a.final_step}; lowest {_f(a.min_loss)}"]
    ev = a.evals[-1] if a.evals else None
    eval_loss = ev.get("eval_loss") if ev else a.run.summary.get("eval_loss")
    if eval_loss is not None:
        where = f" at step {ev['step']}" if ev else ""
        ppl = (
            ev.get("eval_perplexity", ev.get("eval_ppl"))
            if ev
            else a.run.summary.get("eval_perplexity", a.run.summary.get("eval_ppl"))
        )
        lines.append(f"- eval loss {_f(eval_loss)}" + (f" (perplexity {_f(ppl)})" if ppl is not None else "") + where)
    he = (ev or {}).get("humaneval_pass@1", a.run.summary.get("humaneval_pass@1"))
    if he is not None:
        lines.append(f"- HumanEval pass@1 {he:.3f}")
    if len(a.evals) > 1:
        lines.append("")
        lines += _table(
            ["step", "eval loss", "perplexity", "eval s"],
            [
                [
                    str(e["step"]),
                    _f(e.get("eval_loss")),
                    _f(e.get("eval_perplexity", e.get("eval_ppl"))),
                    _f(e.get("eval_s"), "{:.2f}"),
                ]
                for e in a.evals[-20:]
            ],
        )
    return lines


def _mixture(a: Analysis) -> list[str]:
    """Per source: tokens, realized share over the run, asked share, epochs; and where the stages began."""
    s = mixture_series(a.run.step_rows)
    if s is None:
        return []
    lines = _table(["source", "tokens read", "realized share", "asked (last stage)", "epochs"], table(s))
    starts = ", ".join(f"stage {st} from step {step}" for step, st in s.boundaries)
    evals = a.evals[-1] if a.evals else {}
    per = [f"{n} {evals[f'eval/{n}/loss']:.4g}" for n in s.sources if f"eval/{n}/loss" in evals]
    lines += ["", f"- {starts} (logged steps)"]
    if per:
        lines.append(f"- eval loss per source at step {evals['step']}: {', '.join(per)}")
    return lines


def _events(a: Analysis) -> list[str]:
    if not a.events:
        return ["No events."]
    plural = {"checkpoint": "checkpoints", "eval": "evals", "skip": "skips", "lr_cut": "lr cuts",
              "rollback": "rollbacks", "stop": "stops", "resume": "resumes"}  # fmt: skip
    lines = [", ".join(f"{n} {plural.get(ev, ev) if n != 1 else ev}" for ev, n in sorted(a.events.items()))]
    if a.marked:
        rows = []
        for r in a.marked[:_MAX_EVENT_ROWS]:
            extra = ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in r.items()
                if k not in ("step", "time_s", "event", "reason")
            )
            rows.append([str(r["step"]), r["event"], str(r.get("reason", "")), extra])
        lines += ["", *_table(["step", "event", "reason", "details"], rows)]
        if len(a.marked) > _MAX_EVENT_ROWS:
            lines.append(f"... and {len(a.marked) - _MAX_EVENT_ROWS} more in metrics.jsonl")
    return lines


def _headline(a: Analysis) -> str:
    s = a.largest
    return f"**Largest stall: {s.sentence()}.**" if s else "**No stalls measured.**"


def run_section(a: Analysis, level: int = 2) -> list[str]:
    h = "#" * level
    lines = []
    for title, body in (
        ("What ran", _table(["", ""], _what_ran(a))),
        ("Where the step time goes", _breakdown(a)),
        ("Stalls, largest first", _stalls(a)),
        ("Throughput, MFU, memory", _stats(a)),
        ("Loss", _loss(a)),
        ("Data mixture", _mixture(a)),
        ("Events", _events(a)),
    ):
        if not body:
            continue
        lines += [f"{h} {title}", "", *body, ""]
    return lines


def _compare(analyses: list[Analysis]) -> list[str]:
    base = analyses[0]
    head = ["", *(a.run.label for a in analyses)]
    rows = []
    for key, name, fmt, scale in _STATS:
        rows.append(
            [f"{name} (mean)"] + [fmt.format(a.stats[key].mean * scale) if key in a.stats else "–" for a in analyses]
        )
    parts = [p for p in base.parts] + [p for a in analyses[1:] for p in a.parts if p not in base.parts]
    for p in parts:
        rows.append(
            [f"{LABELS[p]} share"]
            + [pct(a.breakdown.frac[p]) if a.breakdown and p in a.parts else "–" for a in analyses]
        )
    rows.append(
        ["compute share of wall"] + [pct(a.compute_frac) if a.compute_frac is not None else "–" for a in analyses]
    )
    rows.append(["largest stall"] + [a.largest.sentence() if a.largest else "–" for a in analyses])
    rows.append(["final train loss"] + [_f(a.final_loss) for a in analyses])
    rows.append(["eval loss"] + [_f(a.evals[-1].get("eval_loss")) if a.evals else "–" for a in analyses])
    rows.append(["wall time (s)"] + [f"{a.wall_s:,.1f}" for a in analyses])
    return _table(head, rows)


def _faster(base: Analysis, other: Analysis) -> str:
    """Which run is faster and by how much: steady tokens/s, or step time where a run has no tokens/s."""
    for key, name, fmt, higher_better in (
        ("tokens_per_s", "tokens/s", "{:,.0f}", True),
        ("step_s", "step time", "{:.3g} s", False),
    ):
        b = base.stats[key].mean if key in base.stats else 0.0
        o = other.stats[key].mean if key in other.stats else 0.0
        if b <= 0 or o <= 0:
            continue
        ratio = o / b if higher_better else b / o
        if abs(ratio - 1) < 0.01:
            return f"{other.run.label} and {base.run.label} are equally fast ({name} within 1 %)."
        (fast, f), (slow, sl) = ((other, o), (base, b)) if ratio > 1 else ((base, b), (other, o))
        return (  # the numbers in the order the sentence names the runs, each with its name
            f"**{fast.run.label} is {max(ratio, 1 / ratio):.2f}× as fast as {slow.run.label}** "
            f"(steady mean {name}: {fast.run.label} {fmt.format(f)} vs {slow.run.label} {fmt.format(sl)})."
        )
    return f"{other.run.label} vs {base.run.label}: no common throughput column to compare."


def render(analyses: list[Analysis], png_name: str = "report.png") -> str:
    """The whole report.md for one run or a comparison of several."""
    if len(analyses) == 1:
        a = analyses[0]
        lines = [f"# Run report: {a.run.label}", "", _headline(a), ""]
        lines += [f"> {n}" for n in a.run.notes] + ([""] if a.run.notes else [])
        lines += [f"![the comb]({png_name})", "", *run_section(a)]
        return "\n".join(lines).rstrip() + "\n"
    labels = " vs ".join(a.run.label for a in analyses)
    lines = [f"# Run comparison: {labels}", ""]
    lines += [_faster(analyses[0], a) for a in analyses[1:]]
    lines.append("")
    for a in analyses:
        lines.append(f"- {a.run.label}: {_headline(a)}")
    lines += ["", f"![the comb, side by side]({png_name})", "", "## Side by side", "", *_compare(analyses), ""]
    for a in analyses:
        lines += [f"## {a.run.label}", ""]
        lines += [f"> {n}" for n in a.run.notes] + ([""] if a.run.notes else [])
        lines += run_section(a, level=3)
    return "\n".join(lines).rstrip() + "\n"
