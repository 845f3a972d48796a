"""Shared entry-point plumbing for train.py / eval.py / plan.py.

Single runs compose the config directly (fast, one-line errors, and no per-rank Hydra run directory);
``-m`` sweeps and Hydra's own flags (--help, --cfg, --info, ...) go through ``@hydra.main`` so its
launchers and help work as documented. Either way ``--local_rank=N`` from the deepspeed launcher is
stripped first, and an UltrascaleError becomes ``error: <message>`` with exit code 2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from ultrascale.dist import configure_env, strip_local_rank
from ultrascale.errors import UltrascaleError

HYDRA_FLAGS = {"-m", "--multirun", "--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve",
               "--package", "-p", "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun"}  # fmt: skip


def _report(e: UltrascaleError) -> int:
    if int(os.environ.get("RANK", "0")) == 0:  # every rank hits the same config/data error; say it once
        print(f"error: {e}", file=sys.stderr, flush=True)
    return 2


def _hydra_main(config_name: str, main: Callable[[DictConfig], Any], argv: list[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ultrascale.config.compose import CONF_DIR
    from ultrascale.config.schema import register_configs

    register_configs()
    sys.argv = [sys.argv[0], *argv]
    explicit_out = any(a.startswith("output_dir=") for a in argv)

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def _job(cfg: DictConfig) -> Any:
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN and not explicit_out and "output_dir" in cfg:
            cfg.output_dir = hc.runtime.output_dir  # one run dir per sweep job
        try:
            return main(cfg)
        except UltrascaleError as e:
            raise SystemExit(_report(e)) from None

    _job()
    return 0


def run_app(config_name: str, main: Callable[[DictConfig], Any], argv: list[str] | None = None) -> int:
    configure_env()
    argv = strip_local_rank(list(sys.argv[1:] if argv is None else argv))
    if any(a.split("=", 1)[0] in HYDRA_FLAGS for a in argv):
        return _hydra_main(config_name, main, argv)
    from ultrascale.config.compose import compose
    from ultrascale.dist import shutdown

    try:
        main(compose(argv, config_name))
    except UltrascaleError as e:
        return _report(e)
    shutdown()  # only on success: a barrier after a failure would hang the ranks that did not fail
    return 0
