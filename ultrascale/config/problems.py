"""The ``problems`` keys: which corpus (or JSONL file) code is mined from and how it is filtered.

One dataclass for every consumer of mined code: SSD's ``problems`` group and the instruction set's
(``python -m data_prep.instruct``), so both read and decontaminate a corpus with the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ultrascale.config.fields import num


class ProblemSource(StrEnum):
    """Where a round's problems come from (``problems.source``)."""

    corpus = "corpus"
    jsonl = "jsonl"
    humaneval = "humaneval"


class ProblemSplit(StrEnum):
    """Which of HumanEval's seeded halves (``problems.split``): the one split ``python -m ultrascale.ssd.evaluate``
    chooses settings on (``dev``) and reports on (``test``), so a model trained on ``dev`` is scored on ``test``."""

    all = "all"
    dev = "dev"
    test = "test"


DENY_NAMES = [
    # Files, processes, the network, clocks, randomness and the interpreter: a problem must be a pure function
    # of its arguments, so its tests are deterministic and a pass says something about the code, not the
    # machine. In-memory io (StringIO/BytesIO) is allowed: doctests of parsers use it, and `open` is denied.
    "open", "input", "exec", "eval", "compile", "__import__", "breakpoint", "exit", "quit", "globals", "locals",
    "os", "sys", "subprocess", "socket", "shutil", "tempfile", "pathlib", "glob", "threading",
    "multiprocessing", "asyncio", "signal", "time", "datetime", "random", "secrets", "uuid", "urllib", "http",
    "ssl", "select", "selectors", "ctypes", "gc", "importlib", "webbrowser", "tkinter", "sqlite3", "logging",
    "warnings", "atexit", "inspect", "weakref", "builtins", "locale",
]  # fmt: skip


@dataclass
class ProblemsConfig:
    source: ProblemSource = ProblemSource.corpus
    """``corpus``: mine functions with doctests (or nearby asserts) from source files; ``jsonl``: read ``jsonl``;
    ``humaneval``: the bundled HumanEval problems, the half ``split`` names."""
    split: ProblemSplit = ProblemSplit.all
    """``source=humaneval``: ``dev`` or ``test``, the halves of :func:`ultrascale.eval.stats.split_dev_test` at
    ``split_seed`` (the evaluator's own split), or ``all``. Training on ``dev`` leaves ``test`` held out."""
    split_seed: int = num(0, ge=0)
    """Seed of the dev/test split (``python -m ultrascale.ssd.evaluate --seed``'s default is 0)."""
    task_ids: list[str] | None = None
    """``source=humaneval``: keep only these problems of the split (the pool ``python -m ultrascale.train.grpo.pool``
    measured: the ones the base model sometimes solves); null: the whole split. An id the split lacks is refused."""
    input: str = "stdlib"
    """Corpus to mine (``source=corpus``), as data prep reads it: ``stdlib`` (this Python's own library) or a
    directory of source files. Files and repositories come from ``data_prep.sources``, so they are the ones
    data prep would see."""
    train_repos_from: str | None = None
    """A prepared dataset directory (its ``repos.json``): mine only repositories of its *train* split, so the
    validation repositories stay held out. Null mines every repository of ``input``."""
    held_out: bool = False
    """With ``train_repos_from``: mine the *validation* repositories instead (the second evaluation set of
    ``python -m ultrascale.ssd.evaluate --heldout``), never for training."""
    jsonl: str | None = None
    """``source=jsonl``: one problem per line, ``{"task_id", "prompt", "tests", "entry_point"}`` plus optional
    ``reference`` (verified like mined ones) and ``extra_candidates`` (completions from elsewhere, e.g. human
    solutions, executed and filtered exactly like model samples and marked ``source: provided``)."""
    max_problems: int | None = num(128, ge=1)
    """Keep at most this many problems (a seeded sample of those passing every filter); null keeps all."""
    seed: int = num(0, ge=0)
    """Seeds the ``max_problems`` sample."""
    include_helpers: bool = True
    """Put the module-level functions, classes and constants a function uses (transitively) into its prompt,
    so it is self-contained and the model can see them. Off: such functions are dropped."""
    max_prompt_lines: int = num(80, ge=1)
    """Longest prompt (imports + helpers + signature + docstring) kept; longer ones are dropped (CPU budget)."""
    max_reference_lines: int = num(40, ge=1)
    """Longest reference body kept: a completion the model could plausibly write in ``max_new_tokens``."""
    asserts: bool = True
    """Also turn module-level ``assert f(...) == ...`` statements (and those in ``_test``/``test_*`` functions or
    ``if __name__ == "__main__"`` blocks) that call the function into its tests."""
    deny_names: list[str] = field(default_factory=lambda: list(DENY_NAMES))
    """Names (builtins or modules) a problem may not use anywhere in its code: no I/O, clocks or randomness."""
    decontam_ngram: int = num(10, ge=1)
    """HumanEval decontamination: word n-gram size (data prep's ``decontam.ngram``)."""
    decontam_min_overlap: float = num(0.5, gt=0, le=1)
    """Share of a HumanEval item's n-grams found in a problem (prompt + reference) that drops it."""
    timeout_s: float = num(5.0, gt=0)
    """Sandbox wall-clock limit when checking a reference against its own tests: problems must be fast."""
    workers: int = num(2, ge=1)
    """Reference checks run at once (each in its own sandbox)."""
