"""The root schemas (``conf/train.yaml``'s ``RootConfig``, ``conf/plan.yaml``'s ``PlanRootConfig``) and their
registration in Hydra's ConfigStore.

The YAML files under ``conf/`` hold values only; the dataclasses hold the shape, one module per group, named as
the group (``conf/zero/`` -> ``ultrascale/config/zero.py``). Hydra merges the YAML onto them in struct mode, so a
misspelt key or a wrong type fails at compose time with the full key in the message. Allowed choices are
``StrEnum`` types: a value outside one fails at compose time with the key and the choices, and the members compare
equal to (and print as) their strings, so YAML, JSON and messages read the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ultrascale.config.budget import BudgetConfig
from ultrascale.config.cluster import ClusterConfig
from ultrascale.config.data import DataConfig
from ultrascale.config.fields import num
from ultrascale.config.finetune import FinetuneConfig
from ultrascale.config.grpo import GRPOConfig
from ultrascale.config.launcher import LauncherConfig
from ultrascale.config.logger import LoggerConfig
from ultrascale.config.model import ModelConfig
from ultrascale.config.optim import OptimConfig
from ultrascale.config.parallel import ParallelConfig
from ultrascale.config.precision import PrecisionConfig
from ultrascale.config.problems import ProblemsConfig
from ultrascale.config.search import SearchConfig
from ultrascale.config.stability import StabilityConfig
from ultrascale.config.train import TrainConfig
from ultrascale.config.zero import ZeroConfig


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    """``finetune=lora``: train adapters over ``model.pretrained_path`` instead of every weight."""
    grpo: GRPOConfig | None = None
    """``grpo=default``: the objective is GRPO on ``problems`` (rollouts from the sampler, rewards from the
    sandbox) instead of next-token loss on ``data``. null: language modelling."""
    problems: ProblemsConfig = field(default_factory=ProblemsConfig)
    """The problems a GRPO run samples from (``problems.source=humaneval problems.split=dev``, a JSONL file, or
    mined from a corpus): the ``problems`` keys SSD uses. Unused without ``grpo``."""
    output_dir: str = MISSING
    """Run directory: config, metrics, checkpoints and logs. Re-running with the same one auto-resumes."""
    dry_run: bool = False
    """Print the resolved DeepSpeed JSON, topology, parameter counts and tokens per step; do not train."""
    cluster: ClusterConfig | None = None
    """The hardware a dry run speaks for (``cluster=h100_8x``; each GPU recipe names its own): its GPU decisions,
    HBM per GPU and predicted step time, with ``launcher.nnodes`` x ``launcher.nproc_per_node`` of its nodes'
    GPUs. null: this machine. A real run reads the machine it runs on, whatever this says."""


@dataclass
class PlanRootConfig(RootConfig):
    """Root for ``plan.py``: the training groups (the layout and model) plus the cluster and search."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    top_n: int = num(10, ge=1)
    """Rows in the printed ranking."""
    output_json: str | None = None
    """Write the full result (every layout, its terms and any rejection reason) to this path."""
    plot: str | None = None
    """Write a PNG of the top layouts' memory breakdown against the GPU limit, with predicted tokens/s."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """Inference-aware model size and training tokens for a budget and a serving volume (``budget=hoffmann``)."""


def register_configs() -> None:
    """Register the root schema so ``conf/train.yaml`` can start its defaults list with it."""
    cs = ConfigStore.instance()
    cs.store(name="ultrascale_schema", node=RootConfig)
    cs.store(name="ultrascale_plan_schema", node=PlanRootConfig)
