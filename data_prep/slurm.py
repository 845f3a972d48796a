"""The stage chain on Slurm: one datatrove ``SlurmPipelineExecutor`` per stage, each depending on the one before.

With ``sbatch`` on PATH (and ``executor.submit=true``) datatrove submits the whole chain: launching the last
executor launches its dependencies first and passes each job id on as ``--dependency=afterok:<id>``.
Without it, the same chain is rendered: datatrove writes every stage's pickled executor and launch script
as it would, the sbatch calls it would make are recorded instead of run, and ``_work/slurm/submit.sh``
replays them in order with the real job ids. datatrove has no dry run, so recording is done by standing in
for its one function that shells out to ``sbatch``.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path

from data_prep.config import DataPrepConfig
from data_prep.stages import Stage, chain
from data_prep.work import Work


def build_chain(cfg: DataPrepConfig) -> list:
    """One executor per stage in run order; each ``depends=`` the previous."""
    from datatrove.executor import SlurmPipelineExecutor

    ex, work = cfg.executor, Work(cfg)
    activate = Path(sys.prefix) / "bin" / "activate"
    execs, prev = [], None
    for stage, tasks in chain(cfg):
        prev = SlurmPipelineExecutor(
            [Stage(stage, cfg, False)],
            tasks=tasks,
            workers=ex.workers if ex.workers > 1 else -1,  # 1 means in-process locally, not one job at a time
            time=ex.time,
            partition=ex.partition,
            cpus_per_task=ex.cpus_per_task,
            mem_per_cpu_gb=ex.mem_per_cpu_gb,
            job_name=f"data_prep_{stage}",
            logging_dir=str(work.logs(stage, tasks)),
            slurm_logs_folder=str(work.root / "slurm_logs" / stage),
            venv_path=str(activate) if activate.exists() else None,
            depends=prev,
        )
        execs.append(prev)
    return execs


def render(execs: list, out_dir: Path) -> Path:
    """Let datatrove prepare every job of the chain, record its sbatch calls, and write ``submit.sh``."""
    import datatrove.executor.slurm as dt_slurm

    out_dir.mkdir(parents=True, exist_ok=True)
    calls: list[tuple[str, list[str], Path]] = []

    def record(contents: str, _retriever, *args: str) -> str:
        name = m.group(1) if (m := re.search(r"--job-name=(\S+)", contents)) else "merge_stats"
        if "merge_stats" in contents and "launch_pickled_pipeline" not in contents:
            name = f"{name}_merge_stats"
        # sbatch does not expand variables in #SBATCH lines: a dependency on a recorded job moves to the
        # command line (datatrove writes the stats merge's dependency into its script).
        moved = re.findall(r"^#SBATCH (--dependency=\S*\$J\d+\S*)\n", contents, flags=re.M)
        contents = re.sub(r"^#SBATCH --dependency=\S*\$J\d+\S*\n", "", contents, flags=re.M)
        args = (*args, *moved)
        script = out_dir / f"{len(calls):02d}_{name}.sbatch"
        script.write_text(contents)
        var = f"J{len(calls)}"
        calls.append((var, list(args), script))
        return f"${var}"

    saved = dt_slurm.launch_slurm_job
    dt_slurm.launch_slurm_job = record
    try:
        execs[-1].launch_job()
    finally:
        dt_slurm.launch_slurm_job = saved
    lines = ["#!/bin/bash", "# The data_prep stage chain, as datatrove would have submitted it.", "set -euo pipefail"]
    for var, args, script in calls:
        quoted = " ".join(a if "$" in a else shlex.quote(a) for a in args)
        lines.append(f'{var}=$(sbatch --parsable {quoted} {shlex.quote(str(script))} | cut -d";" -f1)')
        lines.append(f'echo "{script.name}: job ${var}"')
    submit = out_dir / "submit.sh"
    submit.write_text("\n".join(lines) + "\n")
    submit.chmod(0o755)
    return submit


def submit(cfg: DataPrepConfig) -> Path | None:
    """Submit the chain (returns None), or render it where ``sbatch`` is absent (returns ``submit.sh``)."""
    execs = build_chain(cfg)
    if cfg.executor.submit and shutil.which("sbatch"):
        execs[-1].launch_job()
        return None
    return render(execs, Work(cfg).root / "slurm")
