"""``python -m data_prep input=PATH output_dir=PATH key=value ...``: prepare a packed dataset.

Overrides are Hydra's; ``--cfg job`` prints the composed config without running. User errors print one
``error:`` line and exit 2.
"""

from __future__ import annotations

import logging
import sys

from omegaconf import OmegaConf

from data_prep.config import register_configs
from ultrascale.config.compose import compose
from ultrascale.config.describe import help_if_asked
from ultrascale.errors import UltrascaleError


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    if (rc := help_if_asked("data_prep", argv, __doc__)) is not None:
        return rc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    try:
        register_configs()
        show_cfg = "--cfg" in argv
        cfg = compose([a for a in argv if a not in ("--cfg", "job")], config_name="data_prep")
        if show_cfg:
            print(OmegaConf.to_yaml(cfg))
            return 0
        from data_prep.pipeline import run

        manifest = run(cfg)
    except UltrascaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if manifest:
        sp = manifest["splits"]
        print(
            f"wrote {cfg.output_dir}: train {sp['train']['num_samples']} samples, "
            f"validation {sp['validation']['num_samples']} samples of {manifest['seq_len']} tokens; "
            f"see {cfg.output_dir}/report.md"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
