"""The stage chain as datatrove pipeline steps: one :class:`Stage` per stage, run by any datatrove executor.

A task of a stage owns a contiguous range of the stage's units (``store.shard_units``): the map's unit is
its input shard; partitioned stages have ``buckets`` units; the pack stage one per output shard; single
steps one. A task skips units already finished (their stats exist), runs the rest, and writes a record of
its time and peak RSS. Task count and worker count therefore change how fast, never what.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from datatrove.pipeline.base import PipelineStep
from loguru import logger

from data_prep import doc_stages, split, tokens
from data_prep.config import DataPrepConfig, to_cfg
from data_prep.finalize import finalize_unit
from data_prep.store import shard_units
from data_prep.work import STAGES, Ctx, Work, crash_hook
from ultrascale.jsonio import write_json

log = logging.getLogger("data_prep")


def _cache_loguru_lib_dirs() -> None:
    """datatrove adds three loguru handlers per task (its task log), and each builds an exception formatter
    that recomputes sysconfig's paths for every install scheme: ~9 ms a task, 93 % of datatrove's own
    per-task cost in a cProfile of a 32-task run, and on 2 workers the gaps between tasks summed to 0.5-0.7 s
    a stage. The paths cannot change during a run, so compute them once (a no-op if loguru changes)."""
    try:
        from loguru._better_exceptions import ExceptionFormatter
    except ImportError:
        return
    compute = getattr(ExceptionFormatter, "_get_lib_dirs", None)
    if compute is None or hasattr(compute, "cache_info"):
        return
    cached = functools.lru_cache(maxsize=1)(compute)

    def lib_dirs() -> list[str]:
        return list(cached())  # a copy per formatter, as before

    lib_dirs.cache_info = cached.cache_info
    ExceptionFormatter._get_lib_dirs = staticmethod(lib_dirs)


_cache_loguru_lib_dirs()
if os.environ.get("DATA_PREP_QUIET_DATATROVE") == "1":
    # A local run prints one line per stage; datatrove's per-task console log (pipeline, stats) is for clusters.
    logger.disable("datatrove")


@dataclass(frozen=True)
class Spec:
    unit: Callable[[Ctx, int], dict]
    units: Callable[[Ctx], int]
    tasks: Callable[[DataPrepConfig], int]
    assign: Callable[[int, int, int], range | list[int]] = shard_units
    """(units, rank, world) -> the units task ``rank`` owns."""
    light: bool = False
    """One small task (pairs, repository sizes, stats): run locally in the orchestrating process even when
    there are workers, which saves starting a pool (~0.15 s) for a few ms of work."""


def _buckets(ctx: Ctx) -> int:
    return ctx.cfg.buckets


def _one(_) -> int:
    return 1


def _partitioned(cfg: DataPrepConfig) -> int:
    return min(cfg.executor.tasks, cfg.buckets)


def _all_tasks(cfg: DataPrepConfig) -> int:
    return cfg.executor.tasks


def _clean_unit(ctx: Ctx, u: int) -> dict:
    """Units 0..buckets-1 clean their bucket; unit ``buckets`` trains the tokenizer."""
    return tokens.tokenizer_unit(ctx, u) if u == ctx.cfg.buckets else doc_stages.clean_unit(ctx, u)


def _clean_assign(n: int, rank: int, world: int) -> list[int]:
    """Task 0 trains the tokenizer (the last unit) alone, first, so it overlaps the buckets' cleaning."""
    if world == 1:
        return [n - 1, *range(n - 1)]
    return [n - 1] if rank == 0 else list(shard_units(n - 1, rank - 1, world - 1))


SPECS: dict[str, Spec] = {
    "map": Spec(doc_stages.map_unit, lambda ctx: ctx.work.map_tasks, _all_tasks),
    "license": Spec(doc_stages.license_unit, _buckets, _partitioned),
    "signatures": Spec(doc_stages.signatures_unit, _buckets, _partitioned),
    "near_dedup": Spec(doc_stages.near_dedup_unit, _buckets, _partitioned),
    "cluster": Spec(doc_stages.cluster_unit, _one, _one, light=True),
    "split": Spec(split.split_unit, _one, _one, light=True),
    "clean": Spec(
        _clean_unit, lambda ctx: ctx.cfg.buckets + 1, lambda cfg: _partitioned(cfg) + 1, assign=_clean_assign
    ),
    "tokenize": Spec(tokens.tokenize_unit, _buckets, _partitioned),
    "pack": Spec(tokens.pack_unit, lambda ctx: len(tokens.pack_units(ctx)), _all_tasks),
    "finalize": Spec(finalize_unit, _one, _one, light=True),
}
assert tuple(SPECS) == STAGES


def chain(cfg: DataPrepConfig) -> list[tuple[str, int]]:
    """(stage, task count) in run order."""
    return [(s, SPECS[s].tasks(cfg)) for s in STAGES]


def stage_complete(cfg: DataPrepConfig, stage: str) -> bool:
    ctx = Ctx(cfg, Work(cfg))
    if stage == "pack" and not stage_complete(cfg, "tokenize"):
        return False
    return all(ctx.work.unit_done(stage, u) for u in range(SPECS[stage].units(ctx)))


def run_task(stage: str, cfg: DataPrepConfig, rank: int, world: int, progress: bool = False) -> dict:
    """Run task ``rank`` of ``world`` of ``stage``; returns its record (also written next to the stage's units)."""
    spec, work = SPECS[stage], Work(cfg)
    ctx = Ctx(cfg, work, rank, world, progress and stage == "map")
    work.dir(stage).mkdir(parents=True, exist_ok=True)
    start = time.time()
    n = spec.units(ctx)
    ran = []
    for u in spec.assign(n, rank, world):
        if work.unit_done(stage, u):
            continue
        write_json(work.unit_stats(stage, u), spec.unit(ctx, u), sort_keys=True)
        ran.append(u)
        if len(ran) == 1 and n > 1:
            crash_hook(stage)  # a kill with this stage part done (single steps have their own hook inside)
    end = time.time()
    record = {
        "stage": stage,
        "rank": rank,
        "world": world,
        "units": ran,
        "start": start,
        "end": end,
        "seconds": end - start,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pid": os.getpid(),
    }
    write_json(work.dir(stage) / f"task_t{world}_r{rank:05d}.json", record, sort_keys=True)
    log.info("%-10s task %d/%d: %d units in %.1f s", stage, rank + 1, world, len(ran), end - start)
    return record


class Stage(PipelineStep):
    """One data_prep stage as a datatrove step: the executor gives it (rank, world_size), it does its units."""

    type = "🏗 - DATA_PREP"

    def __init__(self, stage: str, cfg: DataPrepConfig, progress: bool = False):
        self.name = f"data_prep {stage}"
        super().__init__()
        self.stage, self.cfg, self.progress = stage, to_cfg(cfg), progress  # the dataclass pickles as is

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        rec = run_task(self.stage, self.cfg, rank, world_size, self.progress)
        self.stat_update("units", value=len(rec["units"]))
        yield from ()
