"""Command output quoted in the docs is what the command prints today.

A README excerpt is a claim: the llama_1b dry run was quoted at 28.5 GiB and 41.2 % MFU long after the planner
had moved to 54.6 GiB and 53.2 %. Two forms are checked, in every Markdown file of the repository:

- a fenced block right after a paragraph that ends in ``(excerpt):``; the command is the last backticked
  ``python ...`` in that paragraph;
- a fenced block whose lines start with ``$ `` (a backslash continues the command); the lines after each
  command, up to the next ``$``, are its output.

The quoted lines must appear in the command's output in the same order (lines the quote leaves out may sit
between them). ``...`` inside a line stands for any text (a machine's name, a long reason); a line that is only
``...`` stands for lines left out. Blank lines are not compared.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from ultrascale.paths import PROJECT_ROOT

SKIP_DIRS = {".venv", ".git", ".cache", "node_modules", "outputs", "runs"}


@dataclass(frozen=True)
class Excerpt:
    where: str  # file:line of the block
    command: str
    lines: tuple[str, ...]


def _markdown_files() -> list[Path]:
    return sorted(p for p in PROJECT_ROOT.rglob("*.md") if not SKIP_DIRS & set(p.relative_to(PROJECT_ROOT).parts))


def excerpts(text: str, name: str) -> list[Excerpt]:
    """The quoted outputs of one Markdown text, in both forms."""
    lines = text.splitlines()
    out: list[Excerpt] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        body = lines[start + 1 : j]
        para: list[str] = []
        k = start - 1
        while k >= 0 and lines[k].strip() == "":
            k -= 1
        while k >= 0 and lines[k].strip() and not lines[k].startswith("```"):
            para.insert(0, lines[k])
            k -= 1
        para_text = " ".join(para)
        where = f"{name}:{start + 1}"
        if body and body[0].startswith("$ "):
            out.extend(_prompt_excerpts(body, where))
        elif para_text.rstrip().endswith("(excerpt):"):
            commands = re.findall(r"`(python [^`]+)`", para_text)
            if commands:
                out.append(Excerpt(where, commands[-1], tuple(body)))
        i = j + 1
    return out


def _prompt_excerpts(body: list[str], where: str) -> list[Excerpt]:
    out = []
    n = 0
    while n < len(body):
        if not body[n].startswith("$ "):
            n += 1
            continue
        command = body[n][2:]
        while command.endswith("\\") and n + 1 < len(body):
            n += 1
            command = command[:-1].rstrip() + " " + body[n].strip()
        n += 1
        quoted = []
        while n < len(body) and not body[n].startswith("$ "):
            quoted.append(body[n])
            n += 1
        out.append(Excerpt(where, command.strip(), tuple(quoted)))
    return out


def _pattern(line: str) -> re.Pattern[str]:
    parts = [re.escape(p) for p in line.rstrip().split("...")]
    return re.compile("^" + ".*?".join(parts) + r"\s*$")


def missing(quoted: tuple[str, ...], output: str) -> str | None:
    """The first quoted line the output does not have at or after the previous one's place, or None."""
    got = output.splitlines()
    pos = 0
    for line in quoted:
        if not line.strip() or line.strip() == "...":
            continue
        pat = _pattern(line)
        while pos < len(got) and not pat.match(got[pos].rstrip()):
            pos += 1
        if pos == len(got):
            return line
        pos += 1
    return None


@cache
def run(command: str) -> str:
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "WANDB_MODE": "offline", "COLUMNS": "200"}
    proc = subprocess.run(argv, cwd=PROJECT_ROOT, capture_output=True, text=True, env=env, timeout=600)
    return proc.stdout + proc.stderr


ALL = [e for path in _markdown_files() for e in excerpts(path.read_text(), str(path.relative_to(PROJECT_ROOT)))]


def test_the_docs_quote_command_output():
    """The README's dry run and its two config errors are among the quotes: an empty scan would pass anything."""
    commands = {e.command for e in ALL}
    assert "python train.py recipe=llama_1b_zero0 dry_run=true" in commands
    assert "python train.py optim.lrr=1e-3" in commands
    assert len(ALL) >= 4


@pytest.mark.parametrize("excerpt", ALL, ids=[f"{e.where} {e.command[:60]}" for e in ALL])
def test_a_quoted_output_is_what_the_command_prints(excerpt: Excerpt):
    output = run(excerpt.command)
    line = missing(excerpt.lines, output)
    assert line is None, (
        f"{excerpt.where}: `{excerpt.command}` no longer prints the quoted line\n  {line}\n"
        f"(rerun the command and update the quote); it printed:\n{output[-4000:]}"
    )


def test_a_stale_figure_or_a_reordered_line_is_caught():
    output = "== a ==\nstep 2.25 s\nMFU 53.2% of H100\n== b ==\n"
    assert missing(("== a ==", "MFU 53.2% of ...", "== b =="), output) is None
    assert missing(("== a ==", "...", "== b =="), output) is None
    assert missing(("MFU 41.2% of ...",), output) == "MFU 41.2% of ..."
    assert missing(("== b ==", "== a =="), output) == "== a =="
    parsed = excerpts(
        "Run `python x.py a=1` (excerpt):\n\n```\nhello ...\n```\n\n```\n$ python y.py \\\n   b=2\nout\n```\n", "f"
    )
    assert [(e.command, e.lines) for e in parsed] == [
        ("python x.py a=1", ("hello ...",)),
        ("python y.py b=2", ("out",)),
    ]
