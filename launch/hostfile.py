"""DeepSpeed hostfiles (``host slots=N`` per line) from Slurm's compressed node list or a plain list.

``deepspeed --hostfile`` needs one line per node, and ``--no_ssh`` launches need the same file on every
node with distinct names (the launcher derives each node's ranks from its position in the file).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ultrascale.argv import ArgParser
from ultrascale.errors import ConfigError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets: ``a[1-2],b`` -> ``['a[1-2]', 'b']``."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(expr: str, nodelist: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", expr)
    if not m:
        if "[" in expr or "]" in expr:
            raise ConfigError(f"node list {nodelist!r}: unbalanced brackets in {expr!r}; expected e.g. 'gpu[01-04,07]'")
        return [expr]
    head, tail, out = expr[: m.start()], expr[m.end() :], []
    for item in m.group(1).split(","):
        r = _RANGE.match(item.strip())
        if not r:
            raise ConfigError(f"node list {nodelist!r}: bad range {item!r}; expected N or N-M, e.g. 'gpu[01-04]'")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"node list {nodelist!r}: range {item!r} runs backwards; write {hi}-{lo}")
        width = len(lo) if lo.startswith("0") else 0  # zero padding as Slurm writes it: node[01-10]
        for i in range(int(lo), int(hi) + 1):
            out.extend(_expand_one(f"{head}{i:0{width}d}{tail}", nodelist))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's ``SLURM_JOB_NODELIST`` syntax (``gpu[01-03,07],login1``) as host names, in order.

    The same as ``scontrol show hostnames``, which is not available off the cluster (or in tests).
    """
    hosts = [h for part in _split_top(nodelist) for h in _expand_one(part, nodelist)]
    if not hosts:
        raise ConfigError(f"node list {nodelist!r} names no hosts")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"node list {nodelist!r} names a host twice; each node must appear once")
    return hosts


def hostfile_text(hosts: list[str], slots: int) -> str:
    if slots < 1:
        raise ConfigError(f"hostfile slots={slots}: each node needs at least one slot (rank)")
    return "".join(f"{h} slots={slots}\n" for h in hosts)


_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's own grammar (deepspeed.launcher.runner._parse_hostfile)


def read_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} of a DeepSpeed hostfile, or one error naming the line DeepSpeed would reject with a traceback."""
    path = Path(path)
    pool: dict[str, int] = {}
    for n, raw in enumerate(path.read_text(errors="replace").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ConfigError(f"{path} line {n}: {line[:80]!r} is not 'HOST slots=N': fix or remove the line")
        if m.group(1) in pool:
            raise ConfigError(f"{path} line {n}: host {m.group(1)!r} appears twice: each node gets one line")
        pool[m.group(1)] = int(m.group(2))
    if not pool:
        raise ConfigError(f"{path} names no hosts: write one 'HOST slots=N' line per node")
    return pool


def write_hostfile(path: str | Path, hosts: list[str], slots: int) -> Path:
    path = Path(path)
    path.write_text(hostfile_text(hosts, slots))
    return path


def resolve_hosts(hosts: list[str], nodelist: str | None, nnodes: int | None) -> list[str]:
    """Explicit hosts, else a Slurm node list (argument or ``SLURM_JOB_NODELIST``), else ``node0..nodeN-1``.

    The placeholder names serve ``--no_ssh`` launches, where names only need to be distinct.
    """
    if hosts:
        out = [h for item in hosts for h in expand_nodelist(item)]
    elif nodelist or os.environ.get("SLURM_JOB_NODELIST"):
        out = expand_nodelist(nodelist or os.environ["SLURM_JOB_NODELIST"])
    elif nnodes:
        out = [f"node{i}" for i in range(nnodes)]
    else:
        raise ConfigError("no hosts: pass host names, --nodelist 'gpu[01-04]', --nnodes N, or run inside a Slurm job")
    if nnodes and len(out) < nnodes:
        raise ConfigError(f"--nnodes {nnodes} but only {len(out)} hosts given: {out}")
    return out[:nnodes] if nnodes else out


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(
        prog="python -m launch.hostfile",
        description="Write a DeepSpeed hostfile from host names, a Slurm node list, or SLURM_JOB_NODELIST.",
    )
    p.add_argument("hosts", nargs="*", help="host names or Slurm-style lists (gpu[01-04])")
    p.add_argument("--nodelist", help="Slurm node list; default $SLURM_JOB_NODELIST")
    p.add_argument("--slots", type=int, required=True, help="ranks (GPUs) per node")
    p.add_argument("--nnodes", type=int, help="use the first N hosts (or node0..N-1 when none are given)")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")
    args = p.parse_args(argv)
    try:
        text = hostfile_text(resolve_hosts(args.hosts, args.nodelist, args.nnodes), args.slots)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
