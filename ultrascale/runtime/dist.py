"""Process-level runtime: environment defaults, accelerator detection, process group, rank helpers.

Works the same under ``deepspeed``, ``torchrun`` and plain ``python`` (which becomes a 1-rank group),
so the trainer never branches on how it was launched.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from ultrascale.paths import PROJECT_ROOT

if TYPE_CHECKING:
    from ultrascale.config.root import RootConfig

log = logging.getLogger("ultrascale")
# What select_accelerator decided and why, logged once logging is set up (it runs before that).
_ACCEL_NOTE: list[str] = []
# This rank's log file, named in crash reports (ultrascale/cli.py) as where the traceback went.
_LOG_FILE: list[str] = []
RESTART_ENV = "ULTRASCALE_RESTART_COUNT"
"""How many times a launch path that restarts a job itself (the train.py driver's loop over the deepspeed
launcher, the sbatch script's loop over srun) has restarted it; torchrun says TORCHELASTIC_RESTART_COUNT."""
# The CPU threads init_distributed gave this rank and why, for the banner.
_THREADS_NOTE: list[str] = []


def configure_env() -> None:
    """Defaults that must be set before torch/deepspeed import anything.

    - A private TORCH_EXTENSIONS_DIR: DeepSpeed JIT-builds C++ ops on first use, and a stale lock in a
      shared ``~/.cache/torch_extensions`` has hung runs; a project-local cache is also reused by reruns.
    - wandb offline unless the user says otherwise: no network is needed to train.
    """
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".cache" / "torch_extensions"))
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")
    import warnings

    # torch.distributed deprecation notices, once per collective call site per rank: pure noise in logs
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def detect_backend() -> str:
    """``nccl`` where this process may use a GPU (``runtime.device.accelerator``), ``gloo`` otherwise; no side
    effects."""
    from ultrascale.runtime.device import accelerator_usable

    return "nccl" if accelerator_usable() else "gloo"


def select_accelerator() -> str:
    """Pick DeepSpeed's accelerator + comm backend: CUDA/NCCL on GPUs, CPU/gloo otherwise (logged). Without a GPU
    it also sets ``DS_ACCELERATOR=cpu``, so DeepSpeed does not probe for one."""
    from ultrascale.runtime.device import accelerator

    usable, why = accelerator()
    if usable:
        note, backend = "accelerator: cuda, comm backend nccl", "nccl"
    else:
        if os.environ.get("DS_ACCELERATOR") != "cpu":
            os.environ["DS_ACCELERATOR"] = "cpu"
            why += ", so DS_ACCELERATOR=cpu"
        note, backend = f"accelerator: cpu ({why}), comm backend gloo", "gloo"
    _ACCEL_NOTE[:] = [note]
    return backend


def apply_launcher_env(env) -> None:
    """Export the ``launcher.env`` preset (NCCL etc.) before the process group exists, so NCCL reads it.

    The config wins over an inherited value: the banner logs the config, and it must be what ran.
    """
    os.environ.update({str(k): str(v) for k, v in env.items()})


def log_file() -> str | None:
    """This rank's log file, once setup_logging has opened it."""
    return _LOG_FILE[0] if _LOG_FILE else None


def strip_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends ``--local_rank=N``, which Hydra's parser rejects; LOCAL_RANK is in env."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith("--local_rank=") or a.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
            continue
        if a in ("--local_rank", "--local-rank"):
            skip = True
            continue
        out.append(a)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_min: int = 60) -> str:
    """Join (or, for plain ``python train.py``, create) the process group. Returns the backend."""
    import torch.distributed as dist

    from ultrascale.runtime.device import check_torch

    check_torch()
    backend = select_accelerator()
    if "WORLD_SIZE" not in os.environ:  # plain python: a real 1-rank group, so the code path is the same
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        import deepspeed

        from ultrascale.runtime import error_line

        error_line.passed_checks()  # a peer that failed a check this rank passed has an error of its own to say

        _init_after_torchrun_restart(backend, timedelta(minutes=timeout_min))
        deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=timeout_min))
        if backend == "gloo":  # DeepSpeed's CPU all-reduce buffers in /dev/shm: no launch leaves them behind
            from ultrascale.runtime import shm

            shm.release_own(dist.barrier)
    import torch

    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    # Ranks on one box share its cores: cores / local ranks each, whatever the launcher. A GPU rank's host work
    # (the model's init, the bf16 cast, checkpoint staging) runs on them too: under torchrun's OMP_NUM_THREADS=1
    # it ran on one core.
    threads, why = cpu_threads()
    torch.set_num_threads(threads)
    _THREADS_NOTE[:] = [f"{threads} thread(s) per rank x {local_world_size()} local rank(s) ({why})"]
    return backend


def _init_after_torchrun_restart(backend: str, timeout) -> None:
    """After a ``torchrun --max-restarts`` restart, join the process group through a store prefix of its own.

    torchrun's static rendezvous (``--master_port``, what ``launcher=torchrun`` and most users type) keeps one
    TCPStore for every attempt, and ``env://`` workers use it unprefixed (torch 2.13), so the restarted ranks read
    the dead attempt's gloo addresses and fail with "Connection refused". Prefixing by the restart count gives
    each attempt clean keys; the first attempt is left to DeepSpeed as usual."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)  # fmt: skip
    dist.init_process_group(backend, store=dist.PrefixStore(f"/ultrascale/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)  # fmt: skip


def local_world_size() -> int:
    """Ranks on this node, from whichever launcher started us: torchrun says ``LOCAL_WORLD_SIZE``, the deepspeed
    launcher ``LOCAL_SIZE``, Open MPI ``OMPI_COMM_WORLD_LOCAL_SIZE``; 1 under plain python. Reading only
    torchrun's name made every deepspeed-launched rank think it was alone and take every core."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(name, "").isdigit() and int(os.environ[name]) > 0:
            return int(os.environ[name])
    return 1


def _launcher_default_omp() -> bool:
    """True when ``OMP_NUM_THREADS`` was not the user's choice but torchrun's default: torchrun sets it to 1 for
    every worker when its own environment lacks it (and warns), which on a 16-core box with 2 ranks would leave
    14 cores idle. The parent's environment tells the two apart."""
    if os.environ.get("OMP_NUM_THREADS") != "1" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            parent = f.read().split(b"\0")
    except OSError:
        return False
    return not any(v.startswith(b"OMP_NUM_THREADS=") for v in parent)


def cpu_threads() -> tuple[int, str]:
    """(torch threads for this rank, CPU or GPU, why): the user's ``OMP_NUM_THREADS`` if they set one, otherwise this
    process's physical cores divided by the ranks on this node, so no launcher oversubscribes the cores (the
    rule: :func:`ultrascale.runtime.cpu.threads_per_rank`)."""
    from ultrascale.runtime.cpu import detect, threads_per_rank

    omp = "" if _launcher_default_omp() else os.environ.get("OMP_NUM_THREADS", "")
    return threads_per_rank(detect(), local_world_size(), omp)


def threads_note() -> str:
    """What :func:`init_distributed` chose for this rank's threads, for the banner ('' before it ran)."""
    return _THREADS_NOTE[0] if _THREADS_NOTE else ""


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_rank0() -> bool:
    return rank() == 0


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s Python object on every rank (used to share errors and decisions made on rank 0)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")
"""Native thread names of a gloo process group (its work loop and its TCP transport): while one runs, a
``ProcessGroupGloo`` is alive in this process."""


def gloo_threads() -> list[str]:
    """The gloo threads alive in this process (Linux; empty elsewhere)."""
    names = []
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return [n for n in names if n in GLOO_THREADS]


def _release_deepspeed_references() -> None:
    """Drop what DeepSpeed 0.19.8 keeps of a finished run at module level, so it is freed now.

    A ZeRO-3 model stays referenced from ``parameter_offload.FWD_MODULE_STACK`` (appended at engine setup,
    never popped) and from the ``lru_cache`` of ``PartitionedParameterCoordinator.__params_to_release`` (keyed
    by module); through the model's hooks that holds the engine, and through every partitioned parameter's
    ``ds_process_group`` the process groups. ``deepspeed.utils.groups`` keeps its own world group. Left there,
    the gloo groups are destroyed during interpreter finalization, when a gloo worker thread that needs the
    GIL is ended inside C++: ``terminate called without an active exception`` (SIGABRT) on a finished rank.
    """
    try:
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
        from deepspeed.utils import groups
    except ImportError:
        return
    parameter_offload.FWD_MODULE_STACK.clear()
    method = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    for fn in [method, *(c.cell_contents for c in method.__closure__ or ())]:  # the cache sits under @instrument_w_nvtx
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    groups._WORLD_GROUP = None
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    groups._DATA_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = groups._TENSOR_MODEL_PARALLEL_GROUP = None
    for cache in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP, groups._ALL_TO_ALL_GROUP):
        cache.clear()


def shutdown() -> None:
    """End this rank's distributed state in the order that never aborts at exit.

    Collect finished engines while their groups still exist, wait for every rank, destroy the process groups,
    then release DeepSpeed's module-level references so every ``ProcessGroupGloo`` (and its threads) is
    destroyed here, while the interpreter is whole, and not during finalization (see
    :func:`_release_deepspeed_references`). Anything still alive after that is logged by name.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    _release_deepspeed_references()
    gc.collect()
    left = gloo_threads()
    if left:
        log.warning(f"{len(left)} gloo thread(s) still alive after shutdown ({', '.join(sorted(set(left)))}): "
                    "a process group is still referenced and will be destroyed during interpreter exit")  # fmt: skip
    else:
        log.debug("shutdown: every process group destroyed, no gloo thread left")


def setup_logging(log_file: str | None = None) -> None:
    """Rank 0 logs INFO to the console; every rank logs to its own file (``logs/rank{r}.log``), DEBUG included."""
    r = rank()
    fmt = logging.Formatter(f"%(asctime)s [rank{r}] %(levelname)s %(message)s", "%H:%M:%S")
    log.handlers.clear()
    log.setLevel(logging.DEBUG)
    log.propagate = False
    if r == 0:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(message)s"))
        h.setLevel(logging.INFO)
        log.addHandler(h)
    if log_file:
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        log.addHandler(fh)
        _LOG_FILE[:] = [log_file]
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if _ACCEL_NOTE:
        log.info(f"{_ACCEL_NOTE[0]}; rank {r} of {world_size()} (local rank {local_rank()})")


def planned_world_size(cfg: RootConfig) -> int:
    """The world a config will run on: the launcher's WORLD_SIZE, or for a dry run the recipe's hardware."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if cfg.dry_run:
        return cfg.launcher.nproc_per_node * cfg.launcher.nnodes
    return 1
