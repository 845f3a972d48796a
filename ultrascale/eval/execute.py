"""Run a completion against its problem's tests in the kernel sandbox: the one verdict every SSD stage trusts.

Mined references, model samples and provided candidates all go through :func:`verdicts`, so a sample is kept
by exactly the test that kept its problem, and nothing model-written ever runs outside
:mod:`ultrascale.eval.sandbox`. The program is HumanEval's (prompt + completion + tests + ``check(entry)``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ultrascale.eval.humaneval import check_program
from ultrascale.eval.sandbox import Limits, Outcome, run_many


def program(problem: dict, completion: str) -> str:
    """The test program for one completion; exit status 0 iff every test holds."""
    return check_program(
        {"prompt": problem["prompt"], "test": problem["tests"], "entry_point": problem["entry_point"]}, completion
    )


def verdicts(pairs: Sequence[tuple[dict, str]], limits: Limits, workers: int = 2) -> list[Outcome]:
    """Sandbox outcomes for (problem, completion) pairs, in input order."""
    return run_many([program(p, c) for p, c in pairs], limits, workers=workers)
