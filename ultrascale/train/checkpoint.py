"""Atomic checkpoints with auto-resume.

DeepSpeed writes a tag directory from every rank; a crash mid-save leaves a partial directory. We make
the save atomic at the level that matters: the ``latest`` pointer is replaced (``os.replace``) only
after every rank has finished writing and rank 0 has recorded the size of every file in
``ultrascale_meta.json``. Resume trusts ``latest``, then verifies the recorded files; a truncated or
half-deleted one is passed over for the newest older checkpoint that verifies (with a warning), and an
explicitly named one fails with the file's name instead of loading garbage. The same rule holds when the
files are written in the background (:mod:`ultrascale.train.ckpt_writer`): ``latest`` moves only once every
rank reports its write finished.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as tdist

from ultrascale.atomic import atomic_write_text
from ultrascale.cost.save_interval import AUTO_FIRST_SAVE_STEP, from_saves, node_mtbf, young_daly
from ultrascale.errors import CheckpointError
from ultrascale.levers import length
from ultrascale.runtime import dist
from ultrascale.train.ckpt_writer import BackgroundWriter
from ultrascale.train.rundir import LATEST, META, STOPPED

if TYPE_CHECKING:
    from ultrascale.config.root import RootConfig
    from ultrascale.train.loggers import MetricLogger
    from ultrascale.train.stop import StopRequest

log = logging.getLogger("ultrascale")
UNIVERSAL_SUFFIX = "_universal"
LAYOUT_DIR = ".staging_layout"
"""Where :meth:`Checkpointer.prestage`'s dry run points DeepSpeed (removed after it; nothing but directories and
DeepSpeed's recovery script lands there)."""
ROLLBACKS = "rollbacks.json"
"""Rollbacks taken since each checkpoint, keyed by its tag: written when the rollback happens, not with the
next checkpoint, so a crash in between still resumes past the skipped data window."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, ckpt_dir: Path, step: int, meta: dict, keep: int = 0, client: dict | None = None,
         writer: BackgroundWriter | None = None, write_delay: float = 0.0) -> Path:  # fmt: skip
    """Collective: every rank calls it. Returns the tag directory; without a ``writer`` it is complete and
    pointed to by ``latest`` on return, with one it is a snapshot being written (see :meth:`Checkpointer.flush`).

    ``client`` is trainer state that must travel with the weights (the data offset after a rollback, the
    stability counters); :func:`load` returns it.
    """
    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    t0 = time.perf_counter()
    if dist.is_rank0() and tag_dir.exists():  # a leftover partial save of the same step
        shutil.rmtree(tag_dir)
    dist.barrier()
    t1 = time.perf_counter()
    if writer is not None:
        writer.begin(step, write_delay)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={**(client or {}), "step": step}, save_latest=False,
                           exclude_frozen_parameters=has_frozen(engine))  # fmt: skip
    t2 = time.perf_counter()
    log.debug(f"save {tag}: barrier {t1 - t0:.2f}s, engine.save_checkpoint {t2 - t1:.2f}s"
              + (f" (snapshot {writer.snapshot_s:.2f}s of it)" if writer is not None else ""))  # fmt: skip
    rng = tag_dir / f"rng_state_rank{dist.rank():05d}.pt"
    if writer is not None:
        writer.put(str(rng), rng_state())
        writer.mark(step)
        return tag_dir
    torch.save(rng_state(), rng)
    dist.barrier()
    if dist.is_rank0():
        commit(ckpt_dir, tag_dir, {**meta, "step": step, "tag": tag}, keep)
    dist.barrier()
    return tag_dir


def has_frozen(engine) -> bool:
    """Whether the model has frozen parameters (``finetune=lora``'s base). They are left out of checkpoints: the
    base is rebuilt from ``model.pretrained_path`` at every start (its fingerprint is in the meta), so a
    checkpoint holds the adapters and their optimizer state only."""
    return any(not p.requires_grad for p in engine.module.parameters())


def exclude_every_frozen_name(engine) -> None:
    """DeepSpeed 0.19.8's ``module_state_dict(exclude_frozen_parameters=True)`` drops the names
    ``named_parameters()`` lists, which lists a tied weight once: a frozen tied head (``lm_head.weight``, the
    embedding under another name) stayed in every LoRA checkpoint, 113 MB of SmolLM2-135M's 183. Every name of a
    frozen tensor goes."""
    original = engine.module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters: bool = False, **kwargs):
        sd = original(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name, p in engine.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    sd.pop(name, None)
        return sd

    engine.module_state_dict = module_state_dict


def commit(ckpt_dir: Path, tag_dir: Path, meta: dict, keep: int) -> None:
    """Rank 0, once every rank's files are on disk: record each file's size, then point ``latest`` at the tag
    (both atomic replacements; ``latest`` last), then prune."""
    files = {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*")) if p.is_file()}
    atomic_write_text(tag_dir / META, json.dumps({**meta, "files": files}, indent=1))
    atomic_write_text(ckpt_dir / LATEST, tag_dir.name)
    if keep:
        _prune(ckpt_dir, keep)


INTERVAL_KEY = "checkpoint_interval"
"""The key of ``ultrascale_meta.json`` (and of the metrics event) that holds ``train.checkpoint_interval=auto``'s
interval and the figures it came from."""


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _secs(s: float) -> str:
    return f"{s:.3g} s" if s < 120 else f"{s / 60:.3g} min" if s < 7200 else f"{s / 3600:.3g} h"


class AutoInterval:
    """``train.checkpoint_interval=auto``: the interval the run measures on its first save, then keeps.

    The save after step :data:`~ultrascale.cost.save_interval.AUTO_FIRST_SAVE_STEP` (of the run, or of a resume
    from a checkpoint that records no interval) is measured: its stall, its write (waited for at once when it is in
    the background, so it is whole), the checkpoint's bytes and the median step after the first. Every rank takes
    the slowest rank's figures (saving is collective: the ranks must save at the same steps), and
    :func:`~ultrascale.cost.save_interval.from_saves` makes the interval, the dry run's arithmetic. The record
    travels in every later checkpoint's meta; a resume adopts it instead of measuring again."""

    def __init__(self, node_mtbf_h: float, mtbf_from: str, nodes: int, run_steps: int) -> None:
        self.node_mtbf_h, self.mtbf_from, self.nodes, self.run_steps = node_mtbf_h, mtbf_from, nodes, run_steps
        self.measure_at = AUTO_FIRST_SAVE_STEP
        self.record: dict | None = None
        self.kept_from: str | None = None
        """The checkpoint whose record a resume adopted (None: measured by this run, or not yet)."""
        self.known_at = 0
        """The step saved last when the interval became known: the measured save, or the checkpoint resumed."""
        self.step_times: list[float] = []

    @classmethod
    def for_run(cls, cfg: RootConfig) -> AutoInterval:
        """The MTBF the run states (``train.node_mtbf_hours``, its cluster's, or the default) and its node count,
        from the launcher: the ranks over the ranks on this node."""
        hours, source = node_mtbf(cfg.train.node_mtbf_hours, cfg.cluster)
        return cls(hours, source, -(-dist.world_size() // dist.local_world_size()), int(cfg.train.steps))

    def adopt(self, record: dict | None, step: int, tag: str) -> None:
        """A resume from checkpoint ``tag`` at ``step``: its recorded interval, or a measurement
        :data:`AUTO_FIRST_SAVE_STEP` steps on when it records none. Nothing changes once an interval is known."""
        if self.record is not None:
            return
        if record is None:
            self.measure_at = step + AUTO_FIRST_SAVE_STEP
            return
        self.record, self.kept_from, self.known_at = dict(record), tag, step

    def decide(self, step: int, every: list[tuple[float, float, float, float]]) -> dict:
        """The interval from every rank's (stall, write, step, bytes) of the save after ``step``: the slowest
        rank's of each, so all ranks compute the same."""
        stall, write, step_s, nbytes = (max(r[i] for r in every) for i in range(4))
        adv = from_saves(nbytes / self.nodes, stall, write, step_s, self.nodes, self.node_mtbf_h)
        first, self.known_at = self.measure_at - AUTO_FIRST_SAVE_STEP + 2, step
        self.record = {"steps": adv.interval_steps, "measured_after_step": step, "stall_s": round(stall, 4),
                       "write_s": round(write, 4), "step_s": round(step_s, 4),
                       "step_s_from": f"median of steps {first}-{step}", "bytes": int(nbytes), "nodes": self.nodes,
                       "node_mtbf_h": self.node_mtbf_h, "mtbf_from": self.mtbf_from, "job_mtbf_h": adv.mtbf_h,
                       "young_daly_s": round(young_daly(stall, adv.mtbf_h * 3600), 4), "interval_s": round(adv.interval_s, 4),
                       "save_share": adv.save_share, "rework_share": adv.rework_share}  # fmt: skip
        return self.record

    def plan(self) -> str:
        """The banner's line: what the run measures and when, or the interval a resume kept."""
        if self.record is not None:
            return self.describe(f"kept from {self.kept_from} (a resume keeps it)")
        return (f"checkpoint interval: auto: measured on the save after step {self.measure_at} (its stall, size and "
                f"write; the step time from the steps after the first), then Young/Daly with node MTBF "
                f"{self.node_mtbf_h:g} h ({self.mtbf_from}) over {self.nodes} node(s)")  # fmt: skip

    def describe(self, how: str = "") -> str:
        """The interval in steps and every figure it came from, and whether it falls inside this run."""
        r = self.record
        n, floor = r["steps"], max(r["young_daly_s"], r["write_s"], r["step_s"])
        line = (f"checkpoint interval: auto = {n} step(s){', ' + how if how else ''}: measured on the save after step "
                f"{r['measured_after_step']} (the slowest rank's figures): stall {r['stall_s']:.3g} s, write "
                f"{r['write_s']:.3g} s, {_size(r['bytes'])} ({_size(r['bytes'] / r['nodes'])} per node), step "
                f"{r['step_s']:.3g} s ({r['step_s_from']}); job MTBF {_secs(r['job_mtbf_h'] * 3600)} = node MTBF "
                f"{r['node_mtbf_h']:g} h ({r['mtbf_from']}) / {r['nodes']} node(s); max(Young/Daly sqrt(2 x stall x "
                f"job MTBF) = {_secs(r['young_daly_s'])}, one write, one step) = {_secs(floor)} = {n} step(s): "
                f"~{100 * r['save_share']:.3g} % of the time in saves, ~{100 * r['rework_share']:.3g} % recomputing "
                "lost steps")  # fmt: skip
        upcoming = (self.known_at // n + 1) * n
        if upcoming > self.run_steps:
            return line + (f". The interval exceeds this run: its next save on it would follow step {upcoming:,}, "
                           f"past train.steps={self.run_steps}; the final save (train.final_save) and a stop's save "
                           "remain")  # fmt: skip
        return line + f"; saves after every multiple of {n} steps"


class Checkpointer:
    """Owns when the run saves (every ``interval`` steps and at its last step), what travels with it, and, with
    ``background``, the write that goes on while training continues (one in flight at a time): the snapshot, the
    wait for the write, the commit of ``latest`` and the stop protocol's final save, each booked in ``metrics``
    (set by the trainer once its logger exists)."""

    def __init__(self, ckpt_dir: Path, interval: int, keep: int, meta: dict, background: bool = False,
                 staging: str = "auto", auto: AutoInterval | None = None):  # fmt: skip
        self.ckpt_dir, self.interval, self.keep, self.meta = ckpt_dir, int(interval), int(keep), meta
        self.auto = auto
        """``train.checkpoint_interval=auto`` (``interval`` is then 0 until it is measured or adopted)."""
        self.background, self.staging = background, str(staging)
        self.writer: BackgroundWriter | None = None
        self.pending: tuple[int, Path, dict] | None = None
        self.last_saved = -1
        self.beat: Callable[[], None] | None = None
        """Called while waiting for a write (the stop watchdog's heartbeat)."""
        self.write_s = 0.0
        """Seconds the background thread spent writing the checkpoint committed last."""
        self._alloc_seen = 0.0
        self._prestaged = False
        self.metrics: MetricLogger | None = None

    def attach(self, engine) -> None:
        """Plug the background writer into the engine (after it is built, before any save)."""
        if has_frozen(engine):
            exclude_every_frozen_name(engine)
        if self.background:
            self.writer = BackgroundWriter(self.staging)
            engine.checkpoint_engine = self.writer

    def prestage(self, engine) -> float:
        """Collective. Pinned staging (CUDA) only, once: allocate and page-lock the staging buffers of every file
        a checkpoint writes now, by a dry run of DeepSpeed's save that copies and writes nothing
        (:meth:`~ultrascale.train.ckpt_writer.BackgroundWriter.layout_only`), so the first save only copies.
        Pinning a 1B model's 17 GB per rank takes seconds, which the first save's stall would otherwise hold.
        Called after the first step (the trainer), when the optimizer's moments exist (torch's Adam and DeepSpeed's
        create them at the first update), and by :meth:`save` if that has not happened. Returns the seconds taken.

        Pageable staging (CPU) keeps allocating at the first save: a dry run there would move those page faults
        to the first step without removing them, and CPU runs are not where the first minutes are scarce."""
        if self._prestaged or self.writer is None or self.writer.staging.mode != "pinned":
            return 0.0
        self._prestaged = True
        t0 = time.perf_counter()
        dry = self.ckpt_dir / LAYOUT_DIR
        with self.writer.layout_only():
            engine.save_checkpoint(str(dry), tag="layout", client_state={}, save_latest=False,
                                   exclude_frozen_parameters=has_frozen(engine))  # fmt: skip
        if dist.local_rank() == 0:  # save_checkpoint ends in a barrier: every rank is past the directory
            shutil.rmtree(dry, ignore_errors=True)
        st = self.writer.staging
        self._alloc_seen = st.allocate_s  # the first save's record counts only what that save allocated
        secs = time.perf_counter() - t0
        log.info(f"checkpoint staging: {st.nbytes / 1e9:.2f} GB allocated and page-locked before the first save "
                 f"in {secs:.1f}s")  # fmt: skip
        return secs

    def due(self, step: int, last_step: int) -> bool:
        """A save after ``step``: the last one's, each multiple of the interval's, and under ``auto`` before its
        interval is known, the measured one's."""
        if self.auto is not None and self.auto.record is None:
            return step in (last_step, self.auto.measure_at)
        return step == last_step or bool(self.interval and step % self.interval == 0)

    def observe_step(self, step_s: float) -> None:
        """A step's time, for ``auto``'s measurement (kept until it is made)."""
        if self.auto is not None and self.auto.record is None:
            self.auto.step_times.append(step_s)

    def _use(self, record: dict) -> None:
        self.interval = int(record["steps"])
        self.meta[INTERVAL_KEY] = record  # every later checkpoint carries it: a resume keeps it

    def measure_interval(self, step: int, stall_s: float, snapshot_end: float) -> None:
        """Collective, right after ``auto``'s measured save of ``step`` (``stall_s`` training waited for it;
        ``snapshot_end``: when its background write began). Wait for the write, size the checkpoint, agree on the
        slowest rank's figures, then save on the interval they give; the measured checkpoint records it too."""
        write_s = stall_s
        if self.writer is not None:
            self.writer.wait(self.beat)  # this rank's own write, before the barrier of the commit below
            write_s = time.perf_counter() - snapshot_end
        self.drain(step)
        tag_dir = self.ckpt_dir / tag_for(step)
        nbytes = float(sum(read_meta(tag_dir)["files"].values())) if dist.is_rank0() else 0.0
        times = self.auto.step_times[1:] or self.auto.step_times
        mine = (stall_s, write_s, statistics.median(times), nbytes)
        every = [mine]
        if tdist.is_initialized():
            every = [None] * tdist.get_world_size()
            tdist.all_gather_object(every, mine)
        record = self.auto.decide(step, every)
        self._use(record)
        if dist.is_rank0():  # the measured checkpoint is already `latest`: it records the interval too
            atomic_write_text(tag_dir / META, json.dumps({**read_meta(tag_dir), INTERVAL_KEY: record}, indent=1))
        log.info(self.auto.describe())
        self.metrics.event(step, INTERVAL_KEY, console=False, **record)

    def saved(self, step: int) -> bool:
        return self.last_saved == step

    def save(self, engine, step: int, client: dict, write_delay: float = 0.0) -> float:
        """Collective. ``client`` is trainer state restored by :func:`load` (the data offset, stability).
        Returns the seconds spent waiting for the previous background write (0 when it was done)."""
        waited = self.flush_wait()
        self.prestage(engine)
        meta = {**self.meta, "data_offset": client.get("data_offset", 0), "step": step, "tag": tag_for(step)}
        if "data_cursors" in client:  # the position in every source, checked by a resume before anything is built
            meta["data_cursors"] = client["data_cursors"]
        tag_dir = save(engine, self.ckpt_dir, step, meta, keep=self.keep, client=client, writer=self.writer,
                       write_delay=write_delay)  # fmt: skip
        self.last_saved = step
        if self.writer is not None:
            self.pending = (step, tag_dir, meta)
        return waited

    def save_step(self, engine, step: int, client: dict, delay: float = 0.0) -> None:
        """Save step ``step``: whole (``latest`` moves before this returns), or with ``background`` a snapshot that is
        written in the background and becomes ``latest`` once every rank has written it. ``checkpoint_s`` is what
        training waited either way (the stall the comb report shows); ``delay`` is a planted slow disk."""
        t0 = time.perf_counter()
        if not self.background:
            time.sleep(delay)
        waited = self.save(engine, step, client, write_delay=delay)
        snapshot_end = time.perf_counter()  # a background write starts here
        secs = snapshot_end - t0
        how = "snapshot taken, writing in the background" if self.background else "saved"
        log.info(f"checkpoint {tag_for(step)} {how} in {secs:.1f}s")
        self.metrics.event(step, "checkpoint", checkpoint_s=secs, wait_s=waited or None, console=False,
                           background=self.background or None, **self.staging_record())  # fmt: skip
        if self.auto is not None and self.auto.record is None and step == self.auto.measure_at:
            self.measure_interval(step, secs, snapshot_end)

    def restore(self, engine, tag_dir: Path, cfg: RootConfig, same_world: bool) -> tuple[int, int, list, dict]:
        """Collective. Load a checkpoint (engine, optimizer, RNG) with any rollback recorded since it. Returns its
        step, the data offset in this run's global batch, the batch history continued from it, and the stability
        state."""
        step, client = load(engine, tag_dir, same_world=same_world)
        client.update(rollback_since(tag_dir) or {})  # a rollback after this checkpoint was saved
        meta = read_meta(tag_dir)
        if self.auto is not None and self.auto.record is None:
            self.auto.adopt(meta.get(INTERVAL_KEY), step, _meta_dir(tag_dir).name)
            if self.auto.record is not None:
                self._use(self.auto.record)
        history = length.history_for(meta, cfg)
        # the offset counts steps of the batch that wrote it: another global batch goes on from the same sample
        from_gb = int(client.get("global_batch") or history[-1].global_batch)
        offset = length.convert_offset(step, int(client.get("data_offset", 0)), from_gb, cfg.data, tag_dir.name)
        return step, offset, length.continued(history, step, cfg.data), client.get("stability", {})

    def staging_record(self) -> dict:
        """For the checkpoint event of the save just taken: the staging mode, its host bytes, and the seconds of the
        stall that went to allocating (and pinning) buffers (the first save's; 0 once they are reused)."""
        if self.writer is None:
            return {}
        st = self.writer.staging
        alloc, self._alloc_seen = st.allocate_s - self._alloc_seen, st.allocate_s
        return {"staging": st.mode, "staging_gb": round(st.nbytes / 1e9, 4), "staging_alloc_s": round(alloc, 4),
                "snapshot_s": round(self.writer.snapshot_s, 4)}  # fmt: skip

    def written(self) -> int:
        """This rank's newest completely written background checkpoint (-1: none, or not writing in the
        background); raises if the write failed."""
        return self.writer.written() if self.writer is not None else -1

    def commit_written(self, agreed: int) -> Path | None:
        """Every rank passes the step all ranks agree they have written; when it covers the checkpoint in
        flight, rank 0 makes it ``latest`` (no collective: the agreement was the collective). Returns it."""
        if self.pending is None or agreed < self.pending[0]:
            return None
        _, tag_dir, meta = self.pending
        self.pending = None
        self.write_s = self.writer.take_write_s() if self.writer is not None else 0.0
        if dist.is_rank0():
            commit(self.ckpt_dir, tag_dir, meta, self.keep)
        return tag_dir

    def commit_agreed(self, step: int, agreed: int) -> None:
        """After step ``step``: a background checkpoint every rank has written (``agreed``, from the step's
        all-gather) becomes ``latest`` (rank 0 writes the pointer)."""
        done = self.commit_written(agreed)
        if done is not None:
            self.metrics.event(step, "checkpoint_written", checkpoint=done.name, write_s=self.write_s, console=False)

    def drain(self, step: int) -> None:
        """Collective: wait for a background write in flight and make it ``latest`` (before a rollback reads
        ``latest``, at a stop, and when the run ends). The wait is booked as checkpoint time."""
        t0 = time.perf_counter()
        done = self.flush()
        if done is not None:
            self.metrics.event(step, "checkpoint_written", checkpoint=done.name, write_s=self.write_s,
                               wait_s=time.perf_counter() - t0, console=False)  # fmt: skip

    def commit_stop(self, step: int, code: int, stop: StopRequest, run_dir: Path) -> str:
        """Every rank agreed to stop after step ``step``, which is saved: wait for its write, make it ``latest``,
        let the views go on, record the stop. Returns the stop's name."""
        self.drain(step)
        self.metrics.release()  # `latest` is step `step` now; the views may fail or stall without losing it
        self.record_stop(step, code, stop, run_dir)
        stop.settle()
        return stop.describe(code)

    def record_stop(self, step: int, code: int, stop: StopRequest, run_dir: Path) -> None:
        """The stop's event, and on rank 0 ``STOPPED`` in the run directory (the request file answered)."""
        name, tag_dir = stop.describe(code), self.latest()
        self.metrics.event(step, "stop", signal=name, checkpoint=tag_dir.name if tag_dir else None)
        if dist.is_rank0():
            record = {"signal": name, "step": step, "checkpoint": str(tag_dir) if tag_dir else None,
                      "time": time.time()}  # fmt: skip
            atomic_write_text(run_dir / STOPPED, json.dumps(record) + "\n")
            stop.consume_file()
        log.info(f"stopped by {name} after step {step}: checkpoint {tag_dir}; run the same command again to resume")

    def flush_wait(self) -> float:
        """Collective: wait for the write in flight on every rank, then commit it. Returns the seconds waited."""
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        self.writer.wait(self.beat)
        dist.barrier()
        self.commit_written(self.pending[0])
        dist.barrier()
        return time.perf_counter() - t0

    def flush(self) -> Path | None:
        """Collective: commit the checkpoint in flight, if any (the run's end, a stop, a rollback). Returns it."""
        tag = self.pending[1] if self.pending is not None else None
        self.flush_wait()
        return tag

    def latest(self) -> Path | None:
        pointer = self.ckpt_dir / LATEST
        return self.ckpt_dir / pointer.read_text().strip() if pointer.exists() else None


def complete_tags(ckpt_dir: Path) -> list[str]:
    return sorted(p.parent.name for p in ckpt_dir.glob(f"step_*/{META}") if not p.parent.name.endswith("_universal"))


def _prune(ckpt_dir: Path, keep: int) -> None:
    for tag in complete_tags(ckpt_dir)[:-keep]:
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        shutil.rmtree(ckpt_dir / (tag + UNIVERSAL_SUFFIX), ignore_errors=True)


def verify(tag_dir: Path) -> dict:
    """The checkpoint's meta, after checking every recorded file is present at its recorded size."""
    meta_path = tag_dir / META
    if not tag_dir.is_dir():
        raise CheckpointError(f"checkpoint {tag_dir} does not exist: check train.resume or the run's output_dir")
    if not meta_path.exists():
        raise CheckpointError(
            f"checkpoint {tag_dir} is incomplete (no {META}: its save was interrupted): "
            f"delete {tag_dir} and rerun to resume from the previous checkpoint"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(
            f"{meta_path} is corrupt: delete {tag_dir} and rerun to resume from an earlier one"
        ) from None
    for rel, size in meta.get("files", {}).items():
        f = tag_dir / rel
        if not f.exists():
            raise CheckpointError(
                f"checkpoint {tag_dir} is truncated: {rel} is missing: delete {tag_dir} (and fix "
                f"{tag_dir.parent / LATEST}) or restore the file"
            )
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {tag_dir} is truncated: {rel} has {f.stat().st_size} bytes, expected {size}: "
                f"delete {tag_dir} (and fix {tag_dir.parent / LATEST}) or restore the file"
            )
    return meta


def find_resume(ckpt_dir: Path, resume: str, universal: bool, skipped: list[str] | None = None) -> Path | None:
    """The tag directory to resume from, or None for a fresh start. Verifies it before returning.

    With ``resume=auto`` a ``latest`` that turns out truncated, incomplete or gone (a disk that filled up, a
    file deleted by hand) falls back to the newest older checkpoint that verifies: one bad checkpoint must not
    stop a run that has a good one. Each skipped checkpoint's reason is appended to ``skipped`` for the caller
    to warn with. An explicit path is never second-guessed.
    """
    if resume == "never":
        return None
    if resume != "auto":
        target = Path(resume)
        if (target / LATEST).exists():
            ckpt_dir, target = target, None
        elif not target.is_dir():
            raise CheckpointError(f"train.resume={resume}: no such checkpoint directory")
    else:
        target = None
    if target is None:
        latest = ckpt_dir / LATEST
        if not latest.exists():
            if resume != "auto":
                raise CheckpointError(f"train.resume={resume}: {latest} not found")
            return None
        target = ckpt_dir / latest.read_text().strip()
        if resume == "auto":
            target = _newest_that_verifies(ckpt_dir, target, skipped if skipped is not None else [])
    verify(target)
    if universal:
        uni = target.with_name(target.name + UNIVERSAL_SUFFIX)
        if not uni.is_dir():
            raise CheckpointError(
                f"train.universal_checkpoint=true but {uni} does not exist: run "
                f"`python -m ultrascale.train.checkpoint to_universal {target}` first"
            )
        return uni
    return target


def _newest_that_verifies(ckpt_dir: Path, latest: Path, skipped: list[str]) -> Path:
    """``latest`` if it verifies, else the newest older complete checkpoint that does (the reasons go to
    ``skipped``); when none does, ``latest``, whose error the caller then raises."""
    candidates = [latest, *(ckpt_dir / t for t in reversed(complete_tags(ckpt_dir)) if t < latest.name)]
    for tag_dir in candidates:
        try:
            verify(tag_dir)
            return tag_dir
        except CheckpointError as e:
            skipped.append(str(e).split(": delete ", 1)[0])
    return latest


def load(engine, tag_dir: Path, same_world: bool) -> tuple[int, dict]:
    """Collective. Loads weights and optimizer; restores this rank's RNG. Returns (step, client state)."""
    path, client = engine.load_checkpoint(
        str(tag_dir.parent),
        tag=tag_dir.name,
        load_optimizer_states=True,
        load_lr_scheduler_states=False,
        load_module_strict=not has_frozen(engine),  # a frozen base was left out of the save: it is already built
    )
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {tag_dir}: see the rank logs")
    client = dict(client or {})
    step = int(client.get("step", 0)) or int(read_meta(tag_dir)["step"])
    rng = _meta_dir(tag_dir) / f"rng_state_rank{dist.rank():05d}.pt"
    if same_world and rng.exists():
        set_rng_state(torch.load(rng, weights_only=False))
    return step, client


def record_rollback(ckpt_dir: Path, tag_dir: Path, state: dict, skipped: tuple[int, int]) -> None:
    """Rank 0: persist (atomically) the trainer state a rollback to ``tag_dir`` produced, with the data window
    ``[from, to)`` (data indices, i.e. step + offset) it skipped appended to the windows skipped before, so the
    file alone says which samples a resumed run will never read."""
    path = ckpt_dir / ROLLBACKS
    records = json.loads(path.read_text()) if path.exists() else {}
    before = records.get(_meta_dir(tag_dir).name, {}).get("skipped", [])
    records[_meta_dir(tag_dir).name] = {**state, "skipped": [*before, list(skipped)]}
    atomic_write_text(path, json.dumps(records, indent=1) + "\n")


def rollback_since(tag_dir: Path) -> dict | None:
    """The state of the newest rollback to ``tag_dir`` (None if the run never rolled back to it)."""
    path = _meta_dir(tag_dir).parent / ROLLBACKS
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text()).get(_meta_dir(tag_dir).name)
    except json.JSONDecodeError:
        raise CheckpointError(f"{path} is corrupt: delete it to resume without the rollbacks it records") from None


def read_meta(tag_dir: Path) -> dict:
    """The ``ultrascale_meta.json`` of a checkpoint (also for its universal twin)."""
    return json.loads((_meta_dir(tag_dir) / META).read_text())


def _meta_dir(tag_dir: Path) -> Path:
    name = tag_dir.name.removesuffix(UNIVERSAL_SUFFIX)
    return tag_dir.with_name(name)


def to_universal(tag_dir: str | os.PathLike) -> Path:
    """Convert a ZeRO checkpoint to DeepSpeed's universal format (resume on another world size)."""
    src = Path(tag_dir)
    verify(src)
    dst = src.with_name(src.name + UNIVERSAL_SUFFIX)
    cmd = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(src), "--output_folder", str(dst), "--inject_missing_state",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise CheckpointError(f"ds_to_universal failed for {src}: {tail[0]}")
    return dst


USAGE = "usage: python -m ultrascale.train.checkpoint to_universal RUN_DIR/checkpoints/step_XXXXXXXX"


if __name__ == "__main__":
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        print(f"{USAGE}\n\n{to_universal.__doc__} Resume from it with train.universal_checkpoint=true.")
        sys.exit(0)
    if len(sys.argv) != 3 or sys.argv[1] != "to_universal":
        sys.exit(f"error: expected `to_universal CHECKPOINT_DIR`, got {sys.argv[1:]} ({USAGE})")
    try:
        print(to_universal(sys.argv[2]))
    except CheckpointError as e:
        sys.exit(f"error: {e}")
