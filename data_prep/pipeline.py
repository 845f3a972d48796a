"""The pipeline: every stage is distributed through datatrove, and no process holds the corpus.

Stages, in run order (each a datatrove step, :mod:`data_prep.stages`; what each unit does is in
:mod:`data_prep.doc_stages`, :mod:`data_prep.split` and :mod:`data_prep.tokens`): map, license, signatures,
near_dedup, cluster, split, clean, tokenize, pack, finalize; what each owns and does: data_prep/README.md,
"Stages". Locally the stages run one after the other on datatrove's ``LocalPipelineExecutor`` (its pool without
the Manager process, :mod:`data_prep.local_executor`) or ``RayPipelineExecutor``; on Slurm they are one array
job each, each depending on the one before (:mod:`data_prep.slurm`). Partitions are fixed by ``buckets`` and
seeded hashes, never by the task count, and every random choice is a function of (seed, document id) or
(seed, split), so any task count writes the same bytes. Every unit's files are written atomically and its
stats last: a killed run resumes after the last finished unit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from data_prep.config import DataPrepConfig, ExecutorType, check, config_hash, to_cfg
from data_prep.local_executor import PoolExecutor
from data_prep.sources import resolve_input
from data_prep.stages import SPECS, Stage, chain, stage_complete
from data_prep.work import Work
from ultrascale.data.shards import MANIFEST
from ultrascale.errors import DataError

log = logging.getLogger("data_prep")

__all__ = ["config_hash", "run", "to_cfg"]


def _executor(cfg: DataPrepConfig, stage: str, tasks: int):
    ex, work = cfg.executor, Work(cfg)
    step = Stage(stage, cfg, ex.progress)
    logs = str(work.logs(stage, tasks))
    if ex.type == ExecutorType.ray:
        from data_prep.ray_cluster import executor

        # workers -1: as many at once as the cluster's CPUs take (each task reserves cpus_per_task)
        return executor([step], tasks, ex.workers, logs, ex.cpus_per_task, ex.mem_per_cpu_gb)
    # workers > 1: every task runs in a pool process (the tokenizer's single task too; only the light single
    # steps stay here), so this process stays small and the workers it forks start from it (fork: no
    # re-import of the entry point per worker, ~0.2 s a stage against ~0.5-1 s with spawn/forkserver).
    # One pool per stage: a stage's memory goes when it ends.
    wanted = tasks if ex.workers < 0 else ex.workers
    workers = 1 if wanted == 1 or SPECS[stage].light else min(wanted, max(tasks, 2))
    return PoolExecutor([step], tasks=tasks, workers=workers, logging_dir=logs, start_method="fork")


def run_stages(cfg: DataPrepConfig) -> None:
    """Run every unfinished stage in order on the local (or Ray) executor."""
    if os.environ.setdefault("DATA_PREP_QUIET_DATATROVE", "1") == "1":
        from loguru import logger

        logger.disable("datatrove")  # here; the pool workers read the variable when they import the stages
    for stage, tasks in chain(cfg):
        if stage_complete(cfg, stage):
            continue
        _executor(cfg, stage, tasks).run()
        if not stage_complete(cfg, stage):
            logs = Work(cfg).logs(stage, tasks)
            raise DataError(f"stage {stage} did not finish all its units: see {logs}/logs and re-run to resume")


def run(cfg) -> dict:
    """Prepare ``cfg.output_dir`` (resuming if possible); return the manifest. Idempotent for a finished run."""
    cfg = to_cfg(cfg)
    resolve_input(cfg)  # a missing input fails before anything is written
    check(cfg)
    out = Path(cfg.output_dir)
    h = config_hash(cfg)
    mpath = out / MANIFEST
    if mpath.exists():
        try:
            old = json.loads(mpath.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("config_hash") == h:
            log.info("%s is complete for this config (hash %s): nothing to do", out, h)
            return old
        mpath.unlink()  # a different config: the old dataset stops being complete right now
    if cfg.executor.type == ExecutorType.ray:  # joined before the first byte: a bad address writes nothing
        from data_prep.ray_cluster import connect, disconnect

        connect(cfg.executor.address)
        try:
            return _prepare(cfg, out, h)
        finally:
            disconnect()
    return _prepare(cfg, out, h)


def _prepare(cfg: DataPrepConfig, out: Path, h: str) -> dict:
    mpath = out / MANIFEST
    work = out / "_work"
    hfile = work / "config_hash"
    if work.exists() and (not hfile.exists() or hfile.read_text() != h):
        log.info("config changed: discarding %s", work)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    hfile.write_text(h)
    (work / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    if os.environ.get("DATA_PREP_CRASH_AT") and os.getpgid(0) == os.getpid():
        os.environ["DATA_PREP_CRASH_PGID"] = str(os.getpid())  # the resume tests' kill takes the workers too
    if cfg.executor.type == ExecutorType.slurm:
        from data_prep.slurm import submit

        script = submit(cfg)
        if script:
            log.info("no sbatch here (or executor.submit=false): wrote the job chain; submit it with `bash %s`", script)
        else:
            log.info("submitted the job chain to Slurm; %s appears when its last job finishes", mpath)
        return {}
    run_stages(cfg)
    manifest = json.loads(mpath.read_text())
    if not cfg.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return manifest
