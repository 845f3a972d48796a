"""The end-of-run record (``summary.json``): layout, replica agreement, the frozen base's digest, stability
counters, the data mixture as read and, if the run trained, its speed and losses. Collective (the replica check)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import psutil

from ultrascale.data import sources as data_sources
from ultrascale.levers import length
from ultrascale.model.moe import shard_report as moe_shard_report
from ultrascale.train.consistency import param_digest, replicas_agree

log = logging.getLogger("ultrascale")


@dataclass
class FitResult:
    """What the loop measured, for the end-of-run summary."""

    steps_run: int = 0
    last: dict = field(default_factory=dict)
    last_eval: dict | None = None
    tokens_per_s: list[float] = field(default_factory=list)
    loop_s: float = 0.0
    first_step_unix: float | None = None
    """Wall clock at the end of the first step (start-up, compile included, is what users wait through)."""
    end_step: int = 0
    """The optimizer step the loop ended at (the data step is this plus the data offset)."""
    stopped: str | None = None
    """What stopped the run before its last step (a signal's name or the STOP file), None when it finished."""


def run_summary(t: Any, res: FitResult) -> dict:
    """The end-of-run record: layout, replica agreement, stability counters and, if it trained, the numbers."""
    steps = t.cfg.train.steps
    out = {"steps": steps, "resumed_from": t.start_step, "world_size": t.topo.world,
           "topology": t.topo.as_dict(), "total_params": t.info.n_params,
           "trainable_params": t.info.n_params if t.info.n_trainable is None else t.info.n_trainable,
           "finetune": t.decisions.finetune.value}  # fmt: skip
    agree_, digests, groups = (replicas_agree(t.engine.module, t.engine.data_parallel_group)
                               if t.cfg.train.param_digest else (None, None, None))  # fmt: skip
    out.update(replicas_agree=agree_, param_digests=digests, replica_groups=groups)
    if agree_ is False:
        log.warning(f"data-parallel replicas hold different parameters: {digests}")
    if t.frozen_digest is not None:
        end = param_digest(t.engine.module, trainable=False)
        out.update(frozen_digest_start=t.frozen_digest, frozen_digest_end=end)
        if end != t.frozen_digest:
            log.warning(f"the frozen base changed during training ({t.frozen_digest} -> {end})")
    if t.moe is not None:  # expert shards differ by design; the rest must agree
        out.update(moe_shard_report(t.engine.module, t.engine.data_parallel_group))
    out.update(tokens=length.tokens_at(t.history, res.end_step), asked_tokens=length.record(t.cfg)["tokens"])
    out.update(t.stability.counters(), data_offset=t.data_offset, mfu_peak=t.peak_src,
               mem_gb_is=t.memory.kind, complete=res.stopped is None)  # fmt: skip
    data_step = res.end_step + t.data_offset
    if data_sources.is_mixture(t.cfg.data):  # realized shares over every sample read, from step 0
        out.update(data_mix=t.mixture.mix(data_step), data_cursors=t.data_cursors(data_step),
                   data_epochs={n: round(float(e), 4) for n, e in zip(t.mixture.names,
                                                                      t.mixture.epochs(data_step))})  # fmt: skip
    if t.cfg.grpo is not None:
        out.update(t.grpo_summary(res.end_step))
    if res.stopped:
        out["stopped_by"] = res.stopped
    if res.first_step_unix is not None:  # from the process's creation, as the launcher started it
        started = psutil.Process().create_time()
        out.update(first_step_unix=res.first_step_unix, time_to_first_step_s=res.first_step_unix - started)
    if res.steps_run and res.last_eval is not None:
        tps = res.tokens_per_s
        out.update(final_loss=res.last["loss"], eval_loss=res.last_eval["eval_loss"],
                   eval_perplexity=res.last_eval["eval_perplexity"],
                   tokens_per_s=sum(tps) / len(tps) if tps else res.last["tokens_per_s"],
                   wall_tokens_per_s=t.tokens_per_step * (res.steps_run - 1) / res.loop_s if res.loop_s else None,
                   mfu=res.last["mfu"], mem_gb=max(t.memory.run_peak_gb, t.memory.peak_gb()))  # fmt: skip
    return out
