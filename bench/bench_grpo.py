"""GRPO step time: our ``train.py recipe=smollm2_135m_grpo`` against TRL's ``GRPOTrainer``, measured in one run.

Both arms: SmolLM2-135M-Instruct with LoRA r=16 (alpha 32, no dropout, every projection), HumanEval's dev half,
4 prompts x 8 generations x up to 128 tokens a step at temperature 1, DAPO loss, beta 0, lr 1e-4 (cosine, 2 warmup
steps), no gradient checkpointing, the same sandboxed execution reward (``ExecutionReward``, 10 s limit, 2 workers),
on this machine's cores (ours: 2 ranks x 1 thread under ZeRO-2; TRL: one process x 2 threads, as TRL runs on a CPU), both in micro-batches
of 4 completions (TRL: 8 accumulation steps, one generation per optimizer step). A first TRL arm with all 32
completions in one micro-batch was killed by the kernel at 24 GB.
TRL runs twice: plain ``generate`` and ``use_transformers_continuous_batching``. Reported: the median step time over
steps 2..N, generated tokens/s, and each side's generation share. TRL lives in ``.cache/venv-trl`` (``make
grpo-fixture`` makes it), never in the project's environment.

    python bench/bench_grpo.py --steps 5 --json bench/results/bench_grpo.json     # make bench-grpo

One difference stays: our sampler stops a completion at HumanEval's stop sequences (the end of the function body),
TRL's ``generate`` at EOS or the length limit, so TRL generates more tokens a step; tokens/s is reported beside the
step time so the two can be told apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"),
       "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}  # fmt: skip


def ours(model: str, steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "train.py",
               "recipe=smollm2_135m_grpo", f"model.pretrained_path={model}", f"train.steps={steps}",
               f"train.seed={seed}", "train.checkpoint_interval=0", "train.final_save=false", "logger=none",
               f"output_dir={d}"]  # fmt: skip
        p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"ours failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        rows = [json.loads(ln) for ln in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return {"step_s": [r["step_s"] for r in rows], "gen_s": [r["gen_s"] for r in rows],
            "reward_s": [r["reward_s"] for r in rows], "tokens": [r["generated_tokens"] for r in rows]}  # fmt: skip


def trl(model: str, steps: int, seed: int, python: str, cb: bool) -> dict:
    cmd = [python, str(ROOT / "bench" / "_trl_grpo.py"), "--model", model, "--steps", str(steps), "--seed", str(seed)]
    p = subprocess.run(cmd + (["--continuous-batching"] if cb else []), cwd=ROOT, env={**os.environ, **ENV,
                       "OMP_NUM_THREADS": "2"}, capture_output=True, text=True)  # fmt: skip
    if p.returncode:
        tail = [ln for ln in (p.stdout + p.stderr).strip().splitlines() if "it/s]" not in ln]
        return {"error": f"exit {p.returncode}: {(tail or ['no output'])[-1][:300]}"}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["tokens"] = [float(m) * out["completions_per_step"] for m in out["mean_length"]]
    return out


def summarize(name: str, r: dict) -> dict:
    if "error" in r:
        return {"arm": name, "error": r["error"]}
    steady = slice(1, None)  # steps 2..N: the first carries start-up
    step = statistics.median(r["step_s"][steady])
    tokens = sum(r["tokens"][steady]) / max(len(r["tokens"][steady]), 1)
    return {"arm": name, "median_step_s": round(step, 2), "tokens_per_step": round(tokens, 1),
            "gen_tokens_per_s": round(tokens / statistics.median(r["gen_s"][steady]), 1),
            "gen_share": round(sum(r["gen_s"][steady]) / sum(r["step_s"][steady]), 3),
            "reward_share": round(sum(r["reward_s"][steady]) / sum(r["step_s"][steady]), 3),
            "steps": len(r["step_s"])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    ap.add_argument("--trl-python", default=str(ROOT / ".cache" / "venv-trl" / "bin" / "python"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--arms", default="ours,trl_generate,trl_continuous_batching")
    a = ap.parse_args()
    arms = a.arms.split(",")
    rows = []
    for arm in arms:
        print(f"bench_grpo: running {arm} for {a.steps} steps", flush=True)
        r = ours(a.model, a.steps, a.seed) if arm == "ours" else trl(a.model, a.steps, a.seed, a.trl_python,
                                                                      cb=arm == "trl_continuous_batching")  # fmt: skip
        rows.append(summarize(arm, r))
    ok = {r["arm"]: r for r in rows if "error" not in r}
    trl_arms = [r for n, r in ok.items() if n.startswith("trl")]
    result = {"rows": rows, "steps": a.steps}
    if "ours" in ok and trl_arms:
        fastest = min(trl_arms, key=lambda r: r["median_step_s"])
        result["speedup_vs_trl"] = round(fastest["median_step_s"] / ok["ours"]["median_step_s"], 2)
        result["vs"] = fastest["arm"]
    print(f"{'arm':<26}{'step s':>9}{'tok/step':>10}{'gen tok/s':>11}{'gen share':>11}{'reward share':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['arm']:<26}error: {r['error']}")
            continue
        print(f"{r['arm']:<26}{r['median_step_s']:>9.2f}{r['tokens_per_step']:>10.0f}{r['gen_tokens_per_s']:>11.1f}"
              f"{r['gen_share']:>11.1%}{r['reward_share']:>14.1%}")  # fmt: skip
    if "speedup_vs_trl" in result:
        print(f"speedup vs TRL's faster arm ({result['vs']}): {result['speedup_vs_trl']}x (median step time)")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
