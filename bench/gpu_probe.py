#!/usr/bin/env python3
"""The GPU probe: one command, at most 8 minutes on one GPU with no network, that says what the project does on
that GPU. It installs the project's dependencies from the wheelhouse (``make wheelhouse PY_VERSION=3.12``; the
node's own torch, CUDA and Triton are used), then runs each section as subprocesses with their own timeouts, so
a failed or slow section is a row with its error, never the end of the probe:

    install    pip install --no-index --no-deps --target WORK/site wheelhouse/*.whl; the imports and versions
    data       the byte corpus (ultrascale.data.bytecorpus) at seq 4096 and 256; a random-init SmolLM2-135M with a
               BPE tokenizer trained on the same stdlib (no hub: nothing can be downloaded there)
    llama_1b   recipes/llama_1b_zero0.yaml on 1 GPU, every lever at its decided default: tokens/s, MFU, peak
               memory, the planner's predicted step time against the measured one, and the checkpoint stall
               (two saves: the first allocates and pins the staging buffers, the second reuses them)
    trainer    the same job under HF Trainer + DeepSpeed (bench/_trainer_loop.py, tuned, bf16, gradient
               checkpointing as the recipe has it): ours / Trainer's tokens/s
    sampler    bench/bench_generate.py (its own CLI) on the random-init SmolLM2-135M: greedy identity and speed
               against HF generate (at batch 8, 32 and HF's best, where that script reports them)
    zero       SmolLM2-135M, bf16, ZeRO 0/1/2/3 side by side on the GPU: train, eval, checkpoint, then resume
               to a longer schedule
    export     the ZeRO-3 run's checkpoint to a HF directory; from_pretrained's logits against the engine's
    levers     the llama_1b job with each lever of ``LEVERS`` set one way and the other (a key the schema does
               not have yet is a row saying so)

Sections run in that order while the time lasts (``--budget``, 470 s by default, leaves the device tool's
8-minute command its margin); a section that does not fit is a row saying so. Pick sections with ``--sections``
(``install`` and ``data`` always run: a fresh machine has nothing). The table is printed last; the JSON goes to
``$OUT/gpu_probe.json`` on the device machine (or ``--json``); each subprocess's log to ``WORK/logs``.

    python bench/gpu_probe.py [--dry-run] [--sections llama_1b,trainer] [--levers train.compile] [--budget 470]
                              [--wheelhouse wheelhouse/py3.12] [--work DIR] [--json PATH]

``--dry-run`` prints the plan (each step's command and time budget) on any machine, without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
"""Each lever of the llama_1b job and the values compared (names per /work/coord/INTERFACES.md). A row sets one
key, everything else stays at the recipe's decided default."""

SECTIONS: dict[str, float] = {  # name: seconds it may take; run in this order while time is left
    "install": 60,
    "data": 45,
    "llama_1b": 200,
    "trainer": 150,
    "sampler": 90,
    "zero": 90,
    "export": 45,
    "levers": 420,
}
LEVER_ROW_S = 110.0
"""A lever row's own limit inside ``levers``: one train.py launch of the 1B job (build, compile, 6 steps)."""
ALWAYS = ("install", "data")
DEFAULT_BUDGET_S = 470.0
LLAMA_STEPS, LEVER_STEPS = 8, 6
ZERO_STEPS, ZERO_RESUME_STEPS = 6, 8


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
    cpu: bool = False


JOBS = {
    "gpu": Job(("recipe=llama_1b_zero0", "launcher.nproc_per_node=1", "data.global_batch=8", "logger=none",
                "train.keep_checkpoints=1", "train.log_interval=1"), 4096, "smollm2_135m", "smollm2_135m",
               ("--limit", "32", "--max-new-tokens", "128"), "tuned+bf16+gc"),
    "tiny": Job(("recipe=cpu_smoke", "launcher.nproc_per_node=1", "data.global_batch=8", "logger=none",
                 "train.keep_checkpoints=1", "train.log_interval=1"), 256, "tiny", "tiny",
                ("--limit", "2", "--max-new-tokens", "8"), "default+gc", micro_gb=0.2, cpu=True),
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


class Plan:
    """Every step with its paths fixed up front, so ``--dry-run`` prints exactly what a run would run."""

    def __init__(self, work: Path, wheelhouse: Path, sections: list[str], levers: dict[str, tuple[str, ...]],
                 py: str = sys.executable, job: str = "gpu"):  # fmt: skip
        self.work, self.wheelhouse, self.py, self.job = work, wheelhouse, py, JOBS[job]
        self.site, self.logs = work / "site", work / "logs"
        self.data_main, self.data256 = work / f"data{self.job.seq}", work / "data256"
        self.sampler_model = work / f"{self.job.sampler_model}_random"
        self.steps: list[Step] = []
        for s in [*ALWAYS, *(s for s in SECTIONS if s in sections and s not in ALWAYS)]:
            getattr(self, f"_{s}")(levers)

    def torchrun(self, *args: str) -> list[str]:
        return [self.py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *args]

    def add(self, section: str, name: str, cmds: list[list[str]], parse: str = "", budget: float | None = None,
            **args) -> None:  # fmt: skip
        self.steps.append(Step(section, name, cmds, budget or SECTIONS[section], parse, args))

    def _install(self, _levers) -> None:
        self.add("install", "pip install --no-index", [[self.py, "-m", "pip", "install", "-q", "--no-index",
                 "--no-deps", "--no-compile", "--upgrade", "--target", str(self.site), f"{self.wheelhouse}/*.whl"]],
                 "installed")  # fmt: skip
        self.add("install", "imports", [[self.py, __file__, "--worker", "versions"]], "versions", budget=60)

    def _data(self, _levers) -> None:
        self.add("data", f"byte corpus + random-init {self.job.sampler_model}",
                 [[self.py, __file__, "--worker", "data", str(self.work), str(self.job.seq), self.job.sampler_model]],
                 "ok")  # fmt: skip

    def _llama_1b(self, _levers) -> None:
        run = self.work / "llama_base"
        self.add("llama_1b", f"{self.job.train[0].split('=')[1]}, decided levers",
                 [self.torchrun("train.py", *self.job.train, f"data.path={self.data_main}", f"train.steps={LLAMA_STEPS}",
                                f"train.checkpoint_interval={LLAMA_STEPS // 2}", f"train.eval_interval={LLAMA_STEPS}",
                                f"output_dir={run}")], "train_run", run=str(run), checkpoints=True,
                 cleanup=True)  # fmt: skip
        self.add("llama_1b", "planner prediction", [[self.py, __file__, "--worker", "predict", str(run)]], "predict",
                 budget=40, run=str(run))  # fmt: skip
        out = self.work / "staging.json"
        self.add("llama_1b", f"staging copy alone, {self.job.micro_gb:g} GB, pinned vs pageable",
                 [[self.py, "bench/checkpoint_stall.py", "--micro", f"{self.job.micro_gb:g}", "--json", str(out)]],
                 "micro", budget=60, out=str(out))  # fmt: skip

    def _trainer(self, _levers) -> None:
        run = self.work / "llama_base"
        mode = self.job.trainer_mode
        self.add("trainer", f"HF Trainer + DeepSpeed ({mode})",
                 [self.torchrun("bench/_trainer_loop.py", str(run), str(self.data_main), str(LLAMA_STEPS),
                                str(self.work / "trainer_out"), mode)], "trainer", run=str(run))  # fmt: skip

    def _sampler(self, _levers) -> None:
        self.add("sampler", "bench_generate.py vs HF generate",
                 [[self.py, "bench/bench_generate.py", "--model", str(self.sampler_model), *self.job.sampler_args,
                   "--json", str(self.work / "generate.json")]], "generate",
                 out=str(self.work / "generate.json"))  # fmt: skip

    def _zero(self, _levers) -> None:
        common = [f"model={self.job.zero_model}", "precision=bf16", f"data.path={self.data256}", "data.micro_batch=4",
                  "data.global_batch=8", "logger=none", "train.compile=false", "launcher.nproc_per_node=1"]  # fmt: skip
        first, resume = [], []
        for s in range(4):
            run = self.work / f"zero{s}"
            args = [*common, f"zero=stage{s}", f"output_dir={run}"]
            first.append(self.torchrun("train.py", *args, f"train.steps={ZERO_STEPS}",
                                       f"train.checkpoint_interval={ZERO_STEPS // 2}",
                                       f"train.eval_interval={ZERO_STEPS}"))  # fmt: skip
            resume.append(
                self.torchrun(
                    "train.py",
                    *args,
                    f"train.steps={ZERO_RESUME_STEPS}",
                    f"train.checkpoint_interval={ZERO_STEPS // 2}",
                    f"train.eval_interval={ZERO_RESUME_STEPS}",
                    "train.allow_schedule_change=true",
                )
            )
        runs = [str(self.work / f"zero{s}") for s in range(4)]
        self.add("zero", "ZeRO 0/1/2/3 bf16: train, eval, checkpoint", first, "zero_first", budget=50, runs=runs)
        self.add("zero", "ZeRO 0/1/2/3 bf16: resume to a longer schedule", resume, "zero_resume", budget=40,
                 runs=runs)  # fmt: skip

    def _export(self, _levers) -> None:
        run, out = self.work / "zero3", self.work / "hf_zero3"
        self.add("export", "the byte corpus gets the sampler model's tokenizer (export copies it)",
                 [[self.py, __file__, "--worker", "tokenizer", str(self.sampler_model), str(self.data256)]], "ok",
                 budget=15)  # fmt: skip
        self.add("export", "export the ZeRO-3 checkpoint",
                 [[self.py, "-m", "ultrascale.export", f"run_dir={run}", f"out={out}", "overwrite=true"]], "ok",
                 budget=20)  # fmt: skip
        self.add(
            "export",
            "from_pretrained logits vs the engine's",
            [self.torchrun(__file__, "--worker", "logits", str(run), str(out))],
            "logits",
            budget=25,
        )

    def _levers(self, levers) -> None:
        for key, values in levers.items():
            for value in values:
                run = self.work / f"lever_{key.split('.')[-1]}_{value}"
                ckpt = key == "train.checkpoint_staging"
                self.add("levers", f"{key}={value}",
                         [self.torchrun("train.py", *self.job.train, f"data.path={self.data_main}",
                                        f"train.steps={LEVER_STEPS}",
                                        f"train.checkpoint_interval={LEVER_STEPS // 2 if ckpt else 0}",
                                        f"{key}={value}", f"output_dir={run}")],
                         "train_run", budget=LEVER_ROW_S, run=str(run), checkpoints=ckpt, key=key, value=value,
                         cleanup=True)  # fmt: skip

    def env(self) -> dict[str, str]:
        """What every subprocess runs with: the wheelhouse's packages first, then the node's own (torch)."""
        path = os.pathsep.join([str(self.site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TORCH_EXTENSIONS_DIR": str(self.work / "torch_extensions"),
                "ULTRASCALE_CACHE_DIR": str(self.work / "cache"), "PYTHONNOUSERSITE": "1",
                **({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"} if self.job.cpu else {})}  # fmt: skip


# ---- running ------------------------------------------------------------------------------------------------------


def _expand(cmd: list[str]) -> list[str]:
    """Glob the wheelhouse pattern at run time (the plan prints it as a pattern)."""
    out = []
    for a in cmd:
        if a.endswith("*.whl"):
            found = sorted(str(p) for p in Path(a).parent.glob("*.whl"))
            if not found:
                raise RuntimeError(f"no wheels in {Path(a).parent}: run `make wheelhouse PY_VERSION=3.12` where the "
                                   "registry is reachable and carry it (carry=['wheelhouse/py3.12'])")  # fmt: skip
            out += found
        else:
            out.append(a)
    return out


def run_step(step: Step, plan: Plan, limit: float) -> dict:
    """Run the step's commands side by side under one limit; returns rc, seconds and log tails."""
    plan.logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    procs, logs = [], []
    try:
        for i, cmd in enumerate(step.cmds):
            argv = _expand(cmd)
            log = plan.logs / f"{len(list(plan.logs.iterdir())):02d}_{step.section}_{i}.log"
            logs.append(log)
            f = open(log, "w")  # noqa: SIM115 (open until the process it logs has ended)
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            procs.append((subprocess.Popen(argv, cwd=ROOT, env=plan.env(), stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True), f))  # fmt: skip
    except (RuntimeError, OSError) as e:
        for p, f in procs:
            _kill(p)
            f.close()
        return {"rc": 127, "seconds": 0.0, "error": str(e), "logs": [str(p) for p in logs], "tails": []}
    timed_out = False
    for p, _ in procs:
        left = limit - (time.perf_counter() - t0)
        try:
            p.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
    for p, f in procs:
        if p.poll() is None:
            _kill(p)
        f.close()
    rcs = [p.returncode for p, _ in procs]
    tails = [_tail(log) for log in logs]
    res = {"rc": 124 if timed_out else max(rcs, key=abs), "rcs": rcs, "seconds": time.perf_counter() - t0,
           "logs": [str(p) for p in logs], "tails": tails}  # fmt: skip
    if timed_out:
        res["error"] = f"timed out after {limit:.0f} s"
    elif res["rc"]:
        res["error"] = _error_line(tails[rcs.index(res["rc"])])
    return res


def _kill(p: subprocess.Popen) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


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
    return [{"result": "ok"}]


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


def p_trainer(step: Step, res: dict, ctx: dict) -> list[dict]:
    got = _json_from(res["tails"][0])
    ours = ctx.get("runs", {}).get(step.args["run"], {}).get("tokens_per_s")
    if not got:
        return [{"result": "no result line"}]
    ratio = ours / got["tokens_per_s"] if ours else None
    return [{"tokens_per_s": got["tokens_per_s"], "ours_tokens_per_s": ours, "ratio": ratio,
             "settings": got.get("settings"),
             "result": f"{got['tokens_per_s']:,.0f} tok/s; ours / Trainer = {_fmt(ratio, '.2f')}x"}]  # fmt: skip


def p_generate(step: Step, res: dict, ctx: dict) -> list[dict]:
    path = Path(step.args["out"])
    if not path.exists():
        return [{"result": "no JSON written"}]
    got = json.loads(path.read_text())
    tps = got.get("tokens_per_s", {})
    parts = [f"{k} {v:,.0f} tok/s" for k, v in tps.items() if isinstance(v, int | float)]
    speed = {k: v for k, v in got.items() if k.startswith("speedup") and isinstance(v, int | float)}
    return [{"tokens_per_s": tps, **speed, "identical_greedy": got.get("identical_greedy"),
             "result": "; ".join([*parts, *(f"{k} {v:.2f}x" for k, v in speed.items()),
                                  f"greedy identical: {got.get('identical_greedy')}"])}]  # fmt: skip


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

    from ultrascale.config import schema

    group, name = key.split(".", 1)
    root = {f.name: f for f in dataclasses.fields(schema.RootConfig)}
    cls = root[group].type if group in root else None
    cls = getattr(schema, cls, None) if isinstance(cls, str) else cls
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
    if name not in fields:
        return f"key missing: {key} is not in the schema of this checkout"
    typ = fields[name].type
    typ = getattr(schema, typ.split(" ")[0], None) if isinstance(typ, str) else typ
    if isinstance(typ, type) and issubclass(typ, enum.Enum) and value not in {m.value for m in typ}:
        return f"value missing: {key}={value} is not one of {', '.join(m.value for m in typ)}"
    if fields[name].type in (bool, "bool") and value not in ("true", "false"):
        return f"value missing: {key} is still a bool in this checkout (true/false), not {value!r}"
    return None


def execute(plan: Plan, budget: float, out_json: Path | None) -> dict:
    t_start = time.perf_counter()
    deadline = t_start + budget
    plan.work.mkdir(parents=True, exist_ok=True)
    ctx: dict = {}
    rows: list[dict] = []
    failed_prereq = False
    for step in plan.steps:
        left = deadline - time.perf_counter()
        base = {"section": step.section, "name": step.name}
        if step.args.get("key") and not failed_prereq:
            why = missing_lever(step.args["key"], step.args["value"]) if _schema_importable(plan) else None
            if why:
                rows.append({**base, "key": step.args["key"], "value": step.args["value"], "result": why})
                continue
        if failed_prereq:
            rows.append({**base, "result": "skipped: the install or data step failed"})
            continue
        if left < min(30.0, step.budget_s):
            rows.append({**base, "result": f"skipped: out of time ({left:.0f} s left of {budget:.0f}); run it with "
                                           f"--sections {step.section}"})  # fmt: skip
            continue
        limit = min(step.budget_s, left)
        print(f"[{time.perf_counter() - t_start:5.0f}s] {step.section}: {step.name} (limit {limit:.0f} s)", flush=True)
        res = run_step(step, plan, limit)
        row = {**base, "seconds": round(res["seconds"], 1), "rc": res["rc"]}
        try:
            parsed = PARSERS[step.parse](step, res, ctx) if step.parse else [{"result": "ok"}]
        except Exception as e:  # a parser that meets an unexpected output is a row too
            parsed = [{"result": f"could not read the output: {type(e).__name__}: {e}"}]
        for p in parsed:
            r = {**row, **p}
            if res["rc"]:
                r["result"] = f"FAILED ({res.get('error')})" + (f"; {p['result']}" if p.get("result") not in
                                                                 ("ok", "no steps logged", None) else "")  # fmt: skip
                r["log"] = res["logs"][0] if res["logs"] else None
                r["log_tail"] = res["tails"][res["rcs"].index(res["rc"])][-1500:] if res.get("rcs") and \
                    res["rc"] in res["rcs"] else (res["tails"][0][-1500:] if res["tails"] else None)  # fmt: skip
            rows.append(r)
        if res["rc"] and step.section in ALWAYS:
            failed_prereq = True
        if step.args.get("cleanup"):  # the 1B job's checkpoints are 17 GB each; the device's disk is 64 GiB
            import shutil

            shutil.rmtree(Path(step.args["run"]) / "checkpoints", ignore_errors=True)
    result = {"gpu": ctx.get("gpu"), "budget_s": budget, "wall_s": round(time.perf_counter() - t_start, 1),
              "rows": rows}  # fmt: skip
    print_table(result)
    if out_json is not None:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"\nJSON: {out_json}")
    return result


def _schema_importable(plan: Plan) -> bool:
    for p in (str(plan.site), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        import ultrascale.config.schema  # noqa: F401
    except Exception:
        return False
    return True


def print_table(result: dict) -> None:
    print(
        f"\n== GPU probe: {result.get('gpu') or 'GPU unknown'}; {result['wall_s']:.0f} s of {result['budget_s']:.0f} =="
    )
    print(f"{'section':<10} {'step':<46} {'s':>5}  result")
    for r in result["rows"]:
        secs = f"{r['seconds']:.0f}" if "seconds" in r else "-"
        print(f"{r['section']:<10} {r['name'][:46]:<46} {secs:>5}  {r['result']}")


def print_plan(plan: Plan, budget: float) -> None:
    print(f"GPU probe plan: {len(plan.steps)} steps, {budget:.0f} s in all (sections run in order while time is left)")
    print(f"work dir {plan.work}; wheelhouse {plan.wheelhouse}; python {plan.py}")
    for i, st in enumerate(plan.steps, 1):
        print(
            f"{i:2d}. [{st.section}] {st.name}  (limit {st.budget_s:.0f} s{', side by side' if len(st.cmds) > 1 else ''})"
        )
        for cmd in st.cmds:
            print(f"      $ {shlex.join(cmd)}")


# ---- workers (run as subprocesses, with the wheelhouse on the path) -------------------------------------------------


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


def w_data(work: str, seq: str, model: str) -> None:
    """The byte corpus at the job's length and at 256, and a random-init ``model`` with a BPE tokenizer of its
    vocabulary trained on the stdlib, saved as a HF directory (bench_generate's ``--model``)."""
    import sysconfig

    from data_prep.tokenizer import save_hf, train_bpe
    from ultrascale.config.compose import compose
    from ultrascale.data.bytecorpus import write_byte_dataset
    from ultrascale.model.build import build_model

    w = Path(work)
    for n in sorted({int(seq), 256}):
        write_byte_dataset(w / f"data{n}", seq_len=n)
    net = build_model(compose([f"model={model}"]).model, seed=0)
    texts = [p.read_text(errors="ignore") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:120]]
    tok = train_bpe(texts, vocab_size=int(net.config.vocab_size))
    save_hf(tok, w / f"{model}_random", model_max_length=2048)
    net.save_pretrained(str(w / f"{model}_random"))
    print(json.dumps({"vocab": tok.get_vocab_size(), "params": sum(p.numel() for p in net.parameters())}))


def w_predict(run_dir: str) -> None:
    """The planner's step time for the run's own config on one GPU of the cluster this card belongs to."""
    import torch
    from omegaconf import OmegaConf

    from ultrascale.config.schema import ClusterConfig, SearchConfig
    from ultrascale.config.validate import validate
    from ultrascale.model.arch import arch_from_hf
    from ultrascale.plan.search import decided, layout_from_cfg
    from ultrascale.plan.timing import step_time

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    preset = ("h200_8x" if "H200" in name else "a100_80g_8x" if "A100" in name else "cpu_local" if name == "cpu"
              else "h100_8x")  # fmt: skip
    base = OmegaConf.structured(ClusterConfig)
    chain = [OmegaConf.load(ROOT / "conf" / "cluster" / f"{preset}.yaml")]
    while "defaults" in chain[0]:
        parent = next(d for d in chain[0].defaults if isinstance(d, str))
        chain.insert(0, OmegaConf.load(ROOT / "conf" / "cluster" / f"{parent}.yaml"))
    for c in chain:
        c.pop("defaults", None)
    cluster = OmegaConf.to_object(OmegaConf.merge(base, *chain, {"nodes": 1, "gpus_per_node": 1}))
    if getattr(cluster, "measure_peak", False):  # cpu_local: this CPU's measured matmul rate
        from ultrascale.peak import gemm_rate

        cluster.peak_tflops, cluster.measure_peak = gemm_rate()["flops"] / 1e12, False
    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    from ultrascale.gpu import detect

    d = validate(cfg, 1, backend="nccl" if torch.cuda.is_available() else "gloo", gpu=detect())  # as the run decided
    lay = decided(layout_from_cfg(cfg, 1), d)
    s = SearchConfig()
    t = step_time(arch_from_hf(d.hf_config), lay, cluster, overlap=s.overlap, recompute_overhead=s.recompute_overhead)
    print(json.dumps({"step_s": t.step, "cluster": f"{preset} (1 rank)", "timing": t.as_dict()}))


def w_logits(run_dir: str, hf_dir: str) -> None:
    """The engine rebuilt from the run's checkpoint and the exported HF model score the same two validation rows
    on the GPU, each in the run's dtype."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from ultrascale import dist
    from ultrascale.config.compose import resolve_path
    from ultrascale.config.deepspeed import build_ds_config
    from ultrascale.config.validate import validate
    from ultrascale.data.shards import open_split
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


WORKERS = {"versions": w_versions, "data": w_data, "predict": w_predict, "logits": w_logits, "tokenizer": w_tokenizer}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, from {', '.join(SECTIONS)} (install and data always run)",
    )
    ap.add_argument("--levers", default="", help="only these LEVERS keys (comma-separated; default all)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole probe (470)")
    ap.add_argument("--wheelhouse", type=Path, default=ROOT / "wheelhouse" / "py3.12")
    ap.add_argument("--work", type=Path, help="scratch dir (default: a fresh temp dir)")
    ap.add_argument("--json", type=Path, help="default $OUT/gpu_probe.json where $OUT is set")
    ap.add_argument(
        "--job",
        choices=tuple(JOBS),
        default="gpu",
        help="gpu (default); tiny: the same sections on the tiny model on a CPU host, to check the probe",
    )
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
    work = a.work or Path(tempfile.gettempdir()) / f"gpu_probe-{os.getpid()}"
    plan = Plan(work.resolve(), a.wheelhouse.resolve(), sections, levers, job=a.job)
    if a.dry_run:
        print_plan(plan, a.budget)
        return 0
    out_json = a.json or (Path(os.environ["OUT"]) / "gpu_probe.json" if os.environ.get("OUT") else None)
    execute(plan, a.budget, out_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
