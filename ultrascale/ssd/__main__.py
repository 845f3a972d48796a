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

from omegaconf import DictConfig

from ultrascale.cli import run_app
from ultrascale.ssd.config import register_ssd_configs


def main(cfg: DictConfig) -> dict:
    from ultrascale.ssd.rounds import SSDRun

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return SSDRun(cfg).run()


if __name__ == "__main__":
    register_ssd_configs()
    raise SystemExit(run_app("ssd", main, help_text=__doc__))
