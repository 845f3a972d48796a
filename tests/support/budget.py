"""The suite's time budget, kept visible: seconds per test file and the slowest tests, after every run.

CI has 90 minutes on 2 cores and the default suite is held to 30 minutes of pytest (README "Tests"); a test file
that grows past its share shows up here in the next run rather than as a red CI. As a pytest plugin (registered
by ``tests/conftest.py``) it prints the table at the end of the run and writes it to ``.cache/test_times.json``;
``python -m tests.support.budget`` (``make test-time``) prints the last run's table again without re-running.
Fixture setup counts against the first test that asks for it, as pytest's own ``--durations`` does.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the table is printed without pytest installed (make test-time)
    import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / ".cache" / "test_times.json"
BUDGET_S = 30 * 60
"""pytest's share of CI's 40-minute target on the 2-core box (issue 54); setup takes the rest."""

_tests: dict[str, float] = defaultdict(float)
_outcomes: dict[str, str] = {}
_start: list[float] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _start[:] = [time.time()]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _tests[report.nodeid] += report.duration
    if report.when == "call" or report.outcome != "passed":
        _outcomes[report.nodeid] = report.outcome


def per_file(tests: dict[str, float]) -> list[tuple[str, float, int]]:
    """(file, seconds, tests) by seconds, largest first."""
    files: dict[str, list[float]] = defaultdict(list)
    for nodeid, s in tests.items():
        files[nodeid.split("::")[0]].append(s)
    return sorted(((f, sum(v), len(v)) for f, v in files.items()), key=lambda r: -r[1])


def table(record: dict, slowest: int = 25) -> str:
    tests = record["tests"]
    wall = record.get("wall_s") or sum(tests.values())
    lines = [f"time per test file ({len(tests)} tests, {wall / 60:.1f} min of pytest wall time; budget "
             f"{BUDGET_S / 60:.0f} min):"]  # fmt: skip
    for f, s, n in per_file(tests):
        lines.append(f"  {s:8.1f} s  {100 * s / max(wall, 1e-9):5.1f} %  {n:4d}  {f}")
    lines.append(f"the {slowest} slowest tests:")
    for nodeid, s in sorted(tests.items(), key=lambda kv: -kv[1])[:slowest]:
        lines.append(f"  {s:8.1f} s  {nodeid}")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _tests or config.getoption("collectonly", False):
        return
    record = {"wall_s": time.time() - _start[0] if _start else None, "exitstatus": int(exitstatus),
              "tests": dict(_tests), "outcomes": _outcomes}  # fmt: skip
    try:
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1))
    except OSError:
        pass
    terminalreporter.write_line("")
    for line in table(record).splitlines():
        terminalreporter.write_line(line)


def main() -> int:
    if not RECORD.exists():
        print(f"no record at {RECORD}: run `make test` (or pytest) first", file=sys.stderr)
        return 1
    print(table(json.loads(RECORD.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
