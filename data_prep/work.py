"""The ``_work/`` directory: where each stage keeps its units, and the context a stage task runs in.

A stage's outputs live in ``_work/NN_<stage>/``; unit ``u`` (a bucket, a partition, a shard) is finished
when ``unit_NNNNN.json`` (its stats) exists, written after its other files. The map's outputs depend on
its task count (it shards the input), so they live in ``_work/00_map_t<tasks>/``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.config import DataPrepConfig
from ultrascale.jsonio import read_json

# Stage -> what its tasks are partitioned over. The order is the chain's.
WHERE = {
    "map": "input files",
    "license": "repository key ranges",
    "signatures": "document buckets",
    "near_dedup": "dedup key partitions",
    "cluster": "one task (pairs only)",
    "split": "one task (repository sizes, streamed)",
    "clean": "document buckets, and one task training the tokenizer",
    "tokenize": "document buckets",
    "pack": "output shards",
    "finalize": "one task (stats)",
}
STAGES = tuple(WHERE)


def crash_hook(point: str) -> None:
    """Fault injection for the resume tests: ``DATA_PREP_CRASH_AT=point`` SIGKILLs this run here.

    The whole process group dies, like a job killed by Slurm (datatrove's Manager and pool workers must not
    outlive it), when this process leads it or when the leader said so (``DATA_PREP_CRASH_PGID``), as the
    orchestrator of a test run does before it starts worker processes.
    """
    if os.environ.get("DATA_PREP_CRASH_AT") != point:
        return
    marker = os.environ.get("DATA_PREP_CRASH_ONCE")  # a file: fire once (a Ray retry must not die again)
    if marker:
        if os.path.exists(marker):
            return
        open(marker, "w").close()
    pg = os.getpgid(0)
    if pg == os.getpid() or os.environ.get("DATA_PREP_CRASH_PGID") == str(pg):
        os.killpg(pg, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def stage_stats(docs_in: int = 0, docs_out: int = 0, bytes_in: int = 0, bytes_out: int = 0, **dropped) -> dict:
    return {"docs_in": docs_in, "docs_out": docs_out, "bytes_in": bytes_in, "bytes_out": bytes_out, "dropped": dropped}


def add_stats(total: dict, part: dict) -> dict:
    """Sum two stage-stat dicts (per-unit stats merge into the stage's)."""
    for k in ("docs_in", "docs_out", "bytes_in", "bytes_out"):
        total[k] += part[k]
    for k, v in part["dropped"].items():
        total["dropped"][k] = total["dropped"].get(k, 0) + v
    return total


def nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


class Work:
    """Paths under ``<output_dir>/_work`` (and the output directory itself)."""

    def __init__(self, cfg: DataPrepConfig):
        self.out = Path(cfg.output_dir)
        self.root = self.out / "_work"
        self.map_tasks = cfg.executor.tasks

    def dir(self, stage: str) -> Path:
        if stage == "map":
            return self.root / f"00_map_t{self.map_tasks}"
        return self.root / f"{STAGES.index(stage):02d}_{stage}"

    def logs(self, stage: str, tasks: int) -> Path:
        return self.root / "logs" / f"{STAGES.index(stage):02d}_{stage}_t{tasks}"

    def unit_stats(self, stage: str, unit: int) -> Path:
        return self.dir(stage) / f"unit_{unit:05d}.json"

    def unit_done(self, stage: str, unit: int) -> bool:
        return self.unit_stats(stage, unit).exists()

    def read_unit(self, stage: str, unit: int) -> dict:
        return read_json(self.unit_stats(stage, unit))

    def map_task(self, rank: int) -> Path:
        return self.dir("map") / f"r{rank:05d}"

    def bucket(self, stage: str, b: int, suffix: str) -> Path:
        return self.dir(stage) / f"b{b:05d}{suffix}"

    def part(self, stage: str, p: int, suffix: str = "") -> Path:
        return self.dir(stage) / f"p{p:05d}{suffix}"


@dataclass
class Ctx:
    """What a stage task knows: the config, the paths, its rank, and objects it builds once per task."""

    cfg: DataPrepConfig
    work: Work
    rank: int = 0
    world: int = 1
    progress: bool = False
    cache: dict = field(default_factory=dict)

    def once(self, name: str, build):
        """``build()`` the first time a task asks for ``name`` (a tokenizer, the benchmark n-grams, a table)."""
        if name not in self.cache:
            self.cache[name] = build()
        return self.cache[name]
