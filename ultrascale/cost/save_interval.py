"""How often to checkpoint without killing throughput: Young/Daly from the save's cost and the job's MTBF.

A job on N nodes fails about N times as often as one node (MTBF_job = MTBF_node / N). Between checkpoints
every interval of training risks being recomputed, and each checkpoint costs the time training waits for it;
:func:`lost_share` is that first-order trade and :func:`young_daly` its optimum. With the background writer the
stall is the snapshot copy, not the write, so the interval shrinks; it cannot go below one write.

Pure arithmetic: the planner and the dry run pass in the byte counts and rates they estimate or measured;
:func:`from_saves` is the one function that turns a run's measured saves into an interval, for the dry run (a run's
metrics) and for ``train.checkpoint_interval=auto`` (its own first save) alike.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ultrascale.config.cluster import ClusterConfig

AUTO_FIRST_SAVE_STEP = 3
"""``train.checkpoint_interval=auto`` measures the save after this step (of the run, or of a resume that brought no
interval): step 1 carries one-off costs (compile, first allocations, pinning the staging), so steps 2-3 give the step
time and the save is a warm engine's."""


def young_daly(stall_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds of training between saves) that minimises the expected loss.

    tau* = sqrt(2 C M) for a stall C per checkpoint and a job MTBF M (Young 1974; Daly 2006 adds higher-order
    terms that matter only when C is not small against M): where :func:`lost_share`'s two main terms are equal.
    """
    return math.sqrt(2.0 * stall_s * mtbf_s)


def lost_share(interval_s: float, stall_s: float, mtbf_s: float, write_s: float = 0.0,
               restart_s: float = 0.0) -> tuple[float, float]:  # fmt: skip
    """(share of wall time spent in checkpoint stalls, share spent recomputing lost work and restarting).

    To first order: saves cost C / tau (C: the stall per checkpoint, tau: the interval); rework costs
    (tau / 2 + W + R) / M: on average half an interval is lost per failure, plus a background write W that had
    not finished, plus R to restart, with M the job's MTBF.
    """
    return stall_s / interval_s, (interval_s / 2 + write_s + restart_s) / mtbf_s


@dataclass(frozen=True)
class CheckpointAdvice:
    bytes_per_node: float
    stall_s: float
    """Seconds training waits per checkpoint."""
    write_s: float
    """Seconds the write takes (in the background with ``train.checkpoint_async``; equal to the stall without)."""
    mtbf_h: float
    """The job's mean time between failures (one node's, divided by the nodes)."""
    step_s: float
    interval_s: float
    interval_steps: int
    save_share: float
    rework_share: float

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self, current_steps: int | None = None) -> str:
        lines = [
            f"save ~{self.stall_s:.1f} s stall per checkpoint (write ~{self.write_s:.1f} s, "
            f"{self.bytes_per_node / 1e9:.1f} GB per node); job MTBF ~{self.mtbf_h:.1f} h",
            f"suggested train.checkpoint_interval={self.interval_steps} (Young/Daly sqrt(2 x stall x MTBF) = "
            f"{self.interval_s / 60:.1f} min at {self.step_s:.2f} s/step): ~{100 * self.save_share:.2f} % of "
            f"time in saves, ~{100 * self.rework_share:.2f} % recomputing lost steps",
        ]
        if current_steps:
            save, rework = lost_share(current_steps * self.step_s, self.stall_s, self.mtbf_h * 3600, self.write_s)
            lines.append(f"at the configured interval ({current_steps} steps): ~{100 * save:.2f} % in saves, "
                         f"~{100 * rework:.2f} % recomputing")  # fmt: skip
        return "\n".join(lines)


def advise(bytes_per_node: float, bytes_per_rank: float, step_s: float, nodes: int, node_mtbf_h: float,
           storage_gbps: float, copy_gbps: float, background: bool) -> CheckpointAdvice:  # fmt: skip
    """The interval for a layout: the write is the node's share of the checkpoint at the storage's rate; the
    stall is that write (synchronous) or the snapshot copy of a rank's share (background)."""
    write_s = bytes_per_node / (storage_gbps * 1e9)
    stall_s = bytes_per_rank / (copy_gbps * 1e9) if background else write_s
    mtbf_s = node_mtbf_h * 3600 / max(nodes, 1)
    interval_s = max(young_daly(stall_s, mtbf_s), write_s if background else 0.0, step_s)
    steps = max(1, round(interval_s / step_s))
    save, rework = lost_share(steps * step_s, stall_s, mtbf_s, write_s if background else 0.0)
    return CheckpointAdvice(bytes_per_node, stall_s, write_s, mtbf_s / 3600, step_s, steps * step_s, steps, save,
                            rework)  # fmt: skip


def from_saves(bytes_per_node: float, stall_s: float, write_s: float, step_s: float, nodes: int,
               node_mtbf_h: float) -> CheckpointAdvice:  # fmt: skip
    """The interval from a run's own saves: ``stall_s`` training waited per save, ``write_s`` its write took (the
    stall itself for a save that is not in the background), ``step_s`` a step. Young/Daly on the job's MTBF (one
    node's over ``nodes``), never shorter than one write (a save cannot start while the previous one is being
    written) nor than one step."""
    mtbf_s = node_mtbf_h * 3600 / max(nodes, 1)
    interval = max(young_daly(stall_s, mtbf_s), write_s, step_s)
    steps = max(1, round(interval / step_s))
    save, rework = lost_share(steps * step_s, stall_s, mtbf_s, write_s)
    return CheckpointAdvice(bytes_per_node, stall_s, write_s, mtbf_s / 3600, step_s, steps * step_s, steps, save,
                            rework)  # fmt: skip


def node_mtbf(stated_h: float | None, cluster: ClusterConfig | None) -> tuple[float, str]:
    """(one node's MTBF in hours, where it comes from): ``train.node_mtbf_hours`` when set, else the run's cluster's
    ``node_mtbf_hours``, else the cluster default (a run on this machine names no cluster)."""
    from ultrascale.config.cluster import ClusterConfig

    if stated_h is not None:
        return float(stated_h), "train.node_mtbf_hours"
    if cluster is not None:
        return float(cluster.node_mtbf_hours), f"cluster.node_mtbf_hours of cluster={cluster.name}"
    return float(ClusterConfig.node_mtbf_hours), "the cluster default; train.node_mtbf_hours=H states this machine's"


def checkpoint_bytes(total_params: float, weight_bytes: int, zero_stage: int) -> float:
    """Bytes a DeepSpeed checkpoint of the whole job holds: the weights once (in their dtype) plus the fp32
    master copy and Adam's two moments (12 bytes a parameter; ZeRO-0 keeps a master copy only for 16-bit)."""
    optim = 8 + (4 if weight_bytes < 4 or zero_stage >= 1 else 0)
    return total_params * (weight_bytes + optim)
