"""``conf/launcher/``: how a run is started (local, deepspeed, torchrun, Slurm) and its environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ultrascale.config.fields import num


class LauncherName(StrEnum):
    local = "local"
    deepspeed = "deepspeed"
    torchrun = "torchrun"
    slurm = "slurm"


class NodeLauncher(StrEnum):
    deepspeed = "deepspeed"
    torchrun = "torchrun"


@dataclass
class SlurmConfig:
    """What ``launch/slurm`` writes into the sbatch header. GPUs per node and nodes come from the launcher."""

    partition: str | None = None
    """``#SBATCH --partition``; None uses the cluster's default partition."""
    account: str | None = None
    """``#SBATCH --account`` to charge; None uses your default account."""
    qos: str | None = None
    """``#SBATCH --qos``; None uses the partition's default."""
    time: str = "24:00:00"
    """Wall-clock limit (``HH:MM:SS`` or ``D-HH:MM:SS``). Requeue plus auto-resume continues past it."""
    cpus_per_task: int = num(16, ge=1)
    """CPU cores per node for the one launcher task (its ranks and their data loading share them)."""
    mem: str | None = None
    """``#SBATCH --mem`` per node (e.g. ``0`` = all of it); None uses the partition's default."""
    constraint: str | None = None
    """``#SBATCH --constraint`` node features (e.g. ``h100``); None accepts any node."""
    job_name: str | None = None
    """Job name in ``squeue``; None uses the run directory's name."""
    node_launcher: NodeLauncher = NodeLauncher.deepspeed
    """Per-node launcher started by ``srun``: ``deepspeed`` (``--no_ssh --node_rank``) or ``torchrun``."""
    requeue: bool = True
    """Near the time limit (and after a preemption's SIGTERM) the run saves a checkpoint at its next step and
    stops, and the batch script requeues the job, which resumes from that checkpoint."""
    signal_lead_s: int = num(300, ge=0)
    """Seconds before the time limit at which Slurm sends USR1 to the batch script (``--signal=B:USR1@N``): enough
    for one step plus one checkpoint save."""
    extra: list[str] = field(default_factory=list)
    """Further ``#SBATCH`` options, verbatim (e.g. ``["--exclusive", "--reservation=big"]``)."""
    submit: bool = True
    """``launcher=slurm`` runs ``sbatch`` on the written script; false only writes it (and prints the command)."""


@dataclass
class LauncherConfig:
    name: LauncherName = LauncherName.local
    """How a run is started: ``local`` (this process, or whatever launcher already started it),
    ``deepspeed``/``torchrun`` (spawn a multi-rank launcher for the run, or per Hydra ``-m`` job), or ``slurm``
    (write ``<output_dir>/sbatch.sh`` and submit it)."""
    nproc_per_node: int = num(2, ge=1)
    """Ranks per node when this tool spawns the launcher (GPUs per node on a GPU cluster)."""
    nnodes: int = num(1, ge=1)
    """Nodes when this tool spawns the launcher. More than one needs ``launcher.hostfile`` or ``launcher=slurm``."""
    master_port: int | None = num(None, ge=1, le=65535)
    """Rendezvous TCP port on the first node. None picks one: a free port for local launches, and
    20000 + job id % 20000 on Slurm (two jobs sharing a node must not collide)."""
    hostfile: str | None = None
    """DeepSpeed hostfile (``host slots=N`` lines; ``python -m launch.hostfile`` writes one) for multi-node
    ``launcher=deepspeed``; the launcher reaches the other nodes with pdsh/ssh."""
    max_restarts: int = num(0, ge=0)
    """Start a failed launch again (a rank killed, out of memory, a lost node) up to this many times; it resumes
    from the newest complete checkpoint. torchrun: its ``--max-restarts``; deepspeed: the driver (``python
    train.py launcher=deepspeed``) loops; Slurm: the batch script loops over ``srun``. A config error (exit 2)
    is not retried."""
    stop_timeout_s: int = num(300, ge=1)
    """Seconds a launcher gives the ranks to save and exit after it forwards a stop signal (torchrun's
    ``--shutdown-timeout``), before it kills them; size it to a checkpoint save."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment presets (NCCL etc.) exported to every rank and logged at start. ``launcher/env=<fabric>``
    picks a preset; a single key is overridden with ``launcher.env.NCCL_DEBUG=INFO``."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Slurm batch-script settings for ``launcher=slurm``."""
