"""The Ray cluster a data-prep run uses (``executor.type=ray``): joined, or started for the run, before anything is
written. datatrove's ``RayPipelineExecutor`` expects ``ray.init()`` to have happened; left to itself, its first
``ray.put`` would start a private cluster silently, whatever address the user meant. Here the address is explicit:

    local            a private Ray on this machine for the run (stopped when the run ends)
    auto             the cluster ``ray start`` runs on this node
    HOST:PORT        a head node's GCS address (``ray start --head --port=PORT``)
    ray://HOST:PORT  Ray Client (the head's client server, 10001 by default)

An address nobody answers on is one ``error:`` line naming it: a TCP connect is tried first (5 s), because
``ray.init`` on a dead address retries for a minute. The workers get the run's ``DATA_PREP_*`` variables (the
resume tests' fault points) and this checkout on ``PYTHONPATH``; outputs must be on storage every node sees.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

from ultrascale.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FORWARDED = ("DATA_PREP_", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "HF_HUB_OFFLINE")


def _host_port(address: str) -> tuple[str, int] | None:
    rest = address.removeprefix("ray://")
    host, _, port = rest.rpartition(":")
    return (host or "127.0.0.1", int(port)) if port.isdigit() else None


def _unreachable(address: str) -> str | None:
    hp = _host_port(address)
    if hp is None:
        return None
    try:
        with socket.create_connection(hp, timeout=5):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def _fix() -> str:
    return (
        "start a head with `ray start --head --port=6379` and pass executor.address=HOST:6379 (or "
        "ray://HOST:10001), or use executor.address=local for a private Ray on this machine"
    )


def connect(address: str) -> None:
    """Join the cluster at ``address`` (``local``: start a private one, which :func:`disconnect` stops)."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"executor.type=ray needs the ray package ({e}): pip install 'ray==2.60.0', or use "
                          "executor.type=local") from None  # fmt: skip
    if ray.is_initialized():
        return
    why = _unreachable(address) if address not in ("local", "auto") else None
    if why:
        raise ConfigError(f"no Ray cluster answers at executor.address={address} ({why}); {_fix()}")
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}
    kw = {"runtime_env": {"env_vars": {**env, "PYTHONPATH": os.pathsep.join(paths)}}, "log_to_driver": False,
          "configure_logging": False}  # fmt: skip
    try:
        if address == "local":
            ray.init(include_dashboard=False, **kw)
        else:
            ray.init(address=address, **kw)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"could not join the Ray cluster at executor.address={address} ({first}); "
                          f"{_fix()}") from None  # fmt: skip


def disconnect() -> None:
    """Leave the cluster (a private one stops with it); a joined cluster keeps running."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _run_rank(executor, rank: int):
    """One task, in the Ray worker process itself: a killed worker is a failed task that Ray runs again."""
    return executor._run_for_rank(rank)


def executor(pipeline: list, tasks: int, workers: int, logging_dir: str, cpus_per_task: int, mem_per_cpu_gb: float):
    """datatrove's ``RayPipelineExecutor`` whose tasks run in the worker process, as Ray tasks with retries.

    datatrove's own runs each rank in a ``multiprocess`` pool inside an actor; when the pool's process is
    killed, ``Pool.starmap`` waits for it forever and the run hangs (seen here with a killed worker). A Ray task
    whose worker dies is retried by Ray (``max_retries``), and the retry skips the units the dead one finished."""
    from datatrove.executor import RayPipelineExecutor
    from datatrove.utils.stats import PipelineStats

    class _Executor(RayPipelineExecutor):
        def run(self) -> None:
            import ray

            todo = self.get_incomplete_ranks(range(self.world_size))
            if not todo:
                return
            self.save_executor_as_json()
            ref = ray.put(self)
            memory = int(self.mem_per_cpu_gb * self.cpus_per_task * 2**30)
            task = ray.remote(_run_rank).options(num_cpus=self.cpus_per_task, memory=memory, max_retries=3)
            limit = self.workers if self.workers > 0 else len(todo)
            pending, errors = [], []
            while todo or pending:
                while todo and len(pending) < limit:
                    pending.append(task.remote(ref, todo.pop(0)))
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    ray.get(done[0])
                except Exception as e:  # the stage's check names it; keep the first line for the log
                    errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
            if errors:
                logging.getLogger("data_prep").error("ray: %d task(s) failed: %s", len(errors), errors[0])
                return
            total = PipelineStats()
            for rank in range(self.world_size):
                with self.logging_dir.open(f"stats/{rank:05d}.json", "r") as f:
                    total += PipelineStats.from_json(json.load(f))
            with self.logging_dir.open("stats.json", "wt") as f:
                total.save_to_disk(f)

    return _Executor(pipeline, tasks=tasks, workers=workers, logging_dir=logging_dir, cpus_per_task=cpus_per_task,
                     mem_per_cpu_gb=mem_per_cpu_gb)  # fmt: skip
