"""Export peak memory against model size: ultrascale.export vs DeepSpeed's zero_to_fp32, same checkpoints.

Trains one step of a ~400M-parameter Llama (1.6 GB in fp32) (2 CPU ranks, ZeRO-1 and ZeRO-3) with ``train.py``, then
exports each checkpoint in a fresh process and records that process's peak RSS (VmHWM) and its growth
over the post-import baseline; the baseline is DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict``
(1 GB shards; torch.save, since its safetensors path fails on tied embeddings) on the same checkpoint.

Usage: ``python bench/bench_export.py [--layers 16] [--hidden 1536] [--json PATH]`` (about 3-5 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ultrascale.runtime.dist import free_port  # noqa: E402
from ultrascale.train.rundir import CHECKPOINTS, LATEST  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline"}
ENV.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))

PROBE = """
import json, sys, threading, time
def status():
    out = {}
    for ln in open('/proc/self/status'):
        k, _, v = ln.partition(':')
        if k in ('VmRSS', 'VmHWM', 'RssAnon'):
            out[k] = int(v.split()[0]) / 1024
    return out
import torch, transformers, deepspeed, safetensors.torch  # imports are not the exporter's memory
from deepspeed.utils import zero_to_fp32
import ultrascale.export
from ultrascale.model.build import build_hf_config
base = status()
peak_anon = [base['RssAnon']]
done = threading.Event()
def watch():  # VmHWM has no anonymous-only twin: sample RssAnon every 5 ms
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], status()['RssAnon'])
        time.sleep(0.005)
threading.Thread(target=watch, daemon=True).start()
which, run_dir, out = sys.argv[1:4]
if which == 'ultrascale':
    stats = ultrascale.export.export(run_dir, out, dtype='fp32', max_shard_size='1GB')
else:
    tag = open(run_dir + '/checkpoints/latest').read().strip()
    # safe_serialization=True fails on tied embeddings (shared storage) in deepspeed 0.19.8: use torch.save
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(run_dir + '/checkpoints', out, max_shard_size='1GB',
                                                            safe_serialization=False, tag=tag)
done.set()
end = status()
print(json.dumps({'peak_rss_mb': end['VmHWM'], 'baseline_rss_mb': base['VmRSS'],
                  'growth_mb': end['VmHWM'] - base['VmRSS'], 'anon_growth_mb': peak_anon[0] - base['RssAnon']}))
"""


def train(run_dir: Path, data: Path, stage: int, layers: int, hidden: int) -> None:
    from data_prep.api import prepare

    prepare(str(data), max_files=80)  # returns at once when it is already prepared
    inter = int(hidden * 8 / 3) // 64 * 64
    port = str(free_port())  # torchrun passes --master_port 0 to the ranks literally
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, "train.py"]
    cmd += [f"output_dir={run_dir}", f"zero=stage{stage}", f"data.path={data}"]
    cmd += ["data.micro_batch=1", "data.global_batch=2", "train.steps=1", "train.checkpoint_interval=1"]
    cmd += ["train.eval_interval=0", "logger=none", "train.compile=false", f"model.config.hidden_size={hidden}"]
    cmd += [f"model.config.num_hidden_layers={layers}", f"model.config.intermediate_size={inter}"]
    cmd += ["model.config.num_attention_heads=12", "model.config.num_key_value_heads=4", "model.name=bench"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"training failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def model_mb(run_dir: Path) -> float:
    """fp32 model size from the checkpoint's parameter count (the same for both exporters)."""
    probe = "import sys; from omegaconf import OmegaConf; from ultrascale.model.build import count_params; "
    probe += "print(count_params(OmegaConf.load(sys.argv[1]).model)['total'])"
    out = subprocess.run([sys.executable, "-c", probe, str(run_dir / "config.yaml")], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1]) * 4 / 2**20


def measure(which: str, run_dir: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, which, str(run_dir), str(out)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{which} export failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path, help="keep (and on a rerun, reuse) the trained runs here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        work = args.workdir or Path(tmp)
        for stage in (1, 3):
            run_dir = work / f"zero{stage}"
            if not (run_dir / CHECKPOINTS / LATEST).exists():
                train(run_dir, work / "data", stage, args.layers, args.hidden)
            size = model_mb(run_dir)
            for which in ("deepspeed_zero_to_fp32", "ultrascale"):
                out = Path(tmp) / f"out_{stage}_{which}"
                rows.append(
                    {"zero_stage": stage, "exporter": which, "model_fp32_mb": size, **measure(which, run_dir, out)}
                )
    head = f"{'ZeRO':>4}  {'exporter':<24}{'model MB':>9}{'peak RSS MB':>13}{'RSS growth MB':>15}{'anon growth MB':>16}"
    print(head + f"{'anon/model':>12}")
    for r in rows:
        print(f"{r['zero_stage']:>4}  {r['exporter']:<24}{r['model_fp32_mb']:>9.0f}{r['peak_rss_mb']:>13.0f}"
              f"{r['growth_mb']:>15.0f}{r['anon_growth_mb']:>16.0f}{r['anon_growth_mb'] / r['model_fp32_mb']:>12.3f}")  # fmt: skip
    print("RSS growth includes memory-mapped checkpoint pages (page cache the kernel can drop); anon growth does not.")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
