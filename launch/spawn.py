"""Re-run ``train.py <overrides>`` under a multi-rank launcher from one driver process.

``python train.py launcher=deepspeed`` and every job of a ``-m`` sweep come through here, so a sweep job
is exactly the command a user would type by hand: ``deepspeed --num_gpus N train.py <overrides>``.
The ranks see ``WORLD_SIZE`` from their launcher and therefore run the job instead of spawning again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from launch.hostfile import read_hostfile
from ultrascale.config.compose import PROJECT_ROOT, resolve_path
from ultrascale.config.schema import LauncherName
from ultrascale.dist import free_port
from ultrascale.errors import ConfigError
from ultrascale.jsonio import write_json

SPAWNING = (LauncherName.deepspeed, LauncherName.torchrun)
STATUS_FILE = "job_status.json"


class JobFailed(RuntimeError):
    """A spawned launcher exited non-zero; its ranks have already printed why."""


def is_driver(cfg: DictConfig) -> bool:
    """True when this process should start a launcher (or submit to Slurm) rather than train itself.

    A process started by a launcher has ``WORLD_SIZE`` set; a dry run only prints, whatever the launcher.
    """
    if "launcher" not in cfg or cfg.get("dry_run", False) or "WORLD_SIZE" in os.environ:
        return False
    return cfg.launcher.name in (*SPAWNING, LauncherName.slurm)


def _exe(name: str) -> str:
    """The launcher from this interpreter's environment (a venv's bin/ is often not on PATH)."""
    p = Path(sys.executable).parent / name
    return str(p) if p.exists() else name


def launcher_argv(cfg: DictConfig, script: str, args: list[str], port: int | None = None) -> list[str]:
    """The launcher command line for one run of ``script args`` with ``cfg.launcher``'s shape."""
    lc = cfg.launcher
    port = port or lc.master_port or free_port()
    if lc.name == "deepspeed":
        cmd = [_exe("deepspeed")]
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
        return [_exe("torchrun"), "--nproc_per_node", str(lc.nproc_per_node), "--master_port", str(port), script, *args]
    raise ConfigError(f"launcher.name={lc.name!r} does not spawn a launcher: choose one of {list(SPAWNING)}")


def launch_env(cfg: DictConfig) -> dict[str, str]:
    """This environment plus the network preset, so the launcher (and pdsh to other nodes) carries it."""
    return {**os.environ, **{k: str(v) for k, v in cfg.launcher.env.items()}, "PYTHONUNBUFFERED": "1"}


def run_launcher(cmd: list[str], env: dict[str, str], out_dir: Path) -> int:
    """Run the launcher, streaming its output to the console and to ``<out_dir>/launcher.log``.

    The driver is not a rank, so creating the run directory here does not race with the ranks.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    print("launching: " + " ".join(cmd), flush=True)
    with open(out_dir / "launcher.log", "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(
            cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        except KeyboardInterrupt:  # the launcher got the same SIGINT and tears its ranks down
            rc = proc.wait()
            raise
        finally:
            sys.stdout.flush()
    write_json(out_dir / STATUS_FILE, {"returncode": rc, "command": cmd}, indent=None)
    return rc


def spawn(cfg: DictConfig, script: str, args: list[str]) -> int:
    """Start ``script args`` under ``cfg.launcher`` and wait; returns the launcher's exit code."""
    cmd = launcher_argv(cfg, str(Path(script).resolve()), args)
    return run_launcher(cmd, launch_env(cfg), resolve_path(cfg.output_dir))
