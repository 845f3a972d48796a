"""A Hydra sweep's job directories and what tells them apart: the overrides not every job shares.

The sweep summary (``launch/sweep.py``) and the ablation report (``report/ablation.py``) both name a job by the
overrides that differ from the other jobs of its sweep; the reading lives here, below both, so the report does not
import the launcher above it.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

OVERRIDES = Path(".hydra") / "overrides.yaml"
"""Where Hydra records a job's command-line overrides, relative to the job's directory."""


def job_dirs(sweep_dir: str | Path) -> list[Path]:
    """The sweep's job directories (those Hydra recorded overrides for), numbered ones in number order, then the
    ones named by ``hydra.sweep.subdir`` (e.g. ``${hydra.job.override_dirname}``) by name."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    dirs = [d for d in sweep_dir.iterdir() if (d / OVERRIDES).is_file()]
    return sorted(dirs, key=lambda d: (0, int(d.name), "") if d.name.isdigit() else (1, 0, d.name))


def read(job_dir: Path) -> list[str]:
    """The job's overrides as typed (``key=value``), in Hydra's order."""
    return [str(o) for o in OmegaConf.load(job_dir / OVERRIDES)]


def differing(overrides: dict[Path, list[str]]) -> dict[Path, list[str]]:
    """Each job's overrides less the ones every job of the sweep has: what names it among the others."""
    common = set.intersection(*(set(v) for v in overrides.values())) if overrides else set()
    return {d: [o for o in v if o not in common] for d, v in overrides.items()}
