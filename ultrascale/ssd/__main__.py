"""Self-distillation rounds: sample n completions per problem, run them in the sandbox, finetune on the passes.

    python -m ultrascale.ssd ssd=smollm2_135m                                    # one round from SmolLM2-135M
    python -m ultrascale.ssd ssd=smollm2_135m start_model=runs/smollm2_135m_cpt/hf output_dir=runs/ssd_cpt rounds=2
    python -m ultrascale.ssd ssd=tiny start_model=DIR problems.jsonl=problems.jsonl output_dir=runs/ssd_tiny
    python -m ultrascale.ssd --help                                              # every key with its doc

Rerunning with the same output_dir continues where it stopped (finished stages are skipped).
Needs root for the sandbox (kernel namespaces), as eval.py's HumanEval does.
"""

from __future__ import annotations

import logging
import sys

from omegaconf import DictConfig

from ultrascale.cli import run_app
from ultrascale.ssd.config import register_ssd_configs


def main(cfg: DictConfig) -> dict:
    from ultrascale.ssd.rounds import SSDRun

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return SSDRun(cfg).run()


def describe(argv: list[str]) -> str:
    """``--help``: the presets, then every key with its composed value and the schema docstring under it."""
    from ultrascale.config.compose import CONF_DIR, compose
    from ultrascale.config.describe import _walk
    from ultrascale.ssd.config import SSDConfig

    lines = [
        __doc__.strip(),
        "",
        "Presets (ssd=NAME): " + ", ".join(sorted(p.stem for p in (CONF_DIR / "ssd").glob("*.yaml"))),
    ]
    lines += ["", "Keys (override with key=value):"]
    _walk(SSDConfig, compose(argv, "ssd"), "", lines)
    return "\n".join(lines)


if __name__ == "__main__":
    register_ssd_configs()
    args = sys.argv[1:]
    if "--help" in args or "-h" in args:
        from ultrascale.errors import UltrascaleError

        try:
            print(describe([a for a in args if a not in ("--help", "-h")]))
        except UltrascaleError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        raise SystemExit(0)
    raise SystemExit(run_app("ssd", main))
