"""HumanEval for a round's model, through ``eval.py``'s own code path (``ultrascale.eval.run``); and, run as
``python -m ultrascale.ssd.evaluate``, the comparison of any models with a dev/test split, a T_eval grid and a
paired bootstrap CI (:mod:`ultrascale.ssd.compare`).

Scoring SSD's models exactly as ``python eval.py model_dir=DIR tasks=[humaneval]`` scores any model keeps
the before/after numbers comparable with every other eval in the project: same prompts, stop sequences,
sandbox and estimator. Greedy pass@1 always; pass@k from sampled completions when ``eval.passk_samples > 0``.
"""

from __future__ import annotations

import time
from pathlib import Path

from ultrascale.ssd.config import SSDEvalConfig


def humaneval(model_dir: Path, out_dir: Path, cfg: SSDEvalConfig) -> dict:
    """``{"greedy": {pass@1, problems, ...}, "sampled": {...} | None, "wall_s"}``; files land in ``out_dir``."""
    from ultrascale.config.compose import compose, typed
    from ultrascale.eval.config import register_eval_configs
    from ultrascale.eval.run import run

    register_eval_configs()
    common = [f"model_dir={model_dir}", "tasks=[humaneval]", "wandb=false"]
    common += [f"humaneval.limit={'null' if cfg.limit is None else cfg.limit}"]
    common += [f"humaneval.max_new_tokens={cfg.max_new_tokens}", f"humaneval.batch_size={cfg.batch_size}"]
    common += [f"humaneval.workers={cfg.workers}"]
    t0 = time.perf_counter()
    greedy = run(typed(compose([*common, f"output_dir={out_dir / 'greedy'}"], "eval")))["tasks"]["humaneval"]
    result: dict = {"greedy": greedy, "sampled": None}
    if cfg.passk_samples:
        ks = ",".join(str(k) for k in cfg.passk_k)
        sampled = [
            f"humaneval.n_samples={cfg.passk_samples}",
            f"humaneval.temperature={cfg.temperature}",
            f"humaneval.k=[{ks}]",
            f"output_dir={out_dir / 'sampled'}",
        ]
        result["sampled"] = run(typed(compose([*common, *sampled], "eval")))["tasks"]["humaneval"]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


if __name__ == "__main__":
    import sys

    from ultrascale.errors import UltrascaleError
    from ultrascale.ssd.compare import main

    try:
        main()
    except UltrascaleError as e:  # a mismatched --heldout, a missing run or dataset: one line, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
