"""Shared entry-point plumbing for train.py / eval.py / plan.py.

Single runs compose the config directly (fast, one-line errors, and no per-rank Hydra run directory);
``-m`` sweeps and Hydra's own flags (--help, --cfg, --info, ...) go through ``@hydra.main`` so its
launchers and help work as documented. Either way ``--local_rank=N`` from the deepspeed launcher is
stripped first, and an UltrascaleError becomes ``error: <message>`` with exit code 2.

A config with ``launcher=deepspeed|torchrun|slurm`` run from a plain shell (no launcher around it) is a
driver: it starts that launcher (or submits to Slurm) with the same overrides instead of training itself,
once for a single run and once per job of a ``-m`` sweep (see ``launch/``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from ultrascale.config.describe import help_if_asked
from ultrascale.errors import ConfigError, UltrascaleError
from ultrascale.runtime import error_line
from ultrascale.runtime.dist import apply_launcher_env, configure_env, strip_local_rank

if TYPE_CHECKING:
    from ultrascale.config.root import RootConfig

HYDRA_FLAGS = {"-m", "--multirun", "--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve",
               "--package", "-p", "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun"}  # fmt: skip
# Driver-side sweep bookkeeping (sweep dir for the summary); see launch/sweep.py.
SWEEP_CALLBACK = "+hydra.callbacks.ultrascale_sweep._target_=launch.sweep.SweepRecorder"
# Signs that this rank failed only because a peer died mid-collective (gloo/NCCL connection loss).
_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed")


DELAY_RANK0_ERROR_ENV = "ULTRASCALE_FAULT_DELAY_RANK0_ERROR_S"
"""Test hook: rank 0 sleeps this long before its error line, as a slow or loaded rank 0 would."""
KILL_RANK0_ERROR_ENV = "ULTRASCALE_FAULT_KILL_RANK0_ON_ERROR"
"""Test hook: rank 0 is SIGKILLed instead of saying its error, as an out-of-memory kill would end it."""


def _report(e: UltrascaleError) -> int:
    """One ``error:`` line per failed launch, rank 0's where rank 0 has it (see :mod:`ultrascale.runtime.error_line`): the
    other ranks wait for it rather than exit first (the launcher would SIGTERM rank 0 before it printed), and
    say their own ``error: rank N: ...`` when rank 0 never says it."""
    rank = int(os.environ.get("RANK", "0"))
    if error_line.is_speaker():
        if delay := os.environ.get(DELAY_RANK0_ERROR_ENV) if rank == 0 else None:
            time.sleep(float(delay))
        if os.environ.get(KILL_RANK0_ERROR_ENV) and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    elif error_line.wait_for_speaker(_dist_initialized()):
        return 2  # the speaker said it
    error_line.say(str(e), rank)
    return 2


def _dist_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _report_crash(e: Exception) -> int:
    """An unexpected exception on one rank: one line naming the rank and the error, the traceback in that
    rank's log file, and exit 1 so the launcher tears the other ranks down instead of leaving them hanging."""
    from ultrascale.runtime.dist import log_file

    r = os.environ.get("RANK", "0")
    first = (str(e).strip().splitlines() or [""])[0]
    where = log_file()
    if where:
        with open(where, "a") as f:
            traceback.print_exception(e, file=f)
        tail = f" (traceback in {where})"
    else:  # failed before the run directory existed: there is no log file, so the traceback goes here
        traceback.print_exception(e, file=sys.stderr)
        tail = ""
    if any(s in str(e).lower() for s in _PEER_LOSS):
        if error_line.read(error_line.SAID) is not None:  # a peer said why it left: that is the one line
            return 1
        msg = f"error: rank {r} stopped: lost contact with another rank ({type(e).__name__}: {first}){tail}"
    else:
        msg = f"error: rank {r} failed: {type(e).__name__}: {first}{tail}"
    print(msg, file=sys.stderr, flush=True)
    return 1


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _drive(cfg: RootConfig, args: list[str]) -> int:
    """Start this run under ``cfg.launcher`` (or submit it to Slurm) from the driver process."""
    from launch.slurm import submit_run
    from launch.spawn import spawn

    if cfg.launcher.name == "slurm":
        submit_run(cfg, args, sys.argv[0])
        return 0
    res = spawn(cfg, sys.argv[0], args)
    from ultrascale.paths import resolve_path

    out = resolve_path(cfg.output_dir)
    if res.stopped and res.returncode == 0:
        print(f"stopped by {res.stopped} with a checkpoint: run the same command again to resume", flush=True)
    elif res.returncode != 0:
        where = out / "logs" if (out / "logs").is_dir() else out / "launcher.log"  # the ranks may never have started
        print(f"error: {cfg.launcher.name} exited with code {res.returncode}; see {where}", file=sys.stderr, flush=True)
    return res.returncode


def _sweep_job(cfg: DictConfig, hc: Any, explicit_out: bool) -> Any:
    """One ``-m`` job driven from the sweep process: its own launcher (or sbatch) and run directory. ``cfg`` is
    Hydra's composed DictConfig: the job's extras are written into it by key path."""
    from launch.slurm import submit_run
    from launch.spawn import JobFailed, override, spawn
    from launch.sweep import job_extras

    extras = job_extras(cfg.logger, hc.runtime.output_dir, hc.sweep.dir, hc.job.num)
    if explicit_out:
        extras.pop("output_dir")
    for k, v in extras.items():
        node, leaf = cfg, k.split(".")
        for part in leaf[:-1]:
            node = node[part]
        node[leaf[-1]] = v
    args = [o for o in hc.overrides.task if _key(o) not in extras] + [override(k, v) for k, v in extras.items()]
    if cfg.launcher.name == "slurm":
        return submit_run(cfg, args, sys.argv[0])
    res = spawn(cfg, sys.argv[0], args)
    if res.stopped:  # the user stopped the sweep: this job saved a checkpoint; the rest do not start
        raise JobFailed(
            f"sweep stopped by {res.stopped} at job {hc.job.num} ({' '.join(hc.overrides.task)}), which saved a "
            "checkpoint: run the same sweep again to resume it (finished jobs resume at their last step)"
        )
    if res.returncode != 0:
        raise JobFailed(
            f"sweep job {hc.job.num} ({' '.join(hc.overrides.task)}) failed: {cfg.launcher.name} exited with "
            f"code {res.returncode}; see {cfg.output_dir}/launcher.log and {cfg.output_dir}/logs/"
        )
    return res.returncode


def _objective(hc: Any, cfg: DictConfig, result: Any) -> Any:
    """What a search sweeper (Optuna) minimizes: the run's final eval loss, from its summary.json (a sweep job on
    its own launcher returns only an exit code). Grid sweeps keep the job's own return value."""
    if "optuna" not in str(hc.sweeper.get("_target_", "")).lower():
        return result
    from ultrascale.jsonio import read_json
    from ultrascale.paths import resolve_path
    from ultrascale.train.rundir import SUMMARY

    summary = result if isinstance(result, dict) else read_json(resolve_path(cfg.output_dir) / SUMMARY)
    loss = summary.get("eval_loss")
    return float(loss) if loss is not None else float("nan")


def _hydra_main(config_name: str, main: Callable[[Any], Any], argv: list[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ultrascale.config.root import register_configs
    from ultrascale.paths import CONF_DIR

    register_configs()
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if multirun and config_name == "train":
        argv = [*argv, SWEEP_CALLBACK]
    sys.argv = [sys.argv[0], *argv]
    explicit_out = any(a.startswith("output_dir=") for a in argv)

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def _job(cfg: DictConfig) -> Any:
        from launch.spawn import is_driver

        hc = HydraConfig.get()
        try:
            if hc.mode == RunMode.MULTIRUN and "launcher" in cfg:
                if is_driver(cfg):
                    return _objective(hc, cfg, _sweep_job(cfg, hc, explicit_out))
                from launch.sweep import job_extras

                extras = job_extras(cfg.logger, hc.runtime.output_dir, hc.sweep.dir, hc.job.num)
                if not explicit_out:
                    cfg.output_dir = extras["output_dir"]  # one run dir per sweep job
                cfg.logger.wandb_group, cfg.logger.run_name = extras["logger.wandb_group"], extras["logger.run_name"]
            elif hc.mode == RunMode.MULTIRUN and not explicit_out and "output_dir" in cfg:
                cfg.output_dir = hc.runtime.output_dir  # one run dir per sweep job
            if "launcher" in cfg:
                apply_launcher_env(cfg.launcher.env)
            from ultrascale.config.compose import typed

            return _objective(hc, cfg, main(typed(cfg)))
        except UltrascaleError as e:
            raise SystemExit(_report(e)) from None

    try:
        _job()
    finally:
        if multirun and config_name == "train":
            from launch.sweep import ACTIVE, report

            if "dir" in ACTIVE:
                print(report(ACTIVE.pop("dir")), flush=True)
    return 0


def _split_config_dirs(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without Hydra's ``--config-dir DIR`` / ``-cd DIR`` / ``--config-dir=DIR``, the dirs)."""
    rest, dirs, it = [], [], iter(argv)
    for a in it:
        if a in ("--config-dir", "-cd"):
            dirs.append(next(it, ""))
        elif a.startswith("--config-dir="):
            dirs.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    return rest, dirs


def check_config_dirs(dirs: list[str], syntax: bool) -> None:
    """A user's config directory must exist; with ``syntax`` every YAML in it must parse (before a sweep starts
    under Hydra's own error reporting): a syntax error is one line naming the file, line and column."""
    import yaml

    for d in dirs:
        root = Path(d)
        if not root.is_dir():
            raise ConfigError(f"--config-dir {d}: no such directory (it holds your own recipes or group options)")
        for f in sorted(root.rglob("*.yaml")) if syntax else []:
            try:
                yaml.safe_load(f.read_text())
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                raise ConfigError(f"{f}{where}: {problem}: fix the YAML syntax") from None


MAX_PRECHECKED_JOBS = 256


PLUGINS = {
    "hydra/sweeper=optuna": ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper==1.3.0"),
    "hydra/launcher=submitit_local": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher==1.2.0"),
    "hydra/launcher=submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher==1.2.0"),
}
"""Hydra plugins a sweep may name, the module that registers each and the package that ships it."""


def _plugins_wanted(argv: list[str]) -> list[tuple[str, str]]:
    """(what asked for it, plugin choice) for every plugin a sweep's arguments select, directly or through an
    ``hparams_search`` option whose defaults override the sweeper."""
    from ultrascale.paths import CONF_DIR

    wanted = []
    for a in argv:
        key, _, value = a.lstrip("+~").partition("=")
        if f"{key}={value}" in PLUGINS:
            wanted.append((a, f"{key}={value}"))
        elif key == "hparams_search" and (CONF_DIR / "hparams_search" / f"{value}.yaml").is_file():
            text = (CONF_DIR / "hparams_search" / f"{value}.yaml").read_text()
            for choice in PLUGINS:
                group, _, option = choice.partition("=")
                if f"override /{group}: {option}" in text:
                    wanted.append((a, choice))
    return wanted


def check_plugins(argv: list[str]) -> None:
    """A Hydra plugin the sweep needs and this environment lacks is one line naming the package, not Hydra's
    "Could not find 'hydra/sweeper/optuna'" three lines into a traceback."""
    import importlib.util

    for asked, choice in _plugins_wanted(argv):
        module, package = PLUGINS[choice]
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            via = "" if asked == choice else f" ({choice})"
            raise ConfigError(f"{asked}{via} needs the Hydra plugin {package.split('==')[0]}, which is not installed: "
                              f"pip install {package} (requirements.txt pins it)")  # fmt: skip


def check_sweep(config_name: str, argv: list[str], config_dirs: list[str]) -> int:
    """Compose every job of a ``-m`` sweep before the first one starts, through the same checks as a single run
    (unknown keys with or without ``+``, ranges, types): a typo in the sweep's third value is one ``error:`` line
    now, not Hydra's multi-line message or a negative interval accepted after two finished jobs. A value Hydra
    can only expand itself (``glob(...)``) is left to Hydra. Returns the number of jobs composed."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from ultrascale.config.compose import compose

    args = [a for a in argv if not a.startswith("-") and not _key(a).startswith(("hydra.", "hydra/"))]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except HydraException as e:
        raise ConfigError(f"cannot parse the sweep overrides {args}: {str(e).splitlines()[0]}") from None
    axes: list[list[str]] = []
    for o in parsed:
        if not o.is_sweep_override():
            axes.append([o.input_line])
            continue
        try:
            axes.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        except HydraException:
            continue  # glob(...) needs Hydra's config loader: Hydra checks those jobs itself
    jobs = list(itertools.islice(itertools.product(*axes), MAX_PRECHECKED_JOBS))
    for job in jobs:
        compose(list(job), config_name, config_dirs=config_dirs)
    return len(jobs)


def _hydra_keys(argv: list[str]) -> list[str]:
    return [a for a in argv if _key(a).startswith(("hydra.", "hydra/"))]


def run_app(config_name: str, main: Callable[[Any], Any], help_text: str, argv: list[str] | None = None) -> int:
    """Compose ``conf/<config_name>.yaml`` with ``argv`` (or run Hydra's ``-m`` sweep), convert it to its typed
    dataclasses and call ``main`` with them; errors are one line and an exit code."""
    configure_env()
    argv = strip_local_rank(list(sys.argv[1:] if argv is None else argv))
    from ultrascale.config.compose import mergeable

    argv = mergeable(argv)
    rest, config_dirs = _split_config_dirs(argv)
    hydra_mode = any(a.split("=", 1)[0] in HYDRA_FLAGS for a in rest)
    try:
        check_config_dirs(config_dirs, syntax=hydra_mode)
    except ConfigError as e:
        return _report(e)
    if (rc := help_if_asked(config_name, argv, help_text)) is not None:
        return rc
    if hydra_mode:
        if any(a in ("-m", "--multirun") for a in argv) and "WORLD_SIZE" in os.environ:
            return _report(
                ConfigError(
                    "-m inside a multi-rank launcher would run the whole sweep on every rank: start the sweep "
                    "from a plain shell and let each job start its own launcher, e.g. "
                    "`python train.py -m optim.lr=1e-4,3e-4 launcher=deepspeed launcher.nproc_per_node=2`"
                )
            )
        if any(a in ("-m", "--multirun") for a in argv):
            try:
                check_plugins(rest)
                check_sweep(config_name, rest, config_dirs)
            except ConfigError as e:
                return _report(e)
        return _hydra_main(config_name, main, argv)
    from ultrascale.config.compose import compose
    from ultrascale.runtime.dist import shutdown

    try:
        if _hydra_keys(rest):
            raise ConfigError(
                f"{_hydra_keys(rest)[0]}: a single run does not use Hydra's job directory or settings (they apply to "
                "-m sweeps, e.g. hydra.sweep.dir=DIR); the run directory is output_dir: use output_dir=DIR"
            )
        cfg = compose(rest, config_name, config_dirs=config_dirs)
        if "launcher" in cfg:
            from launch.spawn import is_driver

            if is_driver(cfg):
                return _drive(cfg, argv)
            apply_launcher_env(cfg.launcher.env)
        from ultrascale.config.compose import typed

        main(typed(cfg))  # the composed DictConfig becomes its dataclasses here, once: main and below read those
    except UltrascaleError as e:
        return _report(e)
    except KeyboardInterrupt:  # Ctrl-C before training took over the signal (composing, checking, importing)
        if int(os.environ.get("RANK", "0")) == 0:
            print("error: interrupted (SIGINT) before training started: nothing to save", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # a bug or a crash: say which rank, keep the traceback, and let the launcher stop all
        return _report_crash(e)
    shutdown()  # only on success: a barrier after a failure would hang the ranks that did not fail
    return 0
