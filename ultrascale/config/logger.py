"""``conf/logger/``: where metrics go (console, TensorBoard, wandb, the curves plot)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class LoggerConfig:
    console: bool = True
    """Rank-0 console line every train.log_interval steps."""
    tensorboard: bool = True
    """TensorBoard event files under ``<output_dir>/tensorboard``."""
    wandb: bool = True
    """Weights & Biases run (rank 0 only)."""
    wandb_mode: WandbMode = WandbMode.offline
    """``offline`` (default: no network needed; ``wandb sync`` later), ``online`` or ``disabled``."""
    wandb_project: str = "ultrascale"
    """wandb project name."""
    wandb_group: str | None = None
    """wandb group; sweeps set it to the sweep name so jobs plot together."""
    wandb_entity: str | None = None
    """wandb entity (team); None uses the default."""
    run_name: str | None = None
    """Run name; defaults to the output directory's name."""
    plot: bool = True
    """Write ``curves.png`` (loss, lr, tokens/s, memory) at the end and at every checkpoint."""
