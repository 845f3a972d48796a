"""``make demo``: the whole product on this machine in a few minutes, with the documented commands.

1. data prep over this Python's own standard library (real code, always present, never downloaded);
2. ``deepspeed --num_gpus 2 train.py recipe=cpu_smoke`` on 2 CPU ranks, loss visibly falling;
3. held-out perplexity + HumanEval pass@1 on a subset, and an exported HF model directory;
4. where everything is, and the command to load the export.

Each step is a subprocess running the same command a user would type, printed before it runs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ultrascale.argv import ArgParser
from ultrascale.paths import PROJECT_ROOT
from ultrascale.runtime.dist import configure_env

BIN = Path(sys.executable).parent


def _run(cmd: list[str], title: str) -> None:
    print(f"\n=== {title} ===\n$ {shlex.join(cmd)}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env=os.environ.copy())
    if proc.returncode != 0:
        sys.exit(f"demo step failed ({title}): exit code {proc.returncode}")
    print(f"--- {title}: {time.time() - t0:.0f}s", flush=True)


def main() -> None:
    ap = ArgParser(prog="python -m ultrascale.demo", description=__doc__)
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks for training (default 2)")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps (default 150, a few minutes on 2 cores)")
    ap.add_argument("--max-files", type=int, default=1200, help="stdlib source files to prepare (default 1200)")
    ap.add_argument("--out", default="runs/demo", help="run directory (recreated)")
    ap.add_argument("--humaneval-limit", type=int, default=10, help="HumanEval problems for pass@1 (default 10)")
    args = ap.parse_args()
    configure_env()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    data = "data/stdlib_demo"
    out = PROJECT_ROOT / args.out
    shutil.rmtree(out, ignore_errors=True)

    _run(
        [sys.executable, "-m", "data_prep", f"output_dir={data}", f"source.max_files={args.max_files}"],
        "1/4 prepare the code corpus (Python standard library)",
    )
    _run(
        [str(BIN / "deepspeed"), "--num_gpus", str(args.nproc), "train.py", "recipe=cpu_smoke",
         f"data.path={data}", f"output_dir={args.out}", f"train.steps={args.steps}",
         "train.eval_interval=50", "train.checkpoint_interval=50", "train.log_interval=10"],
        f"2/4 train the tiny code model on {args.nproc} CPU ranks (DeepSpeed ZeRO-1)",
    )  # fmt: skip
    _run(
        [sys.executable, "eval.py", f"run_dir={args.out}", "tasks=[perplexity,humaneval]",
         f"humaneval.limit={args.humaneval_limit}", f"output_dir={args.out}/eval"],
        "3/4 evaluate: held-out perplexity and HumanEval pass@1 (sandboxed)",
    )  # fmt: skip
    export_dir = f"{args.out}/hf_export"
    _run(
        [sys.executable, "-m", "ultrascale.export", f"run_dir={args.out}", f"out={export_dir}"],
        "4/4 export the checkpoint to a Hugging Face model directory",
    )
    print(
        "\n=== where everything is ===\n"
        f"  run dir      {out}\n"
        f"  curves       {out / 'curves.png'}\n"
        f"  metrics      {out / 'metrics.jsonl'}\n"
        f"  checkpoints  {out / 'checkpoints'}\n"
        f"  tensorboard  tensorboard --logdir {out / 'tensorboard'}\n"
        f"  wandb        {out / 'wandb'}  (offline; `wandb sync` it to upload)\n"
        f"  eval         {out / 'eval' / 'eval_results.json'}\n"
        f"  HF export    {PROJECT_ROOT / export_dir}\n"
        '  load it:     python -c "from transformers import AutoModelForCausalLM, AutoTokenizer; '
        f"m = AutoModelForCausalLM.from_pretrained('{export_dir}'); t = AutoTokenizer.from_pretrained('{export_dir}')\""
    )


if __name__ == "__main__":
    main()
