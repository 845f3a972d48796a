"""Rewards that never hang a job: the sandboxed execution of a problem's tests, the built-in shaping terms, and any
function a user names by its dotted path, with TRL's calling convention.

Every program runs in :mod:`ultrascale.eval.sandbox` with a wall-clock limit; a timeout, a crash (killed by a
signal, its own ``os.kill`` included) and a sandbox error all score 0 and are counted, and nothing here raises
into the step: a user function that raises scores ``None`` (not applicable) for the whole call and is counted as a
``reward_error``. So a bad completion or a bad reward function can cost a rank seconds, never a collective.
"""

from __future__ import annotations

import ast
import importlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ultrascale.errors import ConfigError
from ultrascale.eval.execute import program
from ultrascale.eval.sandbox import Limits, SandboxUnavailable, check_available, run_program

log = logging.getLogger("ultrascale")

RewardFn = Callable[..., list]
CAP_SYS_ADMIN = 21


class ExecutionReward:
    """1.0 when ``prompt + completion`` passes ``check(entry_point)`` in the sandbox within ``timeout_s``, else 0.0.
    ``counts``: how the programs of the last call ended (passed, failed, timeout, crashed, sandbox_error)."""

    __name__ = "execution"

    def __init__(self, timeout_s: float, workers: int) -> None:
        self.limits = Limits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s) + 1))
        self.workers = workers
        self.counts: Counter = Counter()

    def _one(self, source: str) -> tuple[float, str]:
        try:
            o = run_program(source, self.limits)
        except Exception as e:
            log.warning(f"reward: sandbox error ({type(e).__name__}: {e}); scored 0")
            return 0.0, "sandbox_error"
        if o.passed:
            return 1.0, "passed"
        if o.status == "timeout":
            return 0.0, "timeout"
        killed = o.returncode is not None and (o.returncode < 0 or o.returncode > 128)  # a signal ended it
        return 0.0, "crashed" if killed else "failed"

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], tests: Sequence[str],
                 entry_point: Sequence[str], **_) -> list[float]:  # fmt: skip
        programs = [program({"prompt": p, "tests": t, "entry_point": e}, c)
                    for p, c, t, e in zip(prompts, completions, tests, entry_point)]  # fmt: skip
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            results = list(pool.map(self._one, programs))
        self.counts = Counter(status for _, status in results)
        return [r for r, _ in results]


def format_reward(prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
    """1.0 when prompt + completion parses as Python: a shaping term for a model that cannot yet pass tests."""
    out = []
    for p, c in zip(prompts, completions):
        try:
            ast.parse(p + c)
            out.append(1.0)
        except (SyntaxError, ValueError):
            out.append(0.0)
    return out


def length_penalty(max_tokens: int) -> RewardFn:
    """Minus the share of ``max_completion_length`` a completion used (DAPO's overlong shaping, linear)."""

    def length(prompts: Sequence[str], completions: Sequence[str], completion_ids: Sequence[Sequence[int]], **_):
        return [-len(ids) / max_tokens for ids in completion_ids]

    return length


def load(names: Sequence[str], cfg) -> list[RewardFn]:
    """The reward functions of ``grpo.reward_funcs``: built-ins by name, others imported by dotted path. A name
    that does not resolve is a ConfigError naming the key."""
    out: list[RewardFn] = []
    for name in names:
        if name == "execution":
            out.append(ExecutionReward(cfg.reward_timeout_s, cfg.reward_workers))
        elif name == "format":
            out.append(format_reward)
        elif name == "length":
            out.append(length_penalty(cfg.max_completion_length))
        else:
            module, _, attr = name.rpartition(".")
            try:
                fn = getattr(importlib.import_module(module), attr) if module else None
            except (ImportError, AttributeError) as e:
                raise ConfigError(f"grpo.reward_funcs: {name!r} does not import ({type(e).__name__}: {e}): give a "
                                  "built-in (execution, format, length) or a dotted path pkg.module.fn") from None  # fmt: skip
            if not callable(fn):
                raise ConfigError(f"grpo.reward_funcs: {name!r} is not a function: give a dotted path pkg.module.fn "
                                  "to f(prompts, completions, **columns) -> list[float | None]")  # fmt: skip
            out.append(fn)
    return out


def name_of(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


BUILTINS = ("execution", "format", "length")


def metric_name(name: str) -> str:
    """The key a function's reward is logged under (``rewards/<this>``): a built-in's configured name, a dotted
    path's function name (TRL's ``__name__``)."""
    return name if name in BUILTINS else name.rpartition(".")[2]


def score(fns: Sequence[RewardFn], weights: Sequence[float], prompts: list[str], completions: list[str],
          columns: dict[str, list]) -> tuple[list[float], list[list[float]], Counter]:  # fmt: skip
    """(reward per completion, each function's values, counts). A ``None`` from a function is NaN (not applicable);
    a completion every function found not applicable gets NaN, which the advantages treat as no signal. A
    function that raises or returns the wrong number of values is ``None`` for the call and counted."""
    nan = float("nan")
    per_fn: list[list[float]] = []
    counts: Counter = Counter()
    for fn in fns:
        try:
            vals = fn(prompts=prompts, completions=completions, **columns)
            if len(vals) != len(completions):
                raise ValueError(f"returned {len(vals)} values for {len(completions)} completions")
            vals = [nan if v is None else float(v) for v in vals]
        except Exception as e:
            log.warning(f"reward: {name_of(fn)} raised {type(e).__name__}: {e}; its values count as None")
            counts["reward_error"] += len(completions)
            vals = [nan] * len(completions)
        if isinstance(fn, ExecutionReward):
            counts.update(fn.counts)
        per_fn.append(vals)
    rewards = []
    for i in range(len(completions)):
        terms = [(w, f[i]) for w, f in zip(weights, per_fn) if f[i] == f[i]]
        rewards.append(sum(w * v for w, v in terms) if terms else nan)
    return rewards, per_fn, counts


def _has_cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            eff = next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:"))
        return bool(eff >> CAP_SYS_ADMIN & 1)
    except (OSError, StopIteration, ValueError):
        return False


def require_sandbox(names: Sequence[str]) -> None:
    """Before any model is built: the execution reward needs the kernel sandbox (root, or CAP_SYS_ADMIN with
    CAP_SETUID), which a Slurm user often lacks. One ConfigError line says what is missing and what to do."""
    if "execution" not in names:
        return
    why = None
    if os.geteuid() != 0 and not _has_cap_sys_admin():
        why = f"this process is uid {os.geteuid()} without CAP_SYS_ADMIN"
    else:
        try:
            check_available()
        except SandboxUnavailable as e:
            why = str(e).split(":")[0]
    if why:
        raise ConfigError(f"grpo.reward_funcs=[execution] runs completions in the kernel sandbox, which needs root or "
                          f"CAP_SYS_ADMIN+CAP_SETUID ({why}): run in a container with --cap-add SYS_ADMIN (or as "
                          "root), or score elsewhere with reward_funcs=[pkg.module.fn]")  # fmt: skip
