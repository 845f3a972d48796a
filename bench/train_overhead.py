"""Tokens/s of ``train.py`` against a bare DeepSpeed loop and HF ``Trainer`` + DeepSpeed, in paired rounds.

Three sides train the same tiny Llama (``build_model`` from the same config.yaml, same seed) on the same
packed shards with the same DeepSpeed JSON (the ds_config.json train.py writes: ZeRO stage, micro batch,
accumulation, train_batch_size, clipping, precision) on the same number of CPU ranks:

    ultrascale  ``train.py``, every lever at its default (or as ``--train-args`` sets it)
    bare        bench/_bare_loop.py: forward/backward/step on a plain torch AdamW, nothing else
    trainer     bench/_trainer_loop.py: ``transformers.Trainer(args=TrainingArguments(deepspeed=...))``
                with Trainer's own defaults for everything the config does not fix (its optimizer is
                recorded in the JSON settings, as is every key of the DeepSpeed JSON it rewrote)

Method, and how it keeps noise down on a shared 2-core machine:

* One definition of throughput for all three: wall clock from the end of optimizer step 1 to the end of
  step N, tokens = global batch * seq_len * (N - 1). Step 1 (allocator warm-up, first-touch, any
  compilation) is excluded; everything a loop does between steps (metrics, logging, all-reduces,
  progress bars, data loading) is included. Start-up and the final eval/checkpoint are outside the window.
* One rank per core with ``OMP_NUM_THREADS=1``, so the ranks, not intra-op threads, share the cores.
* An untimed warm-up run of train.py first (page cache, JIT/extension caches, Python bytecode); it also
  writes the config.yaml and ds_config.json the other two sides read.
* Rounds, each running all three sides back to back; the order rotates (round r starts with side r % 3),
  so no side is always first or last after a pause or a neighbour's burst.
* Per round the paired ratios ``ultrascale/bare`` and ``ultrascale/trainer``: a slow stretch of the machine
  that spans a round hits all three sides, and dividing within the round cancels it. The reported ratios
  are the medians of the paired ratios (robust to one disturbed round), with min-max and IQR as the spread.
* A robust companion, reported next to (never instead of) the wall-clock ratios: each run's rate from its
  median step interval (end of step k-1 to end of step k, between-step work included), paired the same
  way. A burst from another process that covers a few steps of one run moves the window rate but not the
  median step; when the two disagree, the machine was disturbed. (train.py's intervals come from the
  ``time_s`` stamps of metrics.jsonl; if that key is missing the companion is left out.)
* ``--settle`` seconds of pause before each run, and optionally (``--max-load``) a wait of up to
  ``--max-wait`` seconds for the 1-minute load average to fall below a level; the load average before each
  run is recorded in the JSON so a disturbed run can be seen.

Targets: ratio_vs_bare >= 0.97 (train.py's extras cost at most 3%) and ratio_vs_trainer >= 1.15.
Data: the BPE-tokenized stdlib corpus at data/stdlib when it is prepared (seq_len and vocab fitting), else
the byte-level stdlib corpus written to a temporary directory; the JSON settings say which.

    python bench/train_overhead.py [--rounds 5] [--steps 30] [--zero stage1] [--nproc 2] [--seq-len 256]
                                   [--train-args "train.compile=false optim.fused=false"] [--json PATH]
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

SIDES = ("ultrascale", "bare", "trainer")
TARGET_VS_BARE, TARGET_VS_TRAINER = 0.97, 1.15
# Resolved config keys worth recording when they exist; the harness never requires them.
LEVER_KEYS = ("train.compile", "train.fused_loss", "optim.fused", "data.document_masking", "train.step_breakdown",
              "train.attn_block_size", "optim.torch_adam", "model.attn_implementation")  # fmt: skip


def _json_line(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith('{"')][-1])


def pick_data(choice: str, seq_len: int, tmp: Path) -> tuple[Path, str]:
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
            elif int(m["vocab_size"]) > 4096:
                why = f"{stdlib} vocab {m['vocab_size']} > the tiny model's 4096"
            else:
                return stdlib, f"BPE stdlib corpus {stdlib} (vocab {m['vocab_size']})"
        if choice == "stdlib":
            sys.exit(
                f"error: --data stdlib: {why}: run `python -m data_prep output_dir=data/stdlib` or use --data auto"
            )
    from ultrascale.data.bytecorpus import write_byte_dataset

    data = write_byte_dataset(tmp / "data", seq_len=seq_len, max_files=200)
    return data, "byte-level stdlib corpus (ultrascale.data.bytecorpus, 257 ids)" + (f"; {why}" if why else "")


def _settle(a: argparse.Namespace) -> float:
    """Pause before a run (and wait for a quiet machine if asked); returns the 1-min load average now."""
    if a.settle:
        time.sleep(a.settle)
    if a.max_load is not None:
        deadline = time.monotonic() + a.max_wait
        while os.getloadavg()[0] > a.max_load and time.monotonic() < deadline:
            time.sleep(2)
    return round(os.getloadavg()[0], 2)


def _run(side: str, a, tmp: Path, name: str, common: list[str], ref: Path, data: Path) -> dict:
    """One timed run of one side; returns tokens/s, per-step losses and the load average before it."""
    load = _settle(a)
    t0 = time.perf_counter()
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
        }
    elif side == "bare":
        got = _json_line(torchrun(a.nproc, ["bench/_bare_loop.py", str(ref), str(data), str(a.steps)]).stdout)
    else:
        out = tmp / name
        got = _json_line(
            torchrun(a.nproc, ["bench/_trainer_loop.py", str(ref), str(data), str(a.steps), str(out)]).stdout
        )
    iv = got.get("step_intervals_s") or []
    # The robust companion: one typical step (median interval) instead of the whole window, so a burst
    # from another process during a few steps does not move it. Secondary; the wall window is the rate.
    got["median_step_tokens_per_s"] = a.tokens_per_step / statistics.median(iv) if iv else None
    got["load1_before"] = load
    got["run_s"] = round(time.perf_counter() - t0, 1)
    return got


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _spread(xs: list[float]) -> dict:
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "q1": q1, "q3": q3, "iqr": q3 - q1}


def _settings(a, ref: Path, data_desc: str, trainer_settings: dict, common: list[str]) -> dict:
    import accelerate
    import deepspeed
    import torch
    import transformers
    from omegaconf import OmegaConf

    from ultrascale.model.build import count_params

    cfg = OmegaConf.load(ref / "config.yaml")
    ds = json.loads((ref / "ds_config.json").read_text())
    return {
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
        "data": data_desc,
        "train_args": a.train_args,
        "train_py_overrides": common,
        "levers": {k: OmegaConf.select(cfg, k, default=None) for k in LEVER_KEYS},
        "ds_config": ds,
        "bare": "torch.optim.AdamW over all parameters (foreach), lr set per step from the config's schedule",
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
    rounds = res["rounds"]
    lines = [f"\n| {'side':<40} | {'tok/s median':>12} | {'min':>8} | {'max':>8} | {'final loss':>10} |",
             f"|{'-' * 42}|{'-' * 14}|{'-' * 10}|{'-' * 10}|{'-' * 12}|"]  # fmt: skip
    names = {"ultrascale": "train.py (ultrascale)", "bare": "bare DeepSpeed loop",
             "trainer": "HF Trainer + DeepSpeed"}  # fmt: skip
    for side in SIDES:
        xs = [r[side] for r in rounds]
        loss = statistics.median(r["loss"][side] for r in rounds)
        lines.append(f"| {names[side]:<40} | {statistics.median(xs):>12,.0f} | {min(xs):>8,.0f} | {max(xs):>8,.0f} "
                     f"| {loss:>10.4f} |")  # fmt: skip
    lines += ["", f"| {'paired ratio':<30} | {'median':>7} | {'min':>7} | {'max':>7} | {'IQR':>7} | {'target':>7} | verdict |",
              f"|{'-' * 32}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 9}|"]  # fmt: skip
    for key, label, target in (("ratio_vs_bare", "ultrascale/bare", TARGET_VS_BARE),
                               ("ratio_vs_trainer", "ultrascale/trainer", TARGET_VS_TRAINER)):  # fmt: skip
        s = res["spread"][key]
        verdict = "met" if s["median"] >= target else "NOT met"
        lines.append(f"| {label:<30} | {s['median']:>7.3f} | {s['min']:>7.3f} | {s['max']:>7.3f} | {s['iqr']:>7.3f} "
                     f"| {'>= ' + str(target):>7} | {verdict:<7} |")  # fmt: skip
        m = res["median_step_spread"][key]
        if m:
            lines.append(f"| {label + ' (med. step)':<30} | {m['median']:>7.3f} | {m['min']:>7.3f} | {m['max']:>7.3f} "
                         f"| {m['iqr']:>7.3f} | {'':>7} | {'':<7} |")  # fmt: skip
    lines.append("\n(med. step: the same ratio from each run's median step interval, the robust companion; the "
                 "verdict is on the wall-clock window)")  # fmt: skip
    return "\n".join(lines)


def _summary(rounds: list[dict], settings: dict, complete: bool) -> dict:
    spread = {k: _spread([r[k] for r in rounds]) for k in ("ratio_vs_bare", "ratio_vs_trainer")}
    robust = {}
    for k in ("ratio_vs_bare", "ratio_vs_trainer"):
        xs = [r["median_step"][k] for r in rounds if r["median_step"][k] is not None]
        robust[k] = _spread(xs) if xs else None
    return {
        "ratio_vs_bare": spread["ratio_vs_bare"]["median"],
        "ratio_vs_trainer": spread["ratio_vs_trainer"]["median"],
        "targets": {"ratio_vs_bare": TARGET_VS_BARE, "ratio_vs_trainer": TARGET_VS_TRAINER},
        "met": {
            "ratio_vs_bare": spread["ratio_vs_bare"]["median"] >= TARGET_VS_BARE,
            "ratio_vs_trainer": spread["ratio_vs_trainer"]["median"] >= TARGET_VS_TRAINER,
        },
        "spread": spread,
        "median_step_spread": robust,
        "tokens_per_s_median": {s: statistics.median(r[s] for r in rounds) for s in SIDES},
        "complete": complete,
        "rounds": rounds,
        "settings": settings,
    }


def _write(path: str | None, res: dict) -> None:
    if path:
        from ultrascale.atomic import atomic_write_text

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(path), json.dumps(res, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds of all three sides (default 5)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run; steps 2..N are timed")
    ap.add_argument("--zero", default="stage1", help="conf/zero/ group for train.py (default stage1)")
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks per run (default 2)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="micro batch per rank (accumulation is 2)")
    ap.add_argument("--data", default="auto", choices=("auto", "stdlib", "bytes"),
                    help="auto: data/stdlib if prepared and fitting, else the byte corpus")  # fmt: skip
    ap.add_argument("--train-args", default="",
                    help="extra train.py overrides, e.g. 'train.compile=false optim.fused=true'")  # fmt: skip
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of pause before each run (default 2)")
    ap.add_argument("--max-load", type=float, default=None, help="wait for the 1-min load average below this")
    ap.add_argument("--max-wait", type=float, default=60.0, help="longest wait for --max-load, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directories (default: removed)")
    ap.add_argument("--json", dest="json_path", help="write results as JSON here")
    a = ap.parse_args()
    a.tokens_per_step = a.micro * a.nproc * 2 * a.seq_len
    if a.rounds < 1 or a.steps < 2:
        sys.exit(f"error: --rounds={a.rounds} --steps={a.steps}: need at least 1 round and 2 steps (step 1 is untimed)")

    from tqdm import tqdm

    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    data, data_desc = pick_data(a.data, a.seq_len, tmp)
    common = ["logger=none", f"zero={a.zero}", f"data.path={data}", f"data.seq_len={a.seq_len}",
              f"data.micro_batch={a.micro}", f"data.global_batch={a.micro * a.nproc * 2}", f"train.steps={a.steps}",
              "train.eval_interval=0", "train.checkpoint_interval=0", "optim.sched.warmup_steps=5",
              "data.eval_batches=1", *shlex.split(a.train_args)]  # fmt: skip
    bar = tqdm(total=1 + 3 * a.rounds, desc="runs", unit="run", dynamic_ncols=True)
    ref = tmp / "warmup"  # untimed; its config.yaml and ds_config.json feed the bare and Trainer sides
    bar.set_postfix_str("warm-up train.py")
    torchrun(a.nproc, ["train.py", *common, f"output_dir={ref}"])
    bar.update(1)
    rounds, trainer_settings = [], {}
    for r in range(a.rounds):
        order = SIDES[r % 3 :] + SIDES[: r % 3]
        got = {}
        for side in order:
            bar.set_postfix_str(f"round {r + 1} {side}")
            got[side] = _run(side, a, tmp, f"{side}{r}", common, ref, data)
            bar.update(1)
        trainer_settings = got["trainer"].pop("settings", trainer_settings)
        row = {
            "round": r + 1,
            "order": list(order),
            **{s: got[s]["tokens_per_s"] for s in SIDES},
            "ratio_vs_bare": got["ultrascale"]["tokens_per_s"] / got["bare"]["tokens_per_s"],
            "ratio_vs_trainer": got["ultrascale"]["tokens_per_s"] / got["trainer"]["tokens_per_s"],
            "loss": {s: got[s]["loss"] for s in SIDES},
            "losses": {s: got[s]["losses"] for s in SIDES},
            "load1_before": {s: got[s]["load1_before"] for s in SIDES},
            "run_s": {s: got[s]["run_s"] for s in SIDES},
            "median_step": {
                **{s: got[s]["median_step_tokens_per_s"] for s in SIDES},
                **{
                    f"ratio_vs_{s}": got["ultrascale"]["median_step_tokens_per_s"] / got[s]["median_step_tokens_per_s"]
                    if got["ultrascale"]["median_step_tokens_per_s"] and got[s]["median_step_tokens_per_s"]
                    else None
                    for s in ("bare", "trainer")
                },
            },
            "step_intervals_s": {s: got[s].get("step_intervals_s") for s in SIDES},
        }
        rounds.append(row)
        settings = _settings(a, ref, data_desc, trainer_settings, common)
        _write(a.json_path, _summary(rounds, settings, complete=r + 1 == a.rounds))  # a cut-off run keeps its rounds
        bar.write(
            f"round {r + 1}/{a.rounds} ({' > '.join(order)}): ultrascale {row['ultrascale']:,.0f} | bare "
            f"{row['bare']:,.0f} | trainer {row['trainer']:,.0f} tok/s  ->  ultrascale/bare "
            f"{row['ratio_vs_bare']:.3f}, ultrascale/trainer {row['ratio_vs_trainer']:.3f}  "
            f"[med. step {_fmt(row['median_step']['ratio_vs_bare'])}, {_fmt(row['median_step']['ratio_vs_trainer'])}]  "
            f"(load {'/'.join(str(row['load1_before'][s]) for s in order)})"
        )
    bar.close()
    res = _summary(rounds, settings, complete=True)
    print(_table(res))
    st = res["settings"]
    print(f"\n{a.rounds} rounds x 3 sides, {a.steps} steps (2..{a.steps} timed), ZeRO {st['zero_stage']}, {a.nproc} CPU "
          f"ranks, {st['model']} ({st['model_params'] / 1e6:.1f}M params), seq {a.seq_len}, global batch "
          f"{st['global_batch']}, {st['precision']}; Trainer optim {trainer_settings.get('optim')}; data: {data_desc}")  # fmt: skip
    if a.keep:
        print(f"run directories kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
