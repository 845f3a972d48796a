"""pass@k against values worked out by hand from 1 - C(n-c, k) / C(n, k)."""

from __future__ import annotations

import pytest

from ultrascale.errors import ConfigError
from ultrascale.eval.passk import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 2 / 5),  # pass@1 is the plain pass rate
        (5, 2, 2, 1 - 3 / 10),  # C(3,2)=3, C(5,2)=10
        (4, 1, 3, 1 - 1 / 4),  # C(3,3)=1, C(4,3)=4
        (10, 3, 5, 1 - 21 / 252),  # C(7,5)=21, C(10,5)=252
        (20, 1, 10, 1 - 92378 / 184756),  # C(19,10) / C(20,10) = 1/2
        (10, 0, 5, 0.0),
        (10, 10, 1, 1.0),
        (3, 1, 3, 1.0),  # n - c < k: every size-3 subset holds the pass
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_mean_over_problems():
    # problem A: 1 of 2 passes -> pass@1 = 0.5, pass@2 = 1; problem B: 0 of 2 -> 0, 0
    results = [[True, False], [False, False]]
    assert mean_pass_at_k(results, 1) == pytest.approx(0.25)
    assert mean_pass_at_k(results, 2) == pytest.approx(0.5)


def test_k_larger_than_samples_is_a_config_error():
    with pytest.raises(ConfigError, match="n_samples"):
        pass_at_k(2, 1, 5)
