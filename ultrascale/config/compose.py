"""Compose the typed config from ``conf/`` + overrides, turning Hydra/OmegaConf failures into one line.

Entry points, tests, the planner and the sweep launcher all compose through here, so a recipe behaves
the same whichever of them loads it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ultrascale.config.fields import check
from ultrascale.config.root import register_configs
from ultrascale.errors import ConfigError
from ultrascale.paths import CONF_DIR

HELP_COMMANDS = {"train": "python train.py --help", "eval": "python eval.py --help", "plan": "python plan.py --help",
                 "data_prep": "python -m data_prep --help", "ssd": "python -m ultrascale.ssd --help",
                 "data_prep_chat": "python -m data_prep.chat --help",
                 "data_prep_instruct": "python -m data_prep.instruct --help"}  # fmt: skip


def _one_line(exc: BaseException, overrides: list[str], config_name: str = "train") -> str:
    """Hydra's errors are multi-line and mention HYDRA_FULL_ERROR; users need the key and the fix."""
    msg = str(exc)
    cause = exc.__cause__ or exc.__context__
    full = msg + ("\n" + str(cause) if cause else "")
    key = re.search(r"full_key: ([\w.\[\]]+)", full)
    if "not in struct" in full or ("Key '" in full and "not in" in full):
        name = key.group(1) if key else re.search(r"Key '([^']+)'", full).group(1)
        group = name.split(".")[0]
        hint = f" (or add a new key with +{name}=VALUE)" if name.startswith("model.config.") else ""
        helper = HELP_COMMANDS.get(config_name, f"--help of {config_name}")
        return f"unknown config key {name!r}: check the spelling{hint}; `{helper}` lists the keys of {group!r}"
    m = re.search(r"Could not find '([^']+)'", full)
    if m:
        group = m.group(1).split("/")[0]
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) if (CONF_DIR / group).is_dir() else []
        return f"no config {m.group(1)!r}" + (f": choose one of {options}" if options else "")
    choice = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", full)
    if choice:
        where = key.group(1) if key else "a key"
        return f"{where}={choice.group(1)!r} is not one of [{choice.group(2)}]: pick one"
    if "Value '" in full and ("could not be converted" in full or "is not a valid" in full or "Invalid value" in full):
        val = re.search(r"Value '([^']*)'", full)
        typ = re.search(r"converted to (\w+)", full)
        want = typ.group(1).lower() if typ else "value of the declared type"
        where = key.group(1) if key else "a key"
        return f"{where}={val.group(1) if val else '?'} is not a valid {want}: fix the value"
    lines = [ln.strip() for ln in full.strip().splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
    return "; ".join(lines[:3]) or f"could not compose config from overrides {overrides}"


TYPED_DICTS = ("data.sources", "language.extensions")
"""Keys typed ``dict[str, Schema]``: Hydra refuses ``key={name: {...}}`` on them in struct mode ("not in struct"),
though the value is checked against the schema either way; ``++key=`` merges it."""


def mergeable(overrides: list[str]) -> list[str]:
    """``data.sources={code: {...}}`` as ``++data.sources=...``, so the documented form works as typed."""
    return [f"++{a}" if a.split("=", 1)[0] in TYPED_DICTS else a for a in overrides]


def compose(
    overrides: list[str] | None = None, config_name: str = "train", config_dirs: list[str] | None = None
) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with overrides; raise ConfigError with one line on failure.

    ``config_dirs`` are searched too (Hydra's ``--config-dir``): a user's own recipes and group options.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = mergeable(list(overrides or []))
    if config_dirs:
        paths = ",".join(f"file://{Path(d).resolve()}" for d in config_dirs)
        overrides.append(f"hydra.searchpath=[{paths}]")
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except Exception as e:  # Hydra wraps everything it raises; we only need its message
        raise ConfigError(_one_line(e, overrides, config_name)) from None
    finally:
        GlobalHydra.instance().clear()
    check(cfg, HELP_COMMANDS.get(config_name, "--help"))
    return cfg


def resolve(cfg: DictConfig) -> DictConfig:
    """Resolve interpolations now, so a bad ``${...}`` fails here with its key, not mid-training."""
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:
        raise ConfigError(_one_line(e, [])) from None
    return cfg


def typed(cfg: DictConfig) -> Any:
    """The composed config as its dataclasses (``RootConfig``, ``EvalConfig``, ...), interpolations resolved.

    The entry points convert once, after composing, so what runs below them reads plain typed attributes: no
    OmegaConf node access on the hot path, and a type checker sees the fields. A value still missing (``???``)
    fails here with its key."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} has no value: set it, e.g. {e.full_key}=...") from None
    except Exception as e:  # a bad interpolation: one line with the key
        raise ConfigError(_one_line(e, [])) from None
