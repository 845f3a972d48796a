"""Evaluate a training run's checkpoint or any local HF model: held-out perplexity, HumanEval pass@k and
fill-in-the-middle on held-out files.

    python eval.py run_dir=runs/demo                                   # newest checkpoint, both tasks
    python eval.py run_dir=runs/demo step=200 tasks=[perplexity]
    python eval.py run_dir=runs/demo humaneval.limit=20 output_dir=runs/demo/eval_subset
    python eval.py model_dir=exports/demo perplexity.data_path=data/stdlib
    python eval.py model_dir=DIR tasks=[humaneval] humaneval.temperature=0.8 humaneval.n_samples=20 humaneval.k=[1,10]
    python eval.py model_dir=DIR tasks=[fim] fim.data=data/stdlib fim.modes=[psm,spm]   # FIM on held-out files
    python eval.py model_dir=DIR tasks=[infill] infill.benchmark=single-line infill.mode=psm   # HumanEval-Infilling

Writes <output_dir>/eval_results.json (default <run_dir>/eval/<tag>) and logs to the run's wandb.
HumanEval executes model-written code in a kernel sandbox (ultrascale/eval/sandbox.py): it needs root.
"""

from ultrascale.cli import run_app
from ultrascale.eval.config import EvalConfig, register_eval_configs


def main(cfg: EvalConfig) -> dict:
    from ultrascale.eval.run import run
    from ultrascale.export import export
    from ultrascale.runtime.dist import setup_logging

    setup_logging()  # the console gets the sampler's line: tokens, tokens/s, batch fill, padding, drafts accepted
    return run(cfg, export=export)


if __name__ == "__main__":
    register_eval_configs()
    raise SystemExit(run_app("eval", main, help_text=__doc__))
