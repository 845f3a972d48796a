#!/usr/bin/env python3
"""The GPU probe: one command, at most 8 minutes on one GPU with no network, that says what the project does there.

It installs the dependencies from the running Python's wheelhouse (``make wheelhouse PY_VERSION=X.Y``; the node's
own torch, CUDA and Triton are used), then runs its sections (install, data, llama_1b, sampler, trainer,
recompute, zero, export, levers) as subprocesses under their own time limits, so a failed or slow section is a row
with its error. The default run is the sections whose limits fit ``--budget``; ``--dry-run`` prints that plan and
the further calls. The JSON (``--json``) is rewritten after every step, logs beside it. ``--job tiny`` runs the
sections on the tiny model on a CPU host, which is how the probe is checked. Each section: bench/README.md, "The GPU
probe".

    python bench/gpu_probe.py [--dry-run] [--sections llama_1b,trainer] [--levers train.compile] [--budget 470]
                              [--wheelhouse wheelhouse/py3.12] [--work DIR] [--json PATH] [--job gpu|tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LEVERS: dict[str, tuple[str, ...]] = {
    "train.attention_kernel": ("flex", "sdpa"),
    "train.loss_kernel": ("liger", "chunked"),
    "train.activation_checkpointing": ("none", "selective", "full"),
    "train.compile": ("true", "false"),
    "train.checkpoint_staging": ("pinned", "pageable"),
}
"""Each lever of the llama_1b job and the values compared. A row sets one key, everything else stays at the
recipe's decided default."""

SECTIONS = ("install", "data", "llama_1b", "sampler", "trainer", "recompute", "zero", "export", "grpo", "levers")
"""In the order a call runs them: what the GPU goals need first."""
LIMITS: dict[str, float] = {  # each step's own time limit, seconds
    "pip": 40, "versions": 15, "smoke": 25, "data": 35,
    "llama_1b": 170, "predict": 20, "micro": 40,
    "sampler": 75, "trainer": 140, "recompute": 90,
    "zero_first": 50, "zero_resume": 40,
    "tokenizer": 10, "export": 20, "logits": 25,
    "lever": 110, "grpo": 140, "grpo_predict": 25,
}  # fmt: skip
"""A lever row's limit is one train.py launch of the 1B job (build, compile, 6 steps)."""
ALWAYS = ("install", "data")
NEEDS = {"trainer": "llama_1b", "export": "zero"}
"""A section that reads another's run: a call with the one and not the other runs the other's run step first."""
DEFAULT_BUDGET_S = 470.0
LLAMA_STEPS, LEVER_STEPS = 8, 6
GRPO_STEPS = 5
"""The GRPO row's steps: the first (building the sampler's CUDA graphs) is left out of the medians."""
ZERO_STEPS, ZERO_RESUME_STEPS = 6, 8
GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL for what a step leaves running."""
SKIP_UNMEASURED = ("train.final_eval=false", "train.final_save=false", "train.param_digest=false")
"""The probe's timing runs measure steps (and the llama row its interval saves), not the end of a run."""


@dataclass(frozen=True)
class Job:
    """What the sections train. ``gpu`` is the probe; ``tiny`` runs the same sections, commands and parsers on the
    tiny model on a CPU host (``DS_ACCELERATOR=cpu``), to check the probe itself where no GPU is."""

    train: tuple[str, ...]
    """The main job's overrides (every lever at its decided default)."""
    seq: int
    zero_model: str
    sampler_model: str
    sampler_args: tuple[str, ...]
    trainer_mode: str
    micro_gb: float = 4.0
    """The staging micro-benchmark's state size (bench/checkpoint_stall.py --micro)."""
    grpo: tuple[str, ...] = ("precision=bf16",)
    """The GRPO row's overrides of the recipe."""
    cpu: bool = False


JOBS = {
    "gpu": Job(("recipe=llama_1b_zero0", "launcher.nproc_per_node=1", "data.global_batch=8", "logger=none",
                "train.keep_checkpoints=1", "train.log_interval=1", *SKIP_UNMEASURED), 4096, "smollm2_135m",
               "smollm2_135m", ("--limit", "32", "--max-new-tokens", "128"), "tuned+bf16+like"),
    "tiny": Job(("recipe=cpu_smoke", "launcher.nproc_per_node=1", "data.global_batch=8", "logger=none",
                 "train.keep_checkpoints=1", "train.log_interval=1", *SKIP_UNMEASURED), 256, "tiny", "tiny",
                ("--limit", "2", "--max-new-tokens", "8"), "default+like", micro_gb=0.2,
                grpo=("grpo.max_completion_length=16", "data.micro_batch=16"), cpu=True),
}  # fmt: skip
"""``gpu``: the first GPU run's job (llama_1b_zero0, micro 8 x 4,096 tokens on one GPU, no accumulation), SmolLM2-135M
for ZeRO and the sampler."""


@dataclass
class Step:
    """One thing the probe runs: a command (or several side by side), its time limit and where its log goes."""

    section: str
    name: str
    cmds: list[list[str]]
    budget_s: float
    parse: str = ""
    """Which parser turns the finished step into rows (a function name in ``PARSERS``)."""
    args: dict = field(default_factory=dict)
    measures: str = ""
    """The figures its rows report (printed by the dry run)."""


def default_wheelhouse() -> Path:
    """The running Python's wheelhouse: wheels are built per Python version (``make wheelhouse PY_VERSION=X.Y``)."""
    return ROOT / "wheelhouse" / f"py{sys.version_info.major}.{sys.version_info.minor}"


class Plan:
    """Every step with its paths fixed up front, so ``--dry-run`` prints exactly what a run would run."""

    def __init__(self, work: Path, wheelhouse: Path, sections: list[str], levers: dict[str, tuple[str, ...]],
                 py: str = sys.executable, job: str = "gpu"):  # fmt: skip
        self.work, self.wheelhouse, self.py, self.job = work, wheelhouse, py, JOBS[job]
        self.site, self.logs = work / "site", work / "logs"
        self.data_main, self.data256 = work / f"data{self.job.seq}", work / "data256"
        self.sampler_model = work / f"{self.job.sampler_model}_random"
        self.sections = [s for s in SECTIONS if s in ALWAYS or s in sections]
        self.levers = levers
        self.steps: list[Step] = []
        for s in self.sections:
            getattr(self, f"_{s}")(levers)

    @property
    def total_s(self) -> float:
        return sum(s.budget_s for s in self.steps)

    def torchrun(self, *args: str) -> list[str]:
        return [self.py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *args]

    def add(self, section: str, name: str, cmds: list[list[str]], parse: str = "", budget: float = 0.0,
            measures: str = "", **args) -> None:  # fmt: skip
        self.steps.append(Step(section, name, cmds, budget, parse, args, measures))

    def _install(self, _levers) -> None:
        self.add("install", "pip install --no-index (or this Python's own packages)",
                 [[self.py, __file__, "--worker", "install", str(self.wheelhouse), str(self.site)]], "installed",
                 LIMITS["pip"], "what was installed, or why nothing was")  # fmt: skip
        self.add("install", "imports", [[self.py, __file__, "--worker", "versions"]], "versions", LIMITS["versions"],
                 "versions of python, torch, CUDA, DeepSpeed, transformers, liger/triton; the GPU")  # fmt: skip
        self.add("install", "torch.compile + flex_attention smoke test", [[self.py, __file__, "--worker", "smoke"]],
                 "smoke", LIMITS["smoke"], "compile seconds; the missing C compiler or Python.h by name",
                 prereq=False)  # fmt: skip

    def _data(self, _levers) -> None:
        self.add("data", f"byte corpus (several documents a row) + random-init {self.job.sampler_model}",
                 [[self.py, __file__, "--worker", "data", str(self.work), str(self.job.seq), self.job.sampler_model]],
                 "data", LIMITS["data"], "rows and documents per row")  # fmt: skip

    def _llama_run(self) -> Path:
        """The llama_1b run: MFU, tokens/s and the checkpoint stall of two interval saves (3 and 6: no final
        save, no final eval, no parameter digest)."""
        run = self.work / "llama_base"
        self.add("llama_1b", f"{self.job.train[0].split('=')[1]}, decided levers",
                 [self.torchrun("train.py", *self.job.train, f"data.path={self.data_main}", f"train.steps={LLAMA_STEPS}",
                                f"train.checkpoint_interval={LLAMA_STEPS // 2 - 1}", "train.eval_interval=0",
                                f"output_dir={run}")], "train_run", LIMITS["llama_1b"],
                 "tokens/s, MFU, peak memory; checkpoint stall per save", run=str(run), checkpoints=True,
                 cleanup=True)  # fmt: skip
        return run

    def _llama_1b(self, _levers) -> None:
        run = self._llama_run()
        self.add("llama_1b", "planner prediction", [[self.py, __file__, "--worker", "predict", str(run)]], "predict",
                 LIMITS["predict"], "predicted vs measured step time (error %)", run=str(run))  # fmt: skip
        out = self.work / "staging.json"
        self.add("llama_1b", f"staging copy alone, {self.job.micro_gb:g} GB, pinned vs pageable",
                 [[self.py, "bench/checkpoint_stall.py", "--micro", f"{self.job.micro_gb:g}", "--json", str(out)]],
                 "micro", LIMITS["micro"], "staging GB/s pinned vs pageable (the stall's floor)",
                 out=str(out))  # fmt: skip

    def _sampler(self, _levers) -> None:
        self.add("sampler", "bench_generate.py vs HF generate",
                 [[self.py, "bench/bench_generate.py", "--model", str(self.sampler_model), *self.job.sampler_args,
                   "--json", str(self.work / "generate.json")]], "generate", LIMITS["sampler"],
                 "tokens/s ours and HF's, speed ratio at batch 8/32/HF's best, greedy identity (random init: "
                 "identity is mostly near ties)",
                 out=str(self.work / "generate.json"), random_init=True)  # fmt: skip

    def _trainer(self, _levers) -> None:
        run = self.work / "llama_base"
        if not any(s.args.get("run") == str(run) for s in self.steps):  # the run it compares with, and reads
            self._llama_run()
        mode = self.job.trainer_mode
        self.add("trainer", f"HF Trainer + DeepSpeed ({mode})",
                 [self.torchrun("bench/_trainer_loop.py", str(run), str(self.data_main), str(LLAMA_STEPS),
                                str(self.work / "trainer_out"), mode)], "trainer", LIMITS["trainer"],
                 "Trainer tokens/s (same per-step median), speed ratio ours / Trainer, like for like or not",
                 run=str(run))  # fmt: skip

    def _recompute(self, _levers) -> None:
        self.add("recompute", "selective recompute under torch.compile with gradients (sdpa, flex)",
                 [[self.py, __file__, "--worker", "recompute"]], "recompute", LIMITS["recompute"],
                 "per attention kernel, forward re-runs of the attention and of the GEMMs in the Inductor-compiled "
                 "backward of a selectively checkpointed layer (0 kept); a CPU cannot show this: it runs Inductor's "
                 "partition with eager kernels and aten SDPA only (tests/test_recompute_flex.py), and torch refuses "
                 "compiled FlexAttention with gradients there")  # fmt: skip

    def _zero(self, _levers) -> None:
        common = [f"model={self.job.zero_model}", "precision=bf16", f"data.path={self.data256}", "data.micro_batch=4",
                  "data.global_batch=8", "logger=none", "train.compile=false", "launcher.nproc_per_node=1",
                  "train.param_digest=false"]  # fmt: skip
        first, resume = [], []
        for s in range(4):
            run = self.work / f"zero{s}"
            args = [*common, f"zero=stage{s}", f"output_dir={run}"]
            first.append(self.torchrun("train.py", *args, f"train.steps={ZERO_STEPS}",
                                       f"train.checkpoint_interval={ZERO_STEPS // 2}",
                                       f"train.eval_interval={ZERO_STEPS}"))  # fmt: skip
            resume.append(self.torchrun("train.py", *args, f"train.steps={ZERO_RESUME_STEPS}",
                                        f"train.checkpoint_interval={ZERO_STEPS // 2}",
                                        f"train.eval_interval={ZERO_RESUME_STEPS}",
                                        "train.allow_schedule_change=true"))  # fmt: skip
        runs = [str(self.work / f"zero{s}") for s in range(4)]
        self.add("zero", "ZeRO 0/1/2/3 bf16: train, eval, checkpoint", first, "zero_first", LIMITS["zero_first"],
                 "loss falls, eval loss, latest checkpoint per stage", runs=runs)  # fmt: skip
        if "zero" in self.sections:
            self.add("zero", "ZeRO 0/1/2/3 bf16: resume to a longer schedule", resume, "zero_resume",
                     LIMITS["zero_resume"], "resumed step and steps logged per stage", runs=runs)  # fmt: skip

    def _export(self, levers) -> None:
        if not any(s.parse == "zero_first" for s in self.steps):  # the ZeRO-3 checkpoint it exports
            self._zero(levers)
        run, out = self.work / "zero3", self.work / "hf_zero3"
        self.add("export", "the byte corpus gets the sampler model's tokenizer (export copies it)",
                 [[self.py, __file__, "--worker", "tokenizer", str(self.sampler_model), str(self.data256)]], "ok",
                 LIMITS["tokenizer"])  # fmt: skip
        self.add("export", "export the ZeRO-3 checkpoint",
                 [[self.py, "-m", "ultrascale.export", f"run_dir={run}", f"out={out}", "overwrite=true"]], "ok",
                 LIMITS["export"], "the HF directory is written")  # fmt: skip
        self.add("export", "from_pretrained logits vs the engine's",
                 [self.torchrun(__file__, "--worker", "logits", str(run), str(out))], "logits", LIMITS["logits"],
                 "logits difference (max, relative), argmax agreement")  # fmt: skip

    def _grpo(self, _levers) -> None:
        """The GRPO recipe's step on one GPU (random-init sampler model, bf16, the format reward: no sandbox needed)
        against the planner's prediction of it (:mod:`ultrascale.plan.grpo`)."""
        run = self.work / "grpo"
        self.add("grpo", "smollm2_135m_grpo on one GPU: steps/s, generation share",
                 [self.torchrun("train.py", "recipe=smollm2_135m_grpo", f"model.pretrained_path={self.sampler_model}",
                                "launcher.nproc_per_node=1", *self.job.grpo, "grpo.reward_funcs=[format]",
                                f"train.steps={GRPO_STEPS}", "train.checkpoint_interval=0", "logger=none",
                                *SKIP_UNMEASURED, f"output_dir={run}")], "grpo", LIMITS["grpo"],
                 "steps/s, generated tokens/s, generation share of the step (gen_s / step_s), the step's parts",
                 run=str(run), cleanup=True)  # fmt: skip
        self.add("grpo", "planner prediction of the GRPO step", [[self.py, __file__, "--worker", "grpo_predict",
                                                                  str(run)]], "grpo_predict", LIMITS["grpo_predict"],
                 "predicted generation share and step time vs measured", run=str(run))  # fmt: skip

    def _levers(self, levers) -> None:
        for key, values in levers.items():
            for value in values:
                run = self.work / f"lever_{key.split('.')[-1]}_{value}"
                ckpt = key == "train.checkpoint_staging"
                self.add("levers", f"{key}={value}",
                         [self.torchrun("train.py", *self.job.train, f"data.path={self.data_main}",
                                        f"train.steps={LEVER_STEPS}", "train.eval_interval=0",
                                        f"train.checkpoint_interval={LEVER_STEPS // 2 if ckpt else 0}",
                                        f"{key}={value}", f"output_dir={run}")],
                         "train_run", LIMITS["lever"], "tokens/s, MFU, peak memory" + ("; stall" if ckpt else ""),
                         run=str(run), checkpoints=ckpt, key=key, value=value, cleanup=True)  # fmt: skip

    def env(self) -> dict[str, str]:
        """What every subprocess runs with: the wheelhouse's packages first, then the node's own (torch)."""
        path = os.pathsep.join([str(self.site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TORCH_EXTENSIONS_DIR": str(self.work / "torch_extensions"),
                "ULTRASCALE_CACHE_DIR": str(self.work / "cache"), "PYTHONNOUSERSITE": "1",
                **({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"} if self.job.cpu else {})}  # fmt: skip


def plan_calls(sections: list[str], levers: dict[str, tuple[str, ...]], budget: float, job: str = "gpu",
               work: Path = Path("WORK")) -> list[tuple[list[str], dict[str, tuple[str, ...]], float]]:  # fmt: skip
    """The asked sections split into device calls whose step limits each fit ``budget``: (sections, levers,
    planned seconds) per call, in section order. Each call is a bare machine (install and data again); a lever
    key is the smallest unit (its rows compare with each other)."""
    units: list[tuple[str, dict]] = [(s, {}) for s in SECTIONS if s in sections and s not in ALWAYS and s != "levers"]
    if "levers" in sections:
        units += [("levers", {k: v}) for k, v in levers.items()]
    calls: list[tuple[list[str], dict, float]] = []
    cur: tuple[list[str], dict] = ([], {})

    def total(secs: list[str], lev: dict) -> float:
        return Plan(work, work, secs, lev, job=job).total_s

    for sec, lev in units:
        trial = ([*cur[0], *([sec] if sec not in cur[0] else [])], {**cur[1], **lev})
        if cur[0] and total(*trial) > budget:
            calls.append((*cur, total(*cur)))
            trial = ([sec], dict(lev))
        cur = trial
    if cur[0] or not calls:
        calls.append((*cur, total(*cur)))
    return calls


def call_args(sections: list[str], levers: dict) -> str:
    out = f"--sections {','.join(sections) or 'install'}"
    if "levers" in sections and set(levers) != set(LEVERS):
        out += f" --levers {','.join(levers)}"
    return out


# ---- running ------------------------------------------------------------------------------------------------------


def become_subreaper(on: bool = True) -> bool:
    """Make this process the parent of every orphan among its descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so
    a grandchild whose parent died, even one that called ``setsid``, is still found among our descendants.
    ``on=False`` hands orphans back to init (the end of :func:`execute`, for a caller that goes on: a test)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def own_children() -> set[int]:
    """Pids of this process's descendants now: what was running before a step started (a caller's own workers,
    e.g. torch.compile's pool in a test process) is not the step's to kill."""
    import psutil

    return {k.pid for k in psutil.Process().children(recursive=True)}


def descendants(roots: list[int], rounds: int = 3, exclude: set[int] | frozenset[int] = frozenset()) -> dict:
    """Every live descendant of ``roots`` (and of this process: orphans re-parented to the subreaper, less the
    ``exclude`` pids that were ours before the step), as psutil processes by pid. Collected ``rounds`` times
    before anything is signalled: a process may fork while we look, and torchrun's workers are in sessions of
    their own, which a process-group signal misses."""
    import psutil

    found: dict = {}
    for _ in range(rounds):
        for pid in [*roots, os.getpid()]:
            try:
                proc = psutil.Process(pid)
                kids = proc.children(recursive=True)
                if pid != os.getpid():
                    kids.append(proc)
            except psutil.NoSuchProcess:
                continue
            for k in kids:
                if k.pid not in exclude:
                    found.setdefault(k.pid, k)
        time.sleep(0.02)
    return found


def kill_tree(
    roots: list[int], grace: float | None = None, exclude: set[int] | frozenset[int] = frozenset()
) -> list[int]:
    """SIGTERM every descendant, SIGKILL what is left after ``grace`` (a worker that treats SIGTERM as "save and
    stop" would write a checkpoint while the next section starts), reap them; returns the pids signalled.
    ``exclude``: this process's descendants from before the step (:func:`own_children`), left alone."""
    import psutil

    grace = GRACE_S if grace is None else grace
    procs = descendants(roots, exclude=exclude)
    for p in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace)
    more = descendants([p.pid for p in alive], exclude=exclude)  # what the survivors started meanwhile
    for p in {**more, **{p.pid: p for p in alive}}.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(list({**procs, **more}.values()), timeout=5)
    _reap()
    return sorted({**procs, **more})


def _reap() -> None:
    """Collect the exit status of every child that has ended (orphans re-parented to us included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_step(step: Step, plan: Plan, limit: float) -> dict:
    """Run the step's commands side by side under one limit; returns rc, seconds and log tails. Whatever the
    step leaves running when it ends or runs out of time is killed with its whole tree."""
    plan.logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    procs, logs = [], []
    before = own_children()
    try:
        for i, cmd in enumerate(step.cmds):
            log = plan.logs / f"{len(list(plan.logs.iterdir())):02d}_{step.section}_{i}.log"
            logs.append(log)
            f = open(log, "w")  # noqa: SIM115 (open until the process it logs has ended)
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=plan.env(), stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True), f))  # fmt: skip
    except OSError as e:
        kill_tree([p.pid for p, _ in procs], grace=2, exclude=before)
        for _, f in procs:
            f.close()
        return {"rc": 127, "seconds": 0.0, "error": str(e), "logs": [str(p) for p in logs], "tails": []}
    timed_out = False
    try:
        for p, _ in procs:
            left = limit - (time.perf_counter() - t0)
            try:
                p.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:  # also on SIGTERM/SIGINT of the probe itself: nothing it started is left
        left_over = kill_tree([p.pid for p, _ in procs], exclude=before)
        for _, f in procs:
            f.close()
    rcs = [p.returncode for p, _ in procs]
    tails = [_tail(log) for log in logs]
    res = {"rc": 124 if timed_out else max(rcs, key=abs), "rcs": rcs, "seconds": time.perf_counter() - t0,
           "logs": [str(p) for p in logs], "tails": tails, "killed": left_over}  # fmt: skip
    if timed_out:
        res["error"] = f"timed out after {limit:.0f} s"
    elif res["rc"]:
        res["error"] = _error_line(tails[rcs.index(res["rc"])])
    return res


def _no_wheelhouse(where: Path) -> str:
    py = where.name.removeprefix("py")
    return (f"no wheels in {where}: run `make wheelhouse PY_VERSION={py}` where the registry is reachable and "
            f"carry it (carry=['wheelhouse/{where.name}'])")  # fmt: skip


def gpu_free_gb() -> float | None:
    """Free memory of GPU 0 as CUDA reports it (None without CUDA). Read in this process: a subprocess would
    cost a torch import per section; the price is this process's CUDA context (~0.5 GB) for the probe's life."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(0)
    return round(free / 2**30, 2)


def _gpu_total_gb() -> float | None:
    import torch

    return round(torch.cuda.mem_get_info(0)[1] / 2**30, 2) if torch.cuda.is_available() else None


def _tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _error_line(tail: str) -> str:
    """The line that says what went wrong: the project's ``error:`` line, else the last exception line."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for pick in (lambda ln: ln.startswith("error:") or " error: " in ln, lambda ln: "Error" in ln or "error" in ln):
        found = [ln for ln in lines if pick(ln)]
        if found:
            return found[-1][:300]
    return (lines[-1] if lines else "no output")[:300]


# ---- parsers: a finished step -> rows ------------------------------------------------------------------------------


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def train_summary(rows: list[dict], skip: int = 2) -> dict:
    """Steady-state figures of a train.py run from its metrics.jsonl: the median over steps after the first
    ``skip`` (compile, warm-up), the peak memory, the loss's first and last values, each save's stall."""
    steps = [r for r in rows if "loss" in r and "event" not in r]
    steady = steps[skip:] or steps[-1:]
    out: dict = {}
    if steps:
        out.update({
            "steps": len(steps), "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"],
            "step_s": statistics.median(r["step_s"] for r in steady),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": statistics.median(r.get("mfu", 0.0) for r in steady),
            "mem_gb": max(r.get("mem_gb", 0.0) for r in steps),
        })  # fmt: skip
    saves = [r for r in rows if r.get("event") == "checkpoint"]
    if saves:
        out["stall_s"] = [round(r["checkpoint_s"], 3) for r in saves]
        out["snapshot_s"] = [r.get("snapshot_s") for r in saves]
        out["staging_alloc_s"] = [r.get("staging_alloc_s") for r in saves]
        out["wait_s"] = [r.get("wait_s") or 0.0 for r in saves]
        out["staging"] = saves[0].get("staging")
        out["staging_gb"] = saves[-1].get("staging_gb")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        out["eval_loss"] = evals[-1]["eval_loss"]
    resumes = [r for r in rows if r.get("event") == "resume"]
    if resumes:
        out["resumed_from"] = resumes[-1].get("from_step")
    return out


def _fmt(x, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    if isinstance(x, list):
        return "/".join(_fmt(v, ".3g") for v in x)
    return str(x)


def p_installed(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0]) if res["tails"] else {}
    if got.get("skipped"):
        return [{**got, "result": f"skipped: {got['skipped']}"}]
    return [{**got, "result": f"{got['installed']} wheels from {got['from']}" if got.get("installed") else "ok"}]


def p_smoke(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0]) if res["tails"] else {}
    if not got:
        return [{"result": "no result line"}]
    missing = f"; missing: {'; '.join(got['missing'])}" if got.get("missing") else ""
    if not got.get("ok"):
        return [{**got, "result": f"{got.get('exception')}{missing}"}]
    return [{**got, "result": f"compiled flex_attention on {got['device']} in {got['seconds']:.1f} s "
             f"({'forward + backward' if got['backward'] else 'forward'}), max |diff| vs SDPA "
             f"{got['max_abs_diff_vs_sdpa']:.2g}{missing}"}]  # fmt: skip


def p_data(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0]) if res["tails"] else {}
    if not got:
        return [{"result": "no result line"}]
    return [{**got, "result": f"{got['rows']} rows of {got['seq']}, at least {got['min_docs_per_row']} documents "
             f"a row; {got['params']:,} params"}]  # fmt: skip


def p_versions(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0])
    ctx["gpu"] = got.get("gpu")
    return [{"result": ", ".join(f"{k} {v}" for k, v in got.items())} if got else {"result": "no version line"}]


def p_ok(step: Step, res: dict, ctx: dict) -> list[dict]:
    return [{"result": "ok"}]


def p_train_run(step: Step, res: dict, ctx: dict) -> list[dict]:
    run = Path(step.args["run"])
    s = train_summary(_metrics(run))
    ctx.setdefault("runs", {})[str(run)] = s
    if step.args.get("key"):
        s = {"key": step.args["key"], "value": step.args["value"], **s}
    row = {**s, "result": (f"{_fmt(s.get('tokens_per_s'), ',.0f')} tok/s, MFU {_fmt(s.get('mfu'), '.1%')}, "
                           f"{_fmt(s.get('mem_gb'), '.1f')} GB, loss {_fmt(s.get('loss_first'))} -> "
                           f"{_fmt(s.get('loss_last'))}") if "tokens_per_s" in s else "no steps logged"}  # fmt: skip
    rows = [row]
    if step.args.get("checkpoints") and "stall_s" in s:
        rows.append({"name": f"{step.name}: checkpoint stall", **{k: s.get(k) for k in (
            "stall_s", "snapshot_s", "staging_alloc_s", "wait_s", "staging", "staging_gb")},
            "result": f"stall {_fmt(s['stall_s'])} s per save ({s.get('staging')} staging, "
                      f"{_fmt(s.get('staging_gb'), '.3g')} GB; alloc {_fmt(s.get('staging_alloc_s'))} s, "
                      f"waiting for the previous write {_fmt(s.get('wait_s'))} s)"})  # fmt: skip
    return rows


def p_predict(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0])
    measured = ctx.get("runs", {}).get(step.args["run"], {}).get("step_s")
    if not got:
        return [{"result": "no prediction line"}]
    err = (got["step_s"] - measured) / measured if measured else None
    return [{**got, "measured_step_s": measured, "error": err,
             "result": f"predicted {got['step_s']:.3g} s/step on {got['cluster']}, measured {_fmt(measured)} s "
                       f"({_fmt(err, '+.1%')})"}]  # fmt: skip


def grpo_summary(rows: list[dict], skip: int = 1) -> dict:
    """Medians over the GRPO run's steps after the first ``skip``: step time, generation share, generated tok/s."""
    steps = [r for r in rows if "gen_s" in r and "event" not in r][skip:]
    if not steps:
        return {}
    med = statistics.median
    parts = {k: med(r.get(k) or 0.0 for r in steps) for k in ("gen_s", "reward_s", "sync_s", "fwd_s", "bwd_s",
                                                                "opt_s")}  # fmt: skip
    return {
        "steps": len(steps),
        "step_s": med(r["step_s"] for r in steps),
        "generation_share": med(r["gen_s"] / r["step_s"] for r in steps),
        "generated_tokens_per_s": med(r["generated_tokens"] / r["gen_s"] for r in steps if r["gen_s"]),
        "parts": parts,
    }


def p_grpo(step: Step, res: dict, ctx: dict) -> list[dict]:
    s = grpo_summary(_metrics(Path(step.args["run"])))
    ctx["grpo"] = s
    if not s:
        return [{"result": "no GRPO steps logged"}]
    return [{**s, "result": f"{1 / s['step_s']:.3g} steps/s ({s['step_s']:.3g} s), generation "
                            f"{s['generation_share']:.0%} of the step, {s['generated_tokens_per_s']:,.0f} generated "
                            "tok/s"}]  # fmt: skip


def p_grpo_predict(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0])
    measured = ctx.get("grpo") or {}
    if not got:
        return [{"result": "no prediction line"}]
    share = measured.get("generation_share")
    return [{**got, "measured_generation_share": share, "measured_step_s": measured.get("step_s"),
             "result": f"predicted generation share {got['generation_share']:.0%} (measured {_fmt(share, '.0%')}), "
                       f"step {got['step_s']:.3g} s without the reward (measured {_fmt(measured.get('step_s'))} s) "
                       f"on {got['cluster']}"}]  # fmt: skip


def p_trainer(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0])
    ours = ctx.get("runs", {}).get(step.args["run"], {}).get("tokens_per_s")
    if not got:
        return [{"result": "no result line"}]
    theirs = got.get("tokens_per_s_median") or got["tokens_per_s"]  # both sides: median step after the first two
    ratio = ours / theirs if ours else None
    unlike = (got.get("settings") or {}).get("not_like_for_like")
    note = f" (not like for like: {'; '.join(unlike)})" if unlike else " (like for like)" if unlike == [] else ""
    return [{"tokens_per_s": theirs, "ours_tokens_per_s": ours, "ratio": ratio, "settings": got.get("settings"),
             "like_for_like": unlike == [] if unlike is not None else None,
             "result": f"{theirs:,.0f} tok/s; ours / Trainer = {_fmt(ratio, '.2f')}x{note}"}]  # fmt: skip


def p_generate(step: Step, res: dict, ctx: dict) -> list[dict]:
    path = Path(step.args["out"])
    if not path.exists():
        return [{"result": "no JSON written"}]
    got = json.loads(path.read_text())
    tps = got.get("tokens_per_s", {})
    parts = [f"{k} {v:,.0f} tok/s" for k, v in tps.items() if isinstance(v, int | float)]
    speed = {k: v for k, v in got.items() if k.startswith("speedup") and isinstance(v, int | float)}
    random = "random init: identity is mostly near ties" if step.args.get("random_init") else None
    return [{"tokens_per_s": tps, **speed, "identical_greedy": got.get("identical_greedy"), "note": random,
             "result": "; ".join([*parts, *(f"{k} {v:.2f}x" for k, v in speed.items()),
                                  f"greedy identical: {got.get('identical_greedy')}", *filter(None, [random])])}]  # fmt: skip


def p_micro(step: Step, res: dict, ctx: dict) -> list[dict]:
    path = Path(step.args["out"])
    if not path.exists():
        return [{"result": "no JSON written"}]
    rows = json.loads(path.read_text())["rows"]
    return [{"name": f"staging {r['mode']} ({r['device']})", **r,
             "result": f"ran {r['ran_as']}: first save {r['first_s']:.2f} s (alloc {r['alloc_s']:.2f} s), later "
                       f"{r['later_s']:.3f} s = {r['later_gbps']:.1f} GB/s"} for r in rows]  # fmt: skip


def p_zero_first(step: Step, res: dict, ctx: dict) -> list[dict]:
    rows = []
    for s, run in enumerate(step.args["runs"]):
        m = train_summary(_metrics(Path(run)), skip=1)
        latest = Path(run, "checkpoints", "latest")
        tag = latest.read_text().strip() if latest.exists() else None
        ok = bool(m.get("loss_last") is not None and m["loss_last"] < m["loss_first"] and "eval_loss" in m and tag)
        rows.append(
            {
                "name": f"ZeRO-{s}",
                "zero": s,
                **m,
                "latest": tag,
                "ok": ok,
                "result": f"loss {_fmt(m.get('loss_first'))} -> {_fmt(m.get('loss_last'))}, eval "
                f"{_fmt(m.get('eval_loss'))}, latest {tag}, rc {res['rcs'][s] if 'rcs' in res else '-'}",
            }
        )
    return rows


def p_zero_resume(step: Step, res: dict, ctx: dict) -> list[dict]:
    rows = []
    for s, run in enumerate(step.args["runs"]):
        m = train_summary(_metrics(Path(run)), skip=1)
        ok = m.get("resumed_from") == ZERO_STEPS and m.get("steps") == ZERO_RESUME_STEPS
        rows.append({"name": f"ZeRO-{s} resume", "zero": s, "resumed_from": m.get("resumed_from"), "ok": ok,
                     "result": f"resumed from step {m.get('resumed_from')}, {m.get('steps')} steps logged, loss "
                               f"{_fmt(m.get('loss_last'))}"})  # fmt: skip
    return rows


def p_logits(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0])
    if not got:
        return [{"result": "no result line"}]
    return [{**got, "result": f"max |logit diff| {got['max_abs']:.3g}, relative {got['rel']:.3g} ({got['dtype']}); "
             f"argmax agree {got['argmax_agree']:.1%}"}]  # fmt: skip


def p_recompute(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0]) if res["tails"] else {}
    if not got:
        return [{"result": "no result line"}]
    rows = []
    for r in got["rows"]:
        if "skipped" in r or "error" in r:
            text = f"skipped: {r['skipped']}" if "skipped" in r else r["error"]
        else:
            reran = r["attention_forward_in_backward"] or r["mm_in_backward"] > r["mm_gradients"]
            text = (f"{'RE-RUN' if reran else 'kept'}: {r['attention']} forward {r['attention_forward_in_backward']}x "
                    f"in the compiled backward (its backward {r['attention_backward_in_backward']}x), GEMMs "
                    f"{r['mm_in_backward']} of which gradients {r['mm_gradients']}; checkpoint in the graph "
                    f"{r['checkpoint_in_graph']}; {r['seconds']:.1f} s")  # fmt: skip
        rows.append({"name": f"{step.name[:30]}: {r['kernel']}", **r, "result": text})
    return rows


PARSERS = {name[2:]: f for name, f in dict(globals()).items() if name.startswith("p_")}


def _json_from(text: str) -> dict:
    """The last line of ``text`` that is a JSON object."""
    for ln in reversed(text.splitlines()):
        ln = ln.strip()
        if ln.startswith("{") and ln.endswith("}"):
            try:
                return json.loads(ln)
            except json.JSONDecodeError:
                continue
    return {}


def missing_lever(key: str, value: str) -> str | None:
    """Why a lever row cannot run with this checkout's schema (None: it can): the key or the value is unknown."""
    import dataclasses
    import enum
    import typing

    from ultrascale.config.root import RootConfig

    group, name = key.split(".", 1)
    cls = typing.get_type_hints(RootConfig).get(group)  # the group's dataclass, from its own module
    cls = cls if dataclasses.is_dataclass(cls) else None
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
    if name not in fields:
        return f"key missing: {key} is not in the schema of this checkout"
    typ = typing.get_type_hints(cls)[name]
    if isinstance(typ, type) and issubclass(typ, enum.Enum) and value not in {m.value for m in typ}:
        return f"value missing: {key}={value} is not one of {', '.join(m.value for m in typ)}"
    if fields[name].type in (bool, "bool") and value not in ("true", "false"):
        return f"value missing: {key} is still a bool in this checkout (true/false), not {value!r}"
    return None


def execute(plan: Plan, budget: float, out_json: Path | None) -> dict:
    """Run the plan's steps in order while the budget lasts. Every finished step's rows are in the JSON at once
    (rewritten after each step), so a probe killed from outside has kept what it measured."""
    t_start = time.perf_counter()
    deadline = t_start + budget
    plan.work.mkdir(parents=True, exist_ok=True)
    if out_json is not None:  # the logs come back with the JSON ($OUT), not left in a temp dir
        plan.logs = out_json.parent / f"{out_json.stem}_logs"
    reaper = become_subreaper()
    ctx: dict = {}
    rows: list[dict] = []
    result = {"gpu": None, "budget_s": budget, "wall_s": 0.0, "complete": False, "rows": rows}
    failed_prereq = False
    section, free = None, None
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for step in plan.steps:
            left = deadline - time.perf_counter()
            base = {"section": step.section, "name": step.name}
            if step.section != section:  # a section starts on a GPU nothing else holds
                section, free = step.section, gpu_free_gb()
            if free is not None:
                base["gpu_free_gb"] = free
            if step.args.get("key") and not failed_prereq:
                why = missing_lever(step.args["key"], step.args["value"]) if _schema_importable(plan) else None
                if why:
                    rows.append({**base, "key": step.args["key"], "value": step.args["value"], "result": why})
                    continue
            if failed_prereq:
                rows.append({**base, "result": "skipped: the install or data step failed"})
                continue
            if left < min(30.0, step.budget_s):
                rows.append({**base, "result": f"skipped: out of time ({left:.0f} s left of {budget:.0f}); run it "
                                               f"with --sections {step.section}"})  # fmt: skip
                continue
            limit = min(step.budget_s, left)
            print(f"[{time.perf_counter() - t_start:5.0f}s] {step.section}: {step.name} (limit {limit:.0f} s)",
                  flush=True)  # fmt: skip
            res = run_step(step, plan, limit)
            rows.extend(step_rows(step, res, ctx, base))
            if res["rc"] and step.args.get("prereq", step.section in ALWAYS):
                failed_prereq = True
            if step.args.get("cleanup"):  # the 1B job's checkpoints are 17 GB each; the device's disk is 64 GiB
                import shutil

                shutil.rmtree(Path(step.args["run"]) / "checkpoints", ignore_errors=True)
            result.update(gpu=ctx.get("gpu"), wall_s=round(time.perf_counter() - t_start, 1))
            _write(out_json, result)
        result["complete"] = True
    except KeyboardInterrupt:
        rows.append({"section": section or "-", "name": "probe", "result": "interrupted: the rows above finished"})
    finally:
        signal.signal(signal.SIGTERM, previous)
        if reaper:
            become_subreaper(False)
        result.update(gpu=ctx.get("gpu"), wall_s=round(time.perf_counter() - t_start, 1))
        _write(out_json, result)
    print_table(result)
    if out_json is not None:
        print(f"\nJSON: {out_json}; logs: {plan.logs}")
    return result


def step_rows(step: Step, res: dict, ctx: dict, base: dict) -> list[dict]:
    """A finished step's rows: what its parser reads, or its error with the log's tail."""
    row = {**base, "seconds": round(res["seconds"], 1), "rc": res["rc"]}
    if res.get("killed"):
        row["killed_after"] = len(res["killed"])  # processes it left running, now gone
    try:
        parsed = PARSERS[step.parse](step, res, ctx) if step.parse else [{"result": "ok"}]
    except Exception as e:  # a parser that meets an unexpected output is a row too
        parsed = [{"result": f"could not read the output: {type(e).__name__}: {e}"}]
    out = []
    for p in parsed:
        r = {**row, **p}
        if res["rc"]:
            r["result"] = f"FAILED ({res.get('error')})" + (f"; {p['result']}" if p.get("result") not in
                                                             ("ok", "no steps logged", None) else "")  # fmt: skip
            r["log"] = res["logs"][0] if res["logs"] else None
            r["log_tail"] = res["tails"][res["rcs"].index(res["rc"])][-1500:] if res.get("rcs") and \
                res["rc"] in res["rcs"] else (res["tails"][0][-1500:] if res["tails"] else None)  # fmt: skip
        out.append(r)
    return out


def _interrupt(signum, frame) -> None:
    """SIGTERM to the probe: stop like Ctrl-C, so the running step's tree is killed and the JSON written."""
    raise KeyboardInterrupt


def _write(out_json: Path | None, result: dict) -> None:
    """Atomically: a kill between two steps leaves the previous complete JSON, never half of one."""
    if out_json is None:
        return
    out_json.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_json.with_name(out_json.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, out_json)


def _schema_importable(plan: Plan) -> bool:
    for p in (str(plan.site), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        import ultrascale.config.root  # noqa: F401
    except Exception:
        return False
    return True


def print_table(result: dict) -> None:
    print(f"\n== GPU probe: {result.get('gpu') or 'GPU unknown'}; {result['wall_s']:.0f} s of "
          f"{result['budget_s']:.0f} ==")  # fmt: skip
    print(f"{'section':<10} {'step':<46} {'s':>5} {'GPU free':>8}  result")
    for r in result["rows"]:
        secs = f"{r['seconds']:.0f}" if "seconds" in r else "-"
        free = f"{r['gpu_free_gb']:.1f} GB" if r.get("gpu_free_gb") is not None else "-"
        print(f"{r['section']:<10} {r['name'][:46]:<46} {secs:>5} {free:>8}  {r['result']}")


def print_plan(plan: Plan, budget: float, later: list[tuple[list[str], dict, float]] = ()) -> None:
    """Each step with its limit and the figures it measures; the calls that do not fit this one; last, this
    call's planned seconds against its budget."""
    print(f"GPU probe plan: {len(plan.steps)} steps (sections run in order while time is left)")
    print(f"work dir {plan.work}; wheelhouse {plan.wheelhouse}; python {plan.py}")
    for i, st in enumerate(plan.steps, 1):
        print(f"{i:2d}. [{st.section}] {st.name}  (limit {st.budget_s:.0f} s{', side by side' if len(st.cmds) > 1 else ''}"
              f"{'; measures: ' + st.measures if st.measures else ''})")  # fmt: skip
        for cmd in st.cmds:
            print(f"      $ {shlex.join(cmd)}")
    if later:
        print("\ndoes not fit this call; each next call is a bare machine (install and data again):")
        for n, (secs, lev, total) in enumerate(later, 2):
            print(f"  call {n}: python bench/gpu_probe.py {call_args(secs, lev)}  (planned {total:.0f} s)")
    print(f"\nplanned: {plan.total_s:.0f} s of the {budget:.0f} s budget")


# ---- workers (run as subprocesses, with the wheelhouse on the path) -------------------------------------------------

REQUIRED = ("deepspeed", "transformers", "tokenizers", "safetensors", "accelerate", "hydra", "omegaconf", "numpy",
            "psutil")  # fmt: skip
"""What the sections import besides torch: a Python that imports all of these needs no wheelhouse."""


def w_install(wheelhouse: str, site: str) -> None:
    """Install the wheelhouse into ``site``. Without one: a Python that already imports every requirement (a
    dev venv, a CPU host checking the probe) runs as it is, and the row says so; anything else is one error line
    naming the make command that builds the wheelhouse for this Python."""
    import importlib.util

    wh = Path(wheelhouse)
    wheels = sorted(str(p) for p in wh.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", site, *wheels], check=True)  # fmt: skip
        print(json.dumps({"installed": len(wheels), "from": str(wh)}))
        return
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: {_no_wheelhouse(wh)}; this Python ({sys.executable}) lacks {', '.join(missing)}")
        raise SystemExit(1)
    print(json.dumps({"installed": 0, "from": None, "skipped": f"no wheelhouse at {wh}; {sys.executable} already "
                      "imports every requirement, so nothing is installed"}))  # fmt: skip


def w_versions() -> None:
    import deepspeed
    import hydra
    import torch
    import transformers

    got = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "deepspeed": deepspeed.__version__, "transformers": transformers.__version__, "hydra": hydra.__version__}  # fmt: skip
    try:
        import liger_kernel.transformers.functional  # noqa: F401
        import triton

        got["liger"] = f"ok (triton {triton.__version__})"
    except Exception as e:
        got["liger"] = f"{type(e).__name__}: {e}"
    got["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    print(json.dumps(got))


def toolchain_missing(device: str) -> list[str]:
    """What Triton (CUDA: its launcher is built with a C compiler against Python.h) or Inductor's CPU backend
    (a C++ compiler and Python.h) needs and this machine lacks, each with the package that provides it."""
    import shutil
    import sysconfig

    missing = []
    if not (os.environ.get("CC") or any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
        missing.append("a C compiler (cc/gcc/clang on PATH, or $CC): apt-get install gcc")
    if device == "cpu" and not (os.environ.get("CXX") or any(shutil.which(c) for c in ("c++", "g++", "clang++"))):
        missing.append("a C++ compiler for Inductor's CPU backend (c++/g++/clang++): apt-get install g++")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        v = f"{sys.version_info.major}.{sys.version_info.minor}"
        missing.append(f"Python.h (looked in {header.parent}): apt-get install python{v}-dev (python3-dev)")
    return missing


def w_smoke() -> None:
    """A ~5 s torch.compile + flex_attention call, checked against masked SDPA, that fails with the missing
    toolchain by name instead of inside the first training step (Triton builds its launcher on first use).
    On CUDA forward and backward; on a CPU forward without grad (torch has no compiled CPU flex backward)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    missing = toolchain_missing(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    s = 256
    t0 = time.perf_counter()
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, 2, s, 64, device=device, dtype=dtype, generator=g) for _ in range(3))
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, s, s, device=device)
        fn = torch.compile(flex_attention)
        grad = device == "cuda"
        for t in (q, k, v):
            t.requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = fn(q, k, v, block_mask=mask)
            if grad:
                out.float().sum().backward()
        ref = F.scaled_dot_product_attention(q.detach().float(), k.detach().float(), v.detach().float(),
                                             is_causal=True)  # fmt: skip
        diff = float((out.detach().float() - ref).abs().max())
    except Exception as e:
        first = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        print(json.dumps({"ok": False, "device": device, "missing": missing, "exception": first}))
        why = f"missing {'; '.join(missing)}" if missing else first
        print(f"error: torch.compile + flex_attention does not build on this {device}: {why}")
        raise SystemExit(1) from None
    print(json.dumps({"ok": True, "device": device, "seconds": round(time.perf_counter() - t0, 2),
                      "max_abs_diff_vs_sdpa": diff, "backward": device == "cuda", "missing": missing}))  # fmt: skip


def w_data(work: str, seq: str, model: str) -> None:
    """The byte corpus at the job's length, cut into documents of at most a third of a row (every row holds
    at least two boundaries, so every batch is a multi-document one and takes the flex path: no row of one
    document falls back to SDPA or recompiles), and at 256 for the ZeRO runs; a random-init ``model`` with a
    BPE tokenizer of its vocabulary trained on the stdlib, saved as a HF directory (bench_generate's
    ``--model``)."""
    import sysconfig

    import numpy as np

    from data_prep.tokenizer import save_hf, train_bpe
    from ultrascale.config.compose import compose
    from ultrascale.data.bytecorpus import EOS, write_byte_dataset
    from ultrascale.data.shards import open_split
    from ultrascale.model.build import build_model

    w, n = Path(work), int(seq)
    write_byte_dataset(w / f"data{n}", seq_len=n, max_files=4000, max_bytes=n // 3, pattern="**/*.py")
    if n != 256:
        write_byte_dataset(w / "data256", seq_len=256)
    split = open_split(w / f"data{n}", "train", verify=False)
    ids = split.get(np.arange(len(split)))
    docs = (ids[:, :-1] == EOS).sum(1) + 1  # documents a row touches
    net = build_model(compose([f"model={model}"]).model, seed=0)
    texts = [p.read_text(errors="ignore") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:120]]
    tok = train_bpe(texts, vocab_size=int(net.config.vocab_size))
    save_hf(tok, w / f"{model}_random", model_max_length=2048)
    net.save_pretrained(str(w / f"{model}_random"))
    print(json.dumps({"rows": len(ids), "seq": n, "min_docs_per_row": int(docs.min()),
                      "vocab": tok.get_vocab_size(), "params": sum(p.numel() for p in net.parameters())}))  # fmt: skip


def _probe_cluster(cpu_preset: str = "cpu_local"):
    """(one-GPU ClusterConfig of the preset this card belongs to, its name); without CUDA, ``cpu_preset``."""
    import torch
    from omegaconf import OmegaConf

    from ultrascale.config.cluster import ClusterConfig

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if name == "cpu" and cpu_preset != "cpu_local":
        name = cpu_preset
    preset = ("h200_8x" if "H200" in name else "a100_80g_8x" if "A100" in name else "cpu_local" if name == "cpu"
              else "h100_8x")  # fmt: skip
    if name == cpu_preset:
        preset = cpu_preset
    base = OmegaConf.structured(ClusterConfig)
    chain = [OmegaConf.load(ROOT / "conf" / "cluster" / f"{preset}.yaml")]
    while "defaults" in chain[0]:
        parent = next(d for d in chain[0].defaults if isinstance(d, str))
        chain.insert(0, OmegaConf.load(ROOT / "conf" / "cluster" / f"{parent}.yaml"))
    for c in chain:
        c.pop("defaults", None)
    cluster = OmegaConf.to_object(OmegaConf.merge(base, *chain, {"nodes": 1, "gpus_per_node": 1}))
    if getattr(cluster, "measure_peak", False):  # cpu_local: this CPU's measured matmul rate
        from ultrascale.runtime.peak import gemm_rate

        cluster.peak_tflops, cluster.measure_peak = gemm_rate()["flops"] / 1e12, False
    return cluster, preset


def w_predict(run_dir: str) -> None:
    """The planner's step time for the run's own config on one GPU of the cluster this card belongs to."""
    import torch
    from omegaconf import OmegaConf

    from ultrascale.config.search import SearchConfig
    from ultrascale.cost.timing import step_time
    from ultrascale.levers.rules import validate
    from ultrascale.model.arch import arch_from_hf
    from ultrascale.plan.search import decided, layout_from_cfg

    cluster, preset = _probe_cluster()
    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    from ultrascale.runtime.gpu import detect

    d = validate(cfg, 1, backend="nccl" if torch.cuda.is_available() else "gloo", gpu=detect())  # as the run decided
    lay = decided(layout_from_cfg(cfg, 1), d)
    s = SearchConfig()
    t = step_time(arch_from_hf(d.hf_config), lay, cluster, overlap=s.overlap, recompute_overhead=s.recompute_overhead)
    print(json.dumps({"step_s": t.step, "cluster": f"{preset} (1 rank)", "timing": t.as_dict()}))


def w_grpo_predict(run_dir: str) -> None:
    """The dry run's GRPO prediction (:func:`ultrascale.plan.grpo.plan_grpo_step`) for the run's own config on this
    GPU, as one JSON line."""
    import torch
    from omegaconf import OmegaConf

    from ultrascale.levers.rules import validate
    from ultrascale.plan.dryrun import Target, planned_layout
    from ultrascale.plan.grpo import plan_grpo_step
    from ultrascale.runtime.gpu import GpuInfo, detect

    cluster, preset = _probe_cluster(cpu_preset="h100_8x")  # a CPU host (the tiny job) checks it against an H100
    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    gpu = detect() if torch.cuda.is_available() else GpuInfo.from_cluster(cluster, str(cluster.card))
    d = validate(cfg, 1, backend="nccl", gpu=gpu)
    p = plan_grpo_step(cfg, d, Target(1, cluster, gpu), planned_layout(cfg, d))
    print(json.dumps({"cluster": f"{preset} (1 rank)", "step_s": p.step, "generation_s": p.generation,
                      "train_s": p.train, "generation_share": p.generation_share, "tokens_per_s": p.tokens_per_s,
                      "bound": p.bound, "prompt_len": p.prompt_len}))  # fmt: skip


RECOMPUTE_FORWARD_OPS = frozenset({"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                                   "flex_attention"})  # fmt: skip
"""The attention kernels' forward ops, as :func:`_op_name` spells them: one of these in a backward graph is a
re-run of the forward."""


def w_recompute() -> None:
    """Selective recompute under torch.compile with gradients, where a CPU cannot show it: a one-layer Llama (head
    dim 64, 2 x 512 tokens, bf16 on CUDA) checkpointed as ``train.compile_scope=layers`` runs it
    (``enable_checkpointing(compiled_layers=True)``), the layer compiled by Inductor, one forward and backward per
    attention kernel: ``sdpa`` (one document a row: the causal kernel) and ``flex`` (two documents a row: a
    BlockMask). Counted in the backward graph Inductor compiles (a Triton template is no op a dispatch mode sees):
    the attention's forward (a re-run: the policy did not keep it) and backward, and the GEMMs against the two a
    layer's 7 linears' gradients take. One JSON line."""
    import torch

    from ultrascale.model import recompute

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kept: list[str] = []
    policy = recompute.selective_policy

    def recorded(ctx, func, *a, **kw):
        verdict = policy(ctx, func, *a, **kw)
        if verdict.name == "MUST_SAVE":
            kept.append(_op_name(func))
        return verdict

    recompute.selective_policy = recorded  # read when enable_checkpointing builds the checkpoint's context
    rows = []
    for kernel in ("sdpa", "flex"):
        kept.clear()
        if kernel == "flex" and device.type != "cuda":
            rows.append({"kernel": kernel, "skipped": "torch compiles FlexAttention with gradients only on a GPU"})
            continue
        try:
            rows.append(_recompute_row(kernel, device, kept))
        except Exception as e:  # a kernel that does not compile here is a row with its error
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            rows.append({"kernel": kernel, "error": why})
    print(json.dumps({"device": str(device), "rows": rows}))


def _recompute_row(kernel: str, device, kept: list[str]) -> dict:
    """One attention kernel's compiled forward and backward, and what its backward graph runs."""
    import torch
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from transformers import AutoConfig, AutoModelForCausalLM

    from ultrascale.model import flex, recompute

    graphs, tagged, ops = [], [], []

    def inner(gm, example_inputs, **kw):
        if kw.get("is_backward"):
            for n in (n for n in gm.graph.nodes if n.op == "call_function"):
                ops.append(_op_name(n.target))
                if ops[-1].endswith("run_with_rng_state"):  # a random op recomputed under its forward's state
                    ops.extend(_op_name(a) for a in n.args if callable(getattr(a, "name", None)))
        return compile_fx_inner(gm, example_inputs, **kw)

    def backend(gm, example_inputs):
        graphs.append(gm)
        tagged.extend(n for n in gm.graph.nodes if _op_name(n.target) == "tag_activation_checkpoint")
        return compile_fx(gm, example_inputs, inner_compile=inner)

    hf = AutoConfig.for_model("llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                              use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa").to(device, dtype).train()
    if kernel == "flex":
        flex.install_flex_attention(model)
    recompute.enable_checkpointing(model, "selective", compiled_layers=True)
    model.model.layers[0].compile(backend=backend, fullgraph=True)
    ids = torch.randint(0, 256, (2, 512), device=device, generator=torch.Generator(device=device).manual_seed(0))
    pos = torch.arange(256).repeat(2).expand(2, 512).to(device) if kernel == "flex" else None  # two documents a row
    t0 = time.perf_counter()
    model(input_ids=ids, labels=ids, position_ids=pos).loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    forward = [o for o in ops if o in RECOMPUTE_FORWARD_OPS]
    backward = [o for o in ops if o.endswith("_backward") and o[: -len("_backward")] in RECOMPUTE_FORWARD_OPS]
    return {
        "kernel": kernel,
        "device": str(device),
        "seconds": round(time.perf_counter() - t0, 1),
        "graphs": len(graphs),
        "checkpoint_in_graph": bool(tagged),
        "kept": sorted(set(kept)),
        "attention": "/".join(sorted(set(kept) & RECOMPUTE_FORWARD_OPS)) or "no attention op kept",
        "attention_forward_in_backward": len(forward),
        "attention_backward_in_backward": len(backward),
        "mm_in_backward": sum(o in ("mm", "addmm") for o in ops),
        "mm_gradients": 2 * 7,  # q k v o gate up down: dX and dW each (the head is outside the compiled layer)
    }


def _op_name(target) -> str:
    """An fx node's or the policy's op as ``aten::mm.default`` -> ``mm``; a higher-order op by its name."""
    name = getattr(target, "name", None)
    return name().split("::")[-1] if callable(name) else getattr(target, "__name__", str(target))


def w_logits(run_dir: str, hf_dir: str) -> None:
    """The engine rebuilt from the run's checkpoint and the exported HF model score the same two validation rows
    on the GPU, each in the run's dtype."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from ultrascale.data.shards import open_split
    from ultrascale.levers.deepspeed import build_ds_config
    from ultrascale.levers.rules import validate
    from ultrascale.paths import resolve_path
    from ultrascale.runtime import dist
    from ultrascale.train import checkpoint
    from ultrascale.train.engine import build_engine

    dist.configure_env()
    dist.init_distributed()
    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    d = validate(cfg, dist.world_size())
    engine, _ = build_engine(cfg, d, build_ds_config(cfg, d))
    tag_dir = Path(run_dir) / "checkpoints" / (Path(run_dir) / "checkpoints" / "latest").read_text().strip()
    checkpoint.load(engine, tag_dir, same_world=True)
    ids = torch.from_numpy(open_split(resolve_path(cfg.data.path), "validation").get(np.arange(2))).to(engine.device)
    engine.eval()
    with torch.no_grad():
        ref = engine(input_ids=ids).logits.float()
    dtype = next(engine.module.parameters()).dtype
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(engine.device).eval()
    with torch.no_grad():
        got = hf(input_ids=ids).logits.float()
    diff = (got - ref).abs()
    print(json.dumps({"max_abs": float(diff.max()), "rel": float((got - ref).norm() / ref.norm()),
                      "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                      "dtype": str(dtype).removeprefix("torch.")}))  # fmt: skip
    dist.shutdown()


def w_tokenizer(model_dir: str, data_dir: str) -> None:
    """The byte corpus names a ``tokenizer`` folder it does not have (its ids are bytes); the exporter copies the
    data's tokenizer next to the weights, so give it the random model's (the probe checks logits, not text)."""
    import shutil

    from ultrascale.data.shards import load_manifest

    dst = Path(data_dir) / load_manifest(Path(data_dir))["tokenizer"]
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).glob("*.json"):
        if "token" in f.name:
            shutil.copy(f, dst / f.name)
    print(json.dumps({"tokenizer": str(dst)}))


WORKERS = {"install": w_install, "versions": w_versions, "smoke": w_smoke, "data": w_data, "predict": w_predict,
           "grpo_predict": w_grpo_predict,
           "logits": w_logits, "tokenizer": w_tokenizer, "recompute": w_recompute}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, from {', '.join(SECTIONS)} (install and data always run); what does not "
                         "fit --budget is left to the next calls the dry run prints")  # fmt: skip
    ap.add_argument("--levers", default="", help="only these LEVERS keys (comma-separated; default all)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole probe (470)")
    ap.add_argument("--wheelhouse", type=Path, default=default_wheelhouse(),
                    help=f"default {default_wheelhouse().relative_to(ROOT)}: the running Python's")  # fmt: skip
    ap.add_argument("--work", type=Path, help="scratch dir (default: a fresh temp dir)")
    ap.add_argument("--json", type=Path, help="default $OUT/gpu_probe.json where $OUT is set; logs go beside it")
    ap.add_argument("--job", choices=tuple(JOBS), default="gpu",
                    help="gpu (default); tiny: the same sections on the tiny model on a CPU host, to check the "
                         "probe")  # fmt: skip
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        WORKERS[a.worker[0]](*a.worker[1:])
        return 0
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    levers = LEVERS
    if a.levers:
        keys = [k.strip() for k in a.levers.split(",") if k.strip()]
        bad = [k for k in keys if k not in LEVERS]
        if bad:
            ap.error(f"unknown lever(s) {', '.join(bad)}: choose from {', '.join(LEVERS)}")
        levers = {k: LEVERS[k] for k in keys}
    work = (a.work or Path(tempfile.gettempdir()) / f"gpu_probe-{os.getpid()}").resolve()
    calls = plan_calls(sections, levers, a.budget, a.job, work)
    first, first_levers, _ = calls[0]
    plan = Plan(work, a.wheelhouse.resolve(), first, first_levers, job=a.job)
    if a.dry_run:
        print_plan(plan, a.budget, calls[1:])
        return 0
    out_json = a.json or (Path(os.environ["OUT"]) / "gpu_probe.json" if os.environ.get("OUT") else None)
    execute(plan, a.budget, out_json)
    if len(calls) > 1:
        print("not in this call (run next): " + "; ".join(call_args(s, lv) for s, lv, _ in calls[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
