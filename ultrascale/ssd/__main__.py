"""Self-distillation rounds for code models: ``method=ssd`` (default) is the SSD paper's method (sample from the
frozen model, drop only empty and stub responses, finetune; nothing executed), ``method=rft`` finetunes only on
samples that pass their problem's tests in the sandbox.

    python -m ultrascale.ssd ssd=smollm2_135m                                    # the paper's method, SmolLM2-135M
    python -m ultrascale.ssd ssd=smollm2_135m_rft                                # rejection-sampling finetuning
    python -m ultrascale.ssd ssd=smollm2_135m problems.source=jsonl problems.jsonl=prompts.jsonl   # {"prompt"} lines
    python -m ultrascale.ssd ssd=tiny start_model=DIR problems.jsonl=problems.jsonl output_dir=runs/ssd_tiny
    python -m ultrascale.ssd.evaluate --model base=DIR --model ssd=DIR           # dev/test, T_eval grid, paired CI

Rerunning with the same output_dir continues where it stopped (finished stages are skipped).
HumanEval (and method=rft's execution) needs root for the sandbox (kernel namespaces), as eval.py's does.
"""

from __future__ import annotations

import logging

from ultrascale.cli import run_app
from ultrascale.ssd.config import SSDConfig, register_ssd_configs


def main(cfg: SSDConfig) -> dict:
    from ultrascale.ssd.rounds import SSDRun

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return SSDRun(cfg).run()


if __name__ == "__main__":
    register_ssd_configs()
    raise SystemExit(run_app("ssd", main, help_text=__doc__))
