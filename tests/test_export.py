"""Export parity: 2-rank CPU training under ZeRO 0-3 (``train.py`` via torchrun), export, then the HF model's
fp32 logits equal the DeepSpeed engine's on the same batch to 1e-5, ``generate`` runs, and the exported
tokenizer round-trips.

The engine side runs once for all four checkpoints: this file doubles as the torchrun worker
(``python tests/test_export.py --engine-logits OUT RUN...``), which rebuilds each run's engine from its
config.yaml, loads the checkpoint and saves its logits. Five 2-rank launches in all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ultrascale.dist import free_port  # torchrun passes --master_port 0 to the ranks literally

STAGES = (0, 1, 2, 3)
ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
    "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions")),
}


def _torchrun(args: list[str], log: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        *args,
    ]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args[:3])} failed (rc {proc.returncode}):\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Train 3 steps under each ZeRO stage on shared prepared data; then collect each engine's logits."""
    root = tmp_path_factory.mktemp("export")
    data = root / "data"
    run_dirs = {}
    for stage in (*STAGES, "pp2"):
        run_dir = root / (f"zero{stage}" if stage != "pp2" else "pp2")
        layout = [f"zero=stage{stage}"] if stage != "pp2" else ["zero=stage1", "parallel=pp2"]
        overrides = [f"output_dir={run_dir}", *layout, f"data.path={data}", "data.prepare_max_files=80"]
        overrides += [
            "train.steps=3",
            "train.checkpoint_interval=3",
            "train.eval_interval=0",
            "logger=none",
            "train.compile=false",
        ]
        _torchrun(["train.py", *overrides], root / f"train_{run_dir.name}.log")
        run_dirs[stage] = run_dir
    logits_dir = root / "engine_logits"
    _torchrun([__file__, "--engine-logits", str(logits_dir), *map(str, run_dirs.values())], root / "engine.log")
    return {"root": root, "data": data, "runs": run_dirs, "logits": logits_dir}


@pytest.mark.dist
@pytest.mark.parametrize("stage", STAGES)
def test_export_matches_engine_logits_and_generates(runs, stage):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ultrascale.export import export

    out = runs["root"] / f"hf_zero{stage}"
    stats = export(runs["runs"][stage], out, max_shard_size="1MB")  # several shards even for a tiny model
    assert stats["zero_stage"] == stage and stats["shards"] > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("model-*.safetensors")}

    ref = torch.load(runs["logits"] / f"zero{stage}.pt")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ref["ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
    # the checkpoint is trained, not the initialization: weights moved, so the match is not trivial
    assert ref["step"] == 3

    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = tok("def fibonacci(n):", return_tensors="pt")
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] == prompt["input_ids"].shape[1] + 8 or gen[0, -1] == tok.eos_token_id


@pytest.mark.dist
def test_pipeline_checkpoint_exports_to_the_same_loss(runs):
    from transformers import AutoModelForCausalLM

    from ultrascale.export import export

    out = runs["root"] / "hf_pp2"
    stats = export(runs["runs"]["pp2"], out)
    ref = torch.load(runs["logits"] / "pp2.pt")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        loss = model(input_ids=ref["ids"], labels=ref["ids"]).loss
    assert stats["tensors"] == len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert ref["step"] == 3
    assert abs(float(loss) - ref["loss"]) < 1e-5, (float(loss), ref["loss"])


@pytest.mark.dist
def test_exported_tokenizer_round_trips(runs):
    from transformers import AutoTokenizer

    from ultrascale.data.shards import load_manifest
    from ultrascale.export import export

    out = runs["root"] / "hf_tok"
    export(runs["runs"][1], out)
    original = AutoTokenizer.from_pretrained(str(runs["data"] / load_manifest(runs["data"])["tokenizer"]))
    exported = AutoTokenizer.from_pretrained(str(out))
    text = 'def f(x):\n    """Docstring: ünïcödé, tabs\tand  spaces."""\n    return {"k": x ** 2}  # ok\n'
    ids = exported(text)["input_ids"]
    assert ids == original(text)["input_ids"]
    assert exported.decode(ids) == text
    assert exported.eos_token_id == original.eos_token_id
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == original.eos_token_id


@pytest.mark.dist
def test_export_refuses_bad_requests(runs, tmp_path):
    from ultrascale.errors import CheckpointError, ConfigError
    from ultrascale.export import main

    with pytest.raises(CheckpointError, match="step=7"):
        from ultrascale.export import export

        export(runs["runs"][0], tmp_path / "x", step=7)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="overwrite=true"):
        export(runs["runs"][0], occupied)
    assert main([f"run_dir={runs['runs'][0]}", f"out={tmp_path / 'y'}", "setp=3"]) == 2


@pytest.mark.dist
def test_eval_py_on_a_run_dir(runs):
    run_dir = runs["runs"][2]
    cmd = [sys.executable, str(ROOT / "eval.py"), f"run_dir={run_dir}", "perplexity.max_samples=4"]
    cmd += ["humaneval.limit=1", "humaneval.max_new_tokens=8"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((run_dir / "eval" / "step_00000003" / "eval_results.json").read_text())
    assert res["step"] == 3 and res["tasks"]["perplexity"]["tokens"] == 4 * 255
    assert res["tasks"]["humaneval"]["problems"] == 1
    # 3 steps from random init: the loss is still near ln(vocab), a check that the trained weights were scored
    assert 5.0 < res["tasks"]["perplexity"]["loss_per_token"] < 9.0


def _engine_logits(out: Path, run_dirs: list[Path]) -> None:
    """torchrun worker: each run's engine, rebuilt from its config and checkpoint, scores one batch."""
    from omegaconf import OmegaConf

    from ultrascale import dist
    from ultrascale.config.compose import resolve_path
    from ultrascale.config.deepspeed import build_ds_config
    from ultrascale.config.validate import validate
    from ultrascale.data.shards import open_split
    from ultrascale.train import checkpoint
    from ultrascale.train.engine import build_engine

    dist.configure_env()
    dist.init_distributed()
    out.mkdir(parents=True, exist_ok=True)
    for run_dir in run_dirs:
        cfg = OmegaConf.load(run_dir / "config.yaml")
        d = validate(cfg, dist.world_size())
        topo = d.topo
        engine, _ = build_engine(cfg, d, build_ds_config(cfg, d))
        tag_dir = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
        step, _ = checkpoint.load(engine, tag_dir, same_world=True)
        split = open_split(resolve_path(cfg.data.path), "validation")
        engine.eval()
        if topo.pp > 1:  # the pipeline engine returns the loss of a batch, not logits
            ids = torch.from_numpy(split.get(np.arange(cfg.data.micro_batch)))
            loss = engine.eval_batch(iter([(ids, ids)]), num_micro_batches=1)
            result = {"ids": ids, "loss": float(loss), "step": step}
        else:
            ids = torch.from_numpy(split.get(np.arange(2)))
            with torch.no_grad():
                result = {"ids": ids, "logits": engine(input_ids=ids).logits.float(), "step": step}
        if dist.is_rank0():
            torch.save(result, out / f"{run_dir.name}.pt")
        dist.barrier()
        engine.destroy()
        del engine
    dist.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["--engine-logits"]:
    _engine_logits(Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
