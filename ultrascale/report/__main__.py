"""``python -m ultrascale.report run_dir=DIR``: write report.md and report.png for a run (or compare runs)."""

from __future__ import annotations

import sys
from pathlib import Path

from ultrascale.errors import ConfigError, UltrascaleError

USAGE = """\
usage: python -m ultrascale.report run_dir=DIR [out=DIR]
       python -m ultrascale.report run_dir=[A,B] [out=DIR]

Reads DIR/metrics.jsonl (and summary.json, config.yaml when present) and writes report.md and
report.png: the step-time breakdown over time (the comb), the largest stall in words and where it
happens, tokens/s, MFU, memory, loss, and the run's events (checkpoints, evals, skips, rollbacks).

  run_dir=DIR      a run's output_dir, e.g. runs/cpu_smoke
  run_dir=[A,B]    compare runs side by side (or repeat run_dir=); the first is the baseline
  out=DIR          where to write (default: the run dir; for a comparison, compare_A_vs_B beside A)

The trainer writes the same report at the end of every run.
"""


def _list(value: str) -> list[str]:
    value = value.strip()
    if value.startswith("[") and value.endswith("]"):
        return [v.strip().strip("'\"") for v in value[1:-1].split(",") if v.strip()]
    return [value]


def parse_args(argv: list[str]) -> tuple[list[Path], Path | None]:
    run_dirs: list[Path] = []
    out = None
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not value:
            raise ConfigError(f"argument {arg!r} is not key=value: use run_dir=DIR [out=DIR] (see --help)")
        if key == "run_dir":
            run_dirs += [Path(v) for v in _list(value)]
        elif key == "out":
            out = Path(value)
        else:
            raise ConfigError(f"unknown argument {key!r} in {arg!r}: the keys are run_dir= and out= (see --help)")
    if not run_dirs:
        raise ConfigError("run_dir= is required: e.g. `python -m ultrascale.report run_dir=runs/cpu_smoke`")
    return run_dirs, out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE, end="")
        return 0
    from ultrascale.report import default_out_dir, load_analyses, write_analyses

    try:
        run_dirs, out = parse_args(argv)
        analyses = load_analyses(run_dirs)
        md, png = write_analyses(analyses, out if out is not None else default_out_dir(run_dirs))
    except UltrascaleError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {md}\n      {png}")
    for a in analyses:  # the headline is what a person runs this for
        if a.largest is not None:
            print(f"{a.run.path}: largest stall: {a.largest.sentence()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
