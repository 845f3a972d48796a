"""The comb report: where a run's time went, the largest stall in words, and a picture of it.

``write_report`` is what the trainer calls at the end of every run and what ``python -m ultrascale.report``
runs; it reads only ``metrics.jsonl`` (plus ``summary.json``/``config.yaml`` for the header when present), so
it works on a finished run, a killed one, or one still running.
"""

from __future__ import annotations

from pathlib import Path

from ultrascale.atomic import atomic_write_text
from ultrascale.report.analyze import Analysis, analyze
from ultrascale.report.load import Run, load_run
from ultrascale.report.markdown import render
from ultrascale.report.plot import plot

__all__ = [
    "Analysis",
    "Run",
    "analyze",
    "default_out_dir",
    "load_analyses",
    "load_run",
    "write_analyses",
    "write_report",
]


def _label(runs: list[Run]) -> None:
    """Distinct column names: the directory name, or more of the path where two runs share one."""
    names = [r.path.name for r in runs]
    if len(set(names)) == len(names):
        return
    for r in runs:
        r.label = "/".join(r.path.resolve().parts[-2:])
    if len({r.label for r in runs}) != len(runs):
        for r in runs:
            r.label = str(r.path)


def default_out_dir(run_dirs: list[Path]) -> Path:
    """One run: its own directory. Several: a ``compare_A_vs_B`` directory beside the first, so no run's own
    report is overwritten by a comparison."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0])
    return Path(run_dirs[0]).parent / ("compare_" + "_vs_".join(Path(d).name for d in run_dirs))


def write_report(run_dirs: list[Path], out_dir: Path | None = None) -> tuple[Path, Path]:
    """Write ``report.md`` and ``report.png`` for one run (or a side-by-side comparison of several).

    Raises DataError for a missing run directory or an unreadable ``metrics.jsonl``; returns both paths.
    """
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise ValueError("write_report needs at least one run directory")
    out = Path(out_dir) if out_dir is not None else default_out_dir(run_dirs)
    return write_analyses(load_analyses(run_dirs), out)


def load_analyses(run_dirs: list[Path]) -> list[Analysis]:
    runs = [load_run(d) for d in run_dirs]
    _label(runs)
    return [analyze(r) for r in runs]


def write_analyses(analyses: list[Analysis], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, png = out / "report.md", out / "report.png"
    title = "" if len(analyses) == 1 else " vs ".join(a.run.label for a in analyses)
    plot(analyses, png, title=title)
    atomic_write_text(md, render(analyses, png_name=png.name))
    return md, png
