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

from ultrascale.dist import _free_port  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline"}
ENV.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))

PROBE = """
import json, sys, resource
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
which, run_dir, out = sys.argv[1:4]
if which == 'ultrascale':
    stats = ultrascale.export.export(run_dir, out, dtype='fp32', max_shard_size='1GB')
else:
    tag = open(run_dir + '/checkpoints/latest').read().strip()
    # safe_serialization=True fails on tied embeddings (shared storage) in deepspeed 0.19.8: use torch.save
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(run_dir + '/checkpoints', out, max_shard_size='1GB',
                                                            safe_serialization=False, tag=tag)
end = status()
size = sum(p.stat().st_size for p in __import__('pathlib').Path(out).glob('*') if p.suffix in ('.safetensors', '.bin'))
print(json.dumps({'peak_rss_mb': end['VmHWM'], 'baseline_rss_mb': base['VmRSS'],
                  'growth_mb': end['VmHWM'] - base['VmRSS'], 'weights_mb': size / 2**20}))
"""


def train(run_dir: Path, data: Path, stage: int, layers: int, hidden: int) -> None:
    inter = int(hidden * 8 / 3) // 64 * 64
    port = str(_free_port())  # torchrun passes --master_port 0 to the ranks literally
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, "train.py"]
    cmd += [f"output_dir={run_dir}", f"zero=stage{stage}", f"data.path={data}", "data.prepare_max_files=80"]
    cmd += ["data.micro_batch=1", "data.global_batch=2", "train.steps=1", "train.checkpoint_interval=1"]
    cmd += ["train.eval_interval=0", "logger=none", f"model.config.hidden_size={hidden}"]
    cmd += [f"model.config.num_hidden_layers={layers}", f"model.config.intermediate_size={inter}"]
    cmd += ["model.config.num_attention_heads=12", "model.config.num_key_value_heads=4", "model.name=bench"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"training failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


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
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        tmp = Path(tmp)
        for stage in (1, 3):
            run_dir = tmp / f"zero{stage}"
            train(run_dir, tmp / "data", stage, args.layers, args.hidden)
            for which in ("deepspeed_zero_to_fp32", "ultrascale"):
                r = measure(which, run_dir, tmp / f"out_{stage}_{which}")
                rows.append({"zero_stage": stage, "exporter": which, **r})
    print(f"{'ZeRO':>4}  {'exporter':<24}{'weights MB':>11}{'peak RSS MB':>13}{'growth MB':>11}{'growth/weights':>16}")
    for r in rows:
        ratio = r["growth_mb"] / r["weights_mb"]
        print(f"{r['zero_stage']:>4}  {r['exporter']:<24}{r['weights_mb']:>11.0f}{r['peak_rss_mb']:>13.0f}"
              f"{r['growth_mb']:>11.0f}{ratio:>16.2f}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
