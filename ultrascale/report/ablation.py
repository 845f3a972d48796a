"""An ablation read from a Hydra sweep: arms, seeds paired against a baseline, a Student t interval, a figure.

    python train.py -m recipe=cpu_smoke optim=adamw,muon train.seed=1,2,3 hydra.sweep.dir=sweeps/opt \\
        hydra.sweep.subdir='${hydra.job.override_dirname}'
    python -m ultrascale.report.ablation sweeps/opt --baseline optim=adamw --json opt.json --plot opt.png

A job's arm is the overrides that tell it from the other jobs of its sweep, less its seed (``train.seed``); jobs
of one arm differ only in their seed, and a seed fixes the data order and the initial weights, so an arm's run
and the baseline's run of the same seed form a pair. Per arm: the final held-out loss (the last eval, at the run's
last step) as mean and spread over its seeds, and tokens/s. Per arm against the baseline: the mean of the paired
differences with a Student t 95 % interval (t on n - 1 degrees of freedom: 4.30 with 3 pairs), whose half-width
is the smallest difference this many seeds could have told from zero; and the tokens the arm needed to reach the
baseline's final loss, read off its eval curve (linear between evals), as a ratio of the baseline's tokens, or
"not reached". A pair's difference is the arm's loss less the baseline's: below zero, the arm is better.

What would make the comparison say less than it seems to is refused in one ``error:`` line: runs whose configs
differ in a key no override names (two sweeps' runs mixed), runs that saw different numbers of tokens, a run
without an eval at its last step, a seed twice in one arm, a baseline that is not an arm.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ultrascale.errors import DataError, UltrascaleError
from ultrascale.report import overrides as ov
from ultrascale.report.load import load_run
from ultrascale.report.quality import tokens_per_step

SEED_KEY = "train.seed"
EVALS = {
    "fim/all/psm/middle_loss": "FIM middle loss, PSM (nats/token)",
    "fim/single_line/psm/exact_match": "single-line FIM exact match, PSM",
    "fim/all/l2r/middle_loss": "middle loss left to right (nats/token)",
    "infill/pass@1": "HumanEval-Infilling single-line pass@1",
}
"""The evaluations of an ablation's runs beside the held-out loss, by their ``eval_results.json`` key (task/metric),
each paired by seed as the loss is: what a FIM arm is also judged on (infilling), and the outside benchmark."""
INFILL_FLOOR = 0.0261
"""HumanEval-Infilling single-line pass@1 of empty completions (the lines whose removal leaves the tests passing):
the score a model that infills nothing gets, so a pass@1 is read against it."""
IGNORED = ("output_dir", "logger.run_name", "logger.wandb_group", "logger.wandb_name", "hydra")
"""Config keys that differ between the runs of any sweep by design (where each writes, what it is called)."""

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip
"""Student t's 97.5th percentile for 1 to 30 degrees of freedom (the two-sided 95 % multiplier)."""


def t975(df: int) -> float:
    """The two-sided 95 % Student t multiplier on ``df`` degrees of freedom (tabled to 30, then the Cornish-Fisher
    expansion around 1.96, within 0.001 of the exact value there)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom (got {df})")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass
class SeedRun:
    seed: int
    run_dir: str
    final_eval_loss: float
    tokens: int
    tokens_per_s: float | None
    curve: list[list[float]]
    """``[tokens, held-out loss]`` at each eval, in order (``data.eval_batches``' samples: one set throughout)."""
    evals: dict[str, float] = field(default_factory=dict)
    """The post-hoc evaluations of the run's last checkpoint (``python eval.py run_dir=RUN tasks=[fim,infill]``),
    :data:`EVALS` keys present in its newest ``eval/step_*/eval_results.json`` of that step."""
    final_eval_samples: int = 0
    """Held-out samples the final loss was read on: the whole split with ``data.final_eval_batches=0``, whose
    ``eval_loss_final`` it then is; else the last eval's ``eval_loss`` (the curve's last point)."""


@dataclass
class Arm:
    name: str
    overrides: list[str]
    runs: list[SeedRun] = field(default_factory=list)

    def by_seed(self) -> dict[int, SeedRun]:
        return {r.seed: r for r in self.runs}


@dataclass
class Comparison:
    arm: str
    n_pairs: int
    diff_mean: float | None
    ci95: list[float] | None
    detectable: float | None
    """The interval's half-width: the smallest mean difference these pairs could have told from zero."""
    diffs: dict[int, float]
    tokens_to_baseline_final: float | None
    """Mean over the pairs of (tokens the arm needed to reach its pair's baseline final loss) / (the baseline's
    tokens); None where a pair's arm never reached it."""
    reached: dict[int, float | None]
    evals: dict[str, dict] = field(default_factory=dict)
    """Per :data:`EVALS` key both arms have for every paired seed: ``diff_mean``, ``ci95``, ``n_pairs``."""


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _seed(run_overrides: list[str], config: dict) -> int:
    for o in run_overrides:
        if _key(o) == SEED_KEY:
            return int(o.split("=", 1)[1])
    return int(((config.get("train") or {}).get("seed")) or 0)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _named_by(key: str, axes: set[str]) -> bool:
    """Whether a config key is one an axis sets: ``optim.lr`` by ``optim.lr=...``, anything under ``optim.`` by the
    group choice ``optim=muon``."""
    return any(key == a or key.startswith(a + ".") for a in axes) or key.split(".")[0] in IGNORED or key in IGNORED


def _crossing(curve: list[list[float]], target: float) -> float | None:
    """The tokens at which a held-out curve first reaches ``target`` (linear between evals), None if it never does."""
    for i, (t, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return t
            t0, l0 = curve[i - 1]
            return t0 + (l0 - target) / (l0 - loss) * (t - t0)
    return None


def load_sweep(sweep_dirs: str | Path | Sequence[str | Path]) -> list[Arm]:
    """The sweep's arms, each with its seeds' runs; DataError for anything the comparison cannot stand on. Several
    sweep directories are read as one sweep: a baseline run once and compared with each arm swept on its own."""
    dirs = [Path(sweep_dirs)] if isinstance(sweep_dirs, (str, Path)) else [Path(d) for d in sweep_dirs]
    jobs = []
    for sweep_dir in dirs:
        found = ov.job_dirs(sweep_dir)
        if not found:
            raise DataError(f"{sweep_dir}: no sweep jobs here (no */.hydra/overrides.yaml): pass a `train.py -m` "
                            "run's hydra.sweep.dir")  # fmt: skip
        jobs += found
    typed = {d: ov.read(d) for d in jobs}
    differ = ov.differing(typed)
    axes = {_key(o) for v in differ.values() for o in v}
    runs = {d: load_run(d) for d in jobs}
    _same_config_but_the_axes(runs, axes)
    _same_tokens(runs)
    arms: dict[str, Arm] = {}
    for d in jobs:
        run = runs[d]
        named = [o for o in differ[d] if _key(o) != SEED_KEY]
        name = " ".join(named) or "(none)"
        arm = arms.setdefault(name, Arm(name, named))
        seed = _seed(typed[d], run.config)
        if seed in arm.by_seed():
            raise DataError(f"arm {name!r} has seed {seed} twice ({arm.by_seed()[seed].run_dir} and {d}): a sweep's "
                            "arms differ in their overrides, and an arm's runs in their seed only")  # fmt: skip
        arm.runs.append(_seed_run(d, run, seed))
    return list(arms.values())


def _same_config_but_the_axes(runs: dict, axes: set[str]) -> None:
    flat = {d: _flat(r.config) for d, r in runs.items()}
    first = next(iter(flat))
    for d, cfg in flat.items():
        for key in sorted(set(cfg) | set(flat[first])):
            if _named_by(key, axes):
                continue
            if cfg.get(key) != flat[first].get(key):
                raise DataError(
                    f"{first.name} and {d.name} differ in {key} ({flat[first].get(key)!r} vs {cfg.get(key)!r}), which "
                    f"no override of the sweep names (its axes: {', '.join(sorted(axes)) or 'none'}): the runs are "
                    "not one sweep's; compare a sweep whose jobs differ only in what it sweeps"
                )


def _same_tokens(runs: dict) -> None:
    tokens = {d: r.summary.get("tokens") for d, r in runs.items()}
    if len(set(tokens.values())) > 1:
        shown = ", ".join(f"{d.name}: {t if t is not None else 'unknown'}" for d, t in tokens.items())
        raise DataError(f"the runs saw different numbers of tokens ({shown}): arms compare at equal tokens; set "
                        "train.tokens (or train.steps) alike for every job")  # fmt: skip


def _seed_run(d: Path, run, seed: int) -> SeedRun:
    evals = run.eval_curve()
    last_step = run.summary.get("steps") or (run.curve()[-1]["step"] if run.curve() else None)
    if not evals or last_step is None or evals[-1]["step"] != last_step:
        where = f"its last is at step {evals[-1]['step']}" if evals else "it has none"
        raise DataError(f"{d}: no held-out eval at its last step ({last_step}; {where}): an unfinished run, or "
                        "train.eval_interval that does not land on train.steps; the final loss is that eval's")  # fmt: skip
    per_step = tokens_per_step(run)
    curve = [[float(e["step"] * per_step), float(e["eval_loss"])] for e in evals]
    tps = run.summary.get("tokens_per_s")
    final = evals[-1].get("eval_loss_final", evals[-1]["eval_loss"])  # data.final_eval_batches: a larger sample
    return SeedRun(seed, str(d), float(final), int(run.summary.get("tokens") or last_step * per_step),
                   float(tps) if tps is not None else None, curve, _post_hoc(d, int(last_step)),
                   int(evals[-1].get("eval_samples_final") or evals[-1].get("eval_samples") or 0))  # fmt: skip


def _post_hoc(run_dir: Path, step: int) -> dict[str, float]:
    """:data:`EVALS` found in the run's ``eval/*/eval_results.json`` of its last step (newest file first)."""
    import json

    found: dict[str, float] = {}
    files = sorted(run_dir.glob("eval/*/eval_results.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for f in files:
        try:
            res = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{f}: not readable JSON ({e}): re-run its eval or remove it") from None
        if res.get("step") != step:
            continue
        for key in EVALS:
            task, metric = key.split("/", 1)
            v = (res.get("tasks") or {}).get(task, {}).get(metric)
            if isinstance(v, (int, float)) and key not in found:
                found[key] = float(v)
    return found


def baseline_arm(arms: list[Arm], baseline: str | None) -> Arm:
    """The arm named ``baseline`` (its full name, or one of its overrides); the first arm without one."""
    if baseline is None:
        return arms[0]
    want = baseline.lower()  # Hydra records a swept true as True: the user types either
    found = [a for a in arms if want == a.name.lower() or want in (o.lower() for o in a.overrides)]
    if len(found) != 1:
        names = "; ".join(a.name for a in arms)
        why = "is not an arm" if not found else f"names {len(found)} arms"
        raise DataError(f"--baseline {baseline} {why} of this sweep: its arms are {names}")
    return found[0]


def compare(arm: Arm, base: Arm) -> Comparison:
    """The arm against the baseline, paired by seed."""
    a, b = arm.by_seed(), base.by_seed()
    seeds = sorted(set(a) & set(b))
    diffs = {s: a[s].final_eval_loss - b[s].final_eval_loss for s in seeds}
    mean, ci, half = paired(list(diffs.values()))
    evals = {}
    for key in EVALS:
        if seeds and all(key in a[s].evals and key in b[s].evals for s in seeds):
            m, c, _ = paired([a[s].evals[key] - b[s].evals[key] for s in seeds])
            evals[key] = {"diff_mean": m, "ci95": c, "n_pairs": len(seeds)}
    reached = {}
    for s in seeds:  # on the curve's own sample set: the baseline's last point, not its whole-split final loss
        t = _crossing(a[s].curve, b[s].curve[-1][1])
        reached[s] = None if t is None else t / b[s].tokens
    ratios = list(reached.values())
    to_final = statistics.fmean(ratios) if ratios and None not in ratios else None
    return Comparison(arm.name, len(seeds), mean, ci, half, diffs, to_final, reached, evals)


def paired(diffs: list[float]) -> tuple[float | None, list[float] | None, float | None]:
    """(mean, Student t 95 % interval, its half-width) of seed-paired differences; no interval from one pair."""
    if not diffs:
        return None, None, None
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, None, None
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, [mean - half, mean + half], half


def report(sweep_dir: str | Path | Sequence[str | Path], baseline: str | None = None) -> dict:
    """The ablation as the JSON ``--json`` writes: the baseline, each arm's runs, each comparison."""
    arms = load_sweep(sweep_dir)
    base = baseline_arm(arms, baseline)
    dirs = [sweep_dir] if isinstance(sweep_dir, (str, Path)) else list(sweep_dir)
    return {
        "sweep_dir": str(dirs[0]),
        "sweep_dirs": [str(d) for d in dirs],
        "baseline": base.name,
        "arms": {a.name: {"overrides": a.overrides, "runs": [asdict(r) for r in a.runs]} for a in arms},
        "comparisons": [asdict(compare(a, base)) for a in arms if a is not base],
    }


def _fmt(v: float | None, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict) -> str:
    """The report's table: one row per arm (the baseline first), with its comparison."""
    comps = {c["arm"]: c for c in result["comparisons"]}
    names = [result["baseline"], *(n for n in result["arms"] if n != result["baseline"])]
    head = ["arm", "seeds", "final held-out loss", "tokens/s", "diff vs baseline [95% CI]", "detectable",
            "tokens to baseline's final"]  # fmt: skip
    rows = [head]
    for n in names:
        runs = result["arms"][n]["runs"]
        losses = [r["final_eval_loss"] for r in runs]
        spread = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
        tps = [r["tokens_per_s"] for r in runs if r["tokens_per_s"] is not None]
        row = [n + (" (baseline)" if n == result["baseline"] else ""), str(len(runs)),
               f"{statistics.fmean(losses):.4f}{spread}", f"{statistics.fmean(tps):,.0f}" if tps else "-"]  # fmt: skip
        c = comps.get(n)
        if c is None:
            row += ["", "", ""]
        else:
            ci = f" [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]" if c["ci95"] else " (one pair: no interval)"
            ttf = c["tokens_to_baseline_final"]
            row += [f"{_fmt(c['diff_mean'], '+.4f')}{ci} ({c['n_pairs']} pairs)", _fmt(c["detectable"]),
                    "not reached" if ttf is None else f"{ttf:.2f}x"]  # fmt: skip
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def eval_table(result: dict) -> str:
    """The post-hoc evaluations, one row per (metric, arm) where every run of the arm has it: mean ± sd over seeds
    and, against the baseline, the paired difference with its interval. Empty when no run was evaluated."""
    comps = {c["arm"]: c for c in result["comparisons"]}
    names = [result["baseline"], *(n for n in result["arms"] if n != result["baseline"])]
    rows = [["evaluation", "arm", "seeds", "mean", "diff vs baseline [95% CI]"]]
    for key, label in EVALS.items():
        for n in names:
            vals = [r["evals"].get(key) for r in result["arms"][n]["runs"]]
            if not vals or None in vals:
                continue
            spread = f" ± {statistics.stdev(vals):.4f}" if len(vals) > 1 else ""
            c = (comps.get(n) or {}).get("evals", {}).get(key)
            diff = ""
            if c:
                ci = f" [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]" if c["ci95"] else ""
                diff = f"{c['diff_mean']:+.4f}{ci} ({c['n_pairs']} pairs)"
            floor = f" (empty completions: {INFILL_FLOOR})" if key == "infill/pass@1" else ""
            rows.append([label + floor, n, str(len(vals)), f"{statistics.fmean(vals):.4f}{spread}", diff])
    if len(rows) == 1:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(result: dict, out: str | Path) -> Path:
    """Left: held-out loss against tokens, each arm's mean over its seeds, the seeds' range shaded. Right: each
    arm's seed-paired difference from the baseline along the curve (mean, the pairs' range shaded), where an
    effect smaller than the seeds' spread shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ultrascale.atomic import atomic_write_bytes

    fig, (ax, dax) = plt.subplots(1, 2, figsize=(13, 5))
    base = {r["seed"]: r["curve"] for r in result["arms"][result["baseline"]]["runs"]}
    for name, arm in result["arms"].items():
        curves = [r["curve"] for r in arm["runs"]]
        xs = [p[0] for p in curves[0]]
        label = name + (" (baseline)" if name == result["baseline"] else "")
        if all([p[0] for p in c] == xs for c in curves):
            ys = list(zip(*([p[1] for p in c] for c in curves)))
            (line,) = ax.plot(xs, [statistics.fmean(y) for y in ys], label=f"{label}, {len(curves)} seed(s)")
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2)
        else:  # evals at other tokens per seed: each seed's own line
            for i, c in enumerate(curves):
                (line,) = ax.plot([p[0] for p in c], [p[1] for p in c], lw=1, label=label if i == 0 else None)
        pairs = [(r["curve"], base[r["seed"]]) for r in arm["runs"] if r["seed"] in base]
        same = [(c, b) for c, b in pairs if [p[0] for p in c] == [p[0] for p in b]]
        if name == result["baseline"]:
            dax.axhline(0.0, color=line.get_color(), lw=1, label=f"{label}")
        elif same:
            xs = [p[0] for p in same[0][0]]
            ds = list(zip(*([a[1] - b[1] for a, b in zip(c, bc)] for c, bc in same)))
            dax.plot(
                xs, [statistics.fmean(d) for d in ds], color=line.get_color(), label=f"{name}, {len(same)} pair(s)"
            )
            dax.fill_between(xs, [min(d) for d in ds], [max(d) for d in ds], color=line.get_color(), alpha=0.2)
    dax.set_xlabel("tokens trained")
    dax.set_ylabel("held-out loss, arm - baseline (same seed)")
    dax.grid(alpha=0.3)
    dax.legend(fontsize=8)
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"ablation: {' + '.join(Path(d).name for d in result.get('sweep_dirs', [result['sweep_dir']]))}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(Path(out), buf.getvalue())
    return Path(out)


def wandb_settings(result: dict) -> dict | None:
    """``wandb.init`` keywords for the ablation's own run, from its runs' logger config (the first run's project
    and mode); None when no run logged to wandb (the report does not start it for a sweep that did not use it)."""
    from omegaconf import OmegaConf

    for arm in result["arms"].values():
        for r in arm["runs"]:
            cfg_path = Path(r["run_dir"]) / "config.yaml"
            logger = OmegaConf.load(cfg_path).get("logger") if cfg_path.exists() else None
            if logger and logger.get("wandb") and logger.get("wandb_mode") != "disabled":
                return {"project": str(logger.get("wandb_project") or "ultrascale"),
                        "mode": str(logger.get("wandb_mode") or "offline")}  # fmt: skip
    return None


def log_wandb(result: dict, settings: dict, figure: Path | None) -> str:
    """The table (one row per arm) and the figure, as one wandb run of ``job_type=ablation`` named after the sweep,
    its files under the sweep directory; returns where it went."""
    import os

    os.environ.setdefault("WANDB_SILENT", "true")  # the report's own lines say where it went
    import wandb

    sweep = Path(result["sweep_dir"])
    run = wandb.init(job_type="ablation", name=f"ablation:{sweep.name}", dir=str(sweep), reinit="finish_previous",
                     config={"baseline": result["baseline"], "arms": list(result["arms"])}, **settings)  # fmt: skip
    comps = {c["arm"]: c for c in result["comparisons"]}
    cols = ["arm", "seeds", "final_eval_loss_mean", "diff_mean", "ci95_lo", "ci95_hi", "tokens_to_baseline_final"]
    rows = []
    for name, arm in result["arms"].items():
        c = comps.get(name) or {}
        ci = c.get("ci95") or [None, None]
        losses = [r["final_eval_loss"] for r in arm["runs"]]
        rows.append([name, len(losses), statistics.fmean(losses), c.get("diff_mean"), ci[0], ci[1],
                     c.get("tokens_to_baseline_final")])  # fmt: skip
    payload: dict[str, Any] = {"ablation/table": wandb.Table(columns=cols, data=rows)}
    if figure is not None:
        payload["ablation/figure"] = wandb.Image(str(figure))
    run.log(payload)
    where = str(run.dir)
    run.finish()
    return where


def parser() -> Any:
    """The command line (its own function: the recipe-header test parses the commands users copy with it)."""
    from ultrascale.argv import ArgParser

    ap = ArgParser(prog="python -m ultrascale.report.ablation", description=__doc__)
    ap.add_argument("sweep_dir", type=Path, nargs="+", help="a `train.py -m` sweep's hydra.sweep.dir; several are read "
                                                           "as one sweep (a baseline swept once, each arm on its own)")  # fmt: skip
    ap.add_argument("--baseline", help="the baseline arm: its name or one of its overrides, e.g. optim=adamw "
                                       "(default: the first arm)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the report here (arms, runs, curves, comparisons)")
    ap.add_argument("--plot", type=Path, help="write held-out loss against tokens here (PNG)")
    ap.add_argument("--no-wandb", action="store_true", help="do not log the table and figure to wandb (by default "
                                                             "they go to a run of the runs' project and mode when the "
                                                             "runs logged to wandb)")  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> int:
    from ultrascale.jsonio import write_json

    a = parser().parse_args(argv)
    try:
        result = report(a.sweep_dir, a.baseline)
        print(table(result))
        if evals := eval_table(result):
            print("\n" + evals)
        if a.json:
            write_json(a.json, result)
            print(f"wrote {a.json}")
        if a.plot:
            print(f"wrote {plot(result, a.plot)}")
        settings = None if a.no_wandb else wandb_settings(result)
        if settings is not None:
            print(f"wandb ({settings['mode']}): {log_wandb(result, settings, a.plot)}")
    except UltrascaleError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
