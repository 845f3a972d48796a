"""Re-run ``train.py <overrides>`` under a multi-rank launcher from one driver process.

``python train.py launcher=deepspeed`` and every job of a ``-m`` sweep come through here, so a sweep job
is exactly the command a user would type by hand: ``deepspeed --num_gpus N train.py <overrides>``.
The ranks see ``WORLD_SIZE`` from their launcher and therefore run the job instead of spawning again.
The driver is also what makes a stop and a lost rank cheap:
- Ctrl-C, SIGTERM or SIGUSR1 to the driver becomes a stop request (the run's ``STOP`` file): the ranks finish
  the step, save it and exit 0, and so do the launcher and the driver. The launcher runs in its own session,
  so the terminal's Ctrl-C reaches the driver alone and no launcher tears the ranks down mid-save.
- ``launcher.max_restarts``: a launch that fails (a rank killed, out of memory) is started again and resumes
  from the newest complete checkpoint: torchrun's own ``--max-restarts``; the deepspeed launcher has none, so
  the driver loops.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from launch.hostfile import read_hostfile
from ultrascale.config.launcher import LauncherName
from ultrascale.errors import ConfigError
from ultrascale.jsonio import write_json
from ultrascale.paths import PROJECT_ROOT, resolve_path
from ultrascale.runtime.dist import RESTART_ENV, free_port
from ultrascale.train.rundir import STOP_REQUEST, STOPPED
from ultrascale.train.stop import write_request

if TYPE_CHECKING:
    from ultrascale.config.launcher import LauncherConfig
    from ultrascale.config.root import RootConfig

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
CONFIG_ERROR = 2
"""Exit code of a rank that refused its config or data (``error:`` line): restarting cannot help."""

SPAWNING = (LauncherName.deepspeed, LauncherName.torchrun)
STATUS_FILE = "job_status.json"


class JobFailed(RuntimeError):
    """A spawned launcher exited non-zero; its ranks have already printed why."""


@dataclass
class LaunchResult:
    returncode: int
    stopped: str | None = None
    """The signal that asked the run to stop (it saved a checkpoint and ended early), None otherwise."""
    restarts: int = 0


class _StopForwarder:
    """While the launcher runs: the first SIGTERM/SIGINT/SIGUSR1 writes the run's STOP request (the ranks read
    it at their next step), later ones only say that the stop is under way."""

    def __init__(self, request: Path):
        self.request, self.signal, self._previous = request, None, {}

    def __enter__(self) -> _StopForwarder:
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _on_signal(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = name
            write_request(self.request, name)  # names this driver: its request stands while it lives
            msg = f"{name}: asking the run to finish its step, save a checkpoint and stop (again: no effect)\n"
        else:
            msg = f"{name}: already stopping; waiting for the checkpoint (SIGKILL the ranks to abort)\n"
        os.write(2, msg.encode())


def is_driver(cfg: RootConfig) -> bool:
    """True when this process should start a launcher (or submit to Slurm) rather than train itself.

    A process started by a launcher has ``WORLD_SIZE`` set; a dry run only prints, whatever the launcher. Asked
    only of a config with a ``launcher`` group (train's and plan's roots; the callers check).
    """
    if cfg.dry_run or "WORLD_SIZE" in os.environ:
        return False
    return cfg.launcher.name in (*SPAWNING, LauncherName.slurm)


def _exe(name: str) -> str:
    """The launcher from this interpreter's environment (a venv's bin/ is often not on PATH)."""
    p = Path(sys.executable).parent / name
    return str(p) if p.exists() else name


def launcher_argv(lc: LauncherConfig, script: str, args: list[str], port: int | None = None) -> list[str]:
    """The launcher command line for one run of ``script args`` with ``launcher``'s shape."""
    port = port or lc.master_port or free_port()
    if lc.name == "deepspeed":
        cmd = [_exe("deepspeed")]  # no restarts of its own: run() loops (launcher.max_restarts)
        if lc.nnodes > 1:
            if not lc.hostfile:
                raise ConfigError(
                    f"launcher.nnodes={lc.nnodes} with launcher=deepspeed needs launcher.hostfile=PATH "
                    "(write one with `python -m launch.hostfile --slots N host1 host2`), or use launcher=slurm"
                )
            hostfile = resolve_path(lc.hostfile)
            if not hostfile.is_file():
                raise ConfigError(f"launcher.hostfile={lc.hostfile}: no such file ({hostfile})")
            hosts = read_hostfile(hostfile)
            if len(hosts) < lc.nnodes:
                raise ConfigError(
                    f"launcher.nnodes={lc.nnodes} but {hostfile} names {len(hosts)} host(s): add hosts or lower nnodes"
                )
            cmd += ["--hostfile", str(hostfile), "--num_nodes", str(lc.nnodes)]
        return [*cmd, "--num_gpus", str(lc.nproc_per_node), "--master_port", str(port), script, *args]
    if lc.name == "torchrun":
        if lc.nnodes > 1:
            raise ConfigError(
                f"launcher=torchrun with launcher.nnodes={lc.nnodes}: torchrun starts one node per invocation; "
                "use launcher=slurm launcher.slurm.node_launcher=torchrun, or run launch/node.sh on each node"
            )
        return [_exe("torchrun"), "--nproc_per_node", str(lc.nproc_per_node), "--master_port", str(port),
                "--max-restarts", str(lc.max_restarts), "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1",
                "--shutdown-timeout", str(lc.stop_timeout_s), script, *args]  # fmt: skip
    raise ConfigError(f"launcher.name={lc.name!r} does not spawn a launcher: choose one of {list(SPAWNING)}")


def launch_env(launcher: LauncherConfig) -> dict[str, str]:
    """This environment plus the network preset, so the launcher (and pdsh to other nodes) carries it."""
    return {**os.environ, **{k: str(v) for k, v in launcher.env.items()}, "PYTHONUNBUFFERED": "1"}


def run_launcher(cmd: list[str], env: dict[str, str], out_dir: Path, restart: int = 0) -> LaunchResult:
    """Run the launcher, streaming its output to the console and to ``<out_dir>/launcher.log``.

    The driver is not a rank, so creating the run directory here does not race with the ranks. A signal to
    the driver becomes the run's stop request (see :class:`_StopForwarder`).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    print("launching: " + " ".join(cmd), flush=True)
    started = time.time()
    with open(out_dir / "launcher.log", "a") as log, _StopForwarder(out_dir / STOP_REQUEST) as fwd:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env={**env, RESTART_ENV: str(restart)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)  # fmt: skip
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        finally:
            sys.stdout.flush()
    # The ranks saved and stopped (STOPPED is written by this launch's rank 0 once the checkpoint is `latest`):
    # a clean stop, whatever exit code the launcher chose for the signal it also got.
    marker = out_dir / STOPPED
    clean = fwd.signal is not None and marker.exists() and marker.stat().st_mtime >= started
    (out_dir / STOP_REQUEST).unlink(missing_ok=True)  # answered, or the run ended before it could be
    write_json(out_dir / STATUS_FILE, {"returncode": rc, "command": cmd, "stopped": fwd.signal}, indent=None)
    return LaunchResult(0 if clean else rc, fwd.signal)


def spawn(cfg: RootConfig, script: str, args: list[str]) -> LaunchResult:
    """Start ``script args`` under ``cfg.launcher`` and wait; a failed deepspeed launch is started again up to
    ``launcher.max_restarts`` times (torchrun restarts its workers itself)."""
    out = resolve_path(cfg.output_dir)
    restarts = 0
    while True:
        cmd = launcher_argv(cfg.launcher, str(Path(script).resolve()), args)
        res = run_launcher(cmd, launch_env(cfg.launcher), out, restart=restarts)
        res.restarts = restarts
        retry = cfg.launcher.name == LauncherName.deepspeed and restarts < cfg.launcher.max_restarts
        if res.returncode in (0, CONFIG_ERROR) or res.stopped or not retry:
            return res
        restarts += 1
        print(f"{cfg.launcher.name} exited with code {res.returncode}: restart {restarts} of "
              f"{cfg.launcher.max_restarts}, from the newest complete checkpoint", flush=True)  # fmt: skip


_PLAIN = re.compile(r"[\w./@+%~ -]*")  # spaces inside a value are the grammar's own


def override(key: str, value: str) -> str:
    """``key=value`` as a job's launch passes it on: the value quoted for Hydra's override grammar when it holds
    anything the grammar reads (``=``, ``,``, brackets, quotes, leading or trailing spaces). A job directory named by its overrides
    (``hydra.sweep.subdir='${hydra.job.override_dirname}'``, what an ablation sweep uses) is
    ``.../optim=muon,train.seed=1``, which unquoted is a second override and a list."""
    value = str(value)
    if _PLAIN.fullmatch(value) and value == value.strip():
        return f"{key}={value}"
    if "'" not in value:
        return f"{key}='{value}'"
    if '"' not in value:
        return f'{key}="{value}"'
    return f"{key}='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
