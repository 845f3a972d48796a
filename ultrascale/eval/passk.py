"""The unbiased pass@k estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code").

Drawing exactly k samples per problem and checking whether any passes has high variance; instead draw
n >= k samples, count the c that pass, and estimate the probability that a random size-k subset holds
at least one pass: ``1 - C(n-c, k) / C(n, k)``. The product form below avoids the huge binomials.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ultrascale.errors import ConfigError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples of which ``c`` passed."""
    if not 0 <= c <= n:
        raise ValueError(f"passed count c={c} must lie in [0, n={n}]")
    if k > n:
        raise ConfigError(f"pass@{k} needs at least {k} samples per problem, got n={n}: raise humaneval.n_samples")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(results: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems; ``results[i]`` holds the pass/fail of each sample of problem i."""
    if not results:
        raise ValueError("no problems to score")
    return float(np.mean([pass_at_k(len(r), sum(bool(x) for x in r), k) for r in results]))
