"""The typed config back to plain data: what a run writes (config.yaml, summary.json, wandb's config) is the
resolved tree as dicts and lists, whether the caller holds the dataclasses (everything below the entry points)
or a composed DictConfig (tests, tools that compose for themselves)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf


def plain(cfg: Any) -> Any:
    """``cfg`` (a dataclass config, a piece of one, a DictConfig, or a dict holding any of them) as resolved dicts
    and lists."""
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)
