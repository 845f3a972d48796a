"""Export parity: 2-rank CPU training under ZeRO 0-3 (``train.py`` via torchrun), export, then the HF model's
fp32 logits equal the DeepSpeed engine's on the same batch to 1e-5, ``generate`` runs, the exported
tokenizer round-trips, bad requests are refused, and ``eval.py run_dir=`` scores a run.

The engine side runs once for all four checkpoints: this file doubles as the torchrun worker
(``python tests/test_export.py --engine-logits OUT RUN...``), which rebuilds each run's engine from its
config.yaml, loads the checkpoint and saves its logits (on the ranks it trained on).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import launch
from ultrascale.runtime.device import to_device

STAGES = (0, 1, 2, 3)
ROOT = Path(__file__).resolve().parents[1]


def _torchrun(args: list[str], log: Path, nproc: int = 2) -> None:
    """``torchrun --nproc_per_node NPROC SCRIPT ARGS...`` (forked warm, tests/support/warm.py), its output in ``log``."""
    proc = launch(args[1:], nproc=nproc, script=args[0], timeout=900)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args[:3])} failed (rc {proc.returncode}):\n{log.read_text()[-3000:]}")


LAYOUTS = {  # name: (overrides, ranks)
    **{f"zero{s}": ([f"zero=stage{s}"], 2) for s in STAGES},
    "pp2": (["zero=stage1", "parallel=pp2"], 2),
    "tp2": (["zero=stage1", "parallel=tp2"], 2),
    "pp2dp2": (["zero=stage1", "parallel=pp2"], 4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Train 3 steps under each ZeRO stage, pp=2, tp=2 and pp=2 x dp=2 on shared prepared data; then collect
    each engine's logits (or, for the pipeline engine, its loss) on its own number of ranks."""
    root = tmp_path_factory.mktemp("export")
    data = root / "data"
    from data_prep.api import prepare

    prepare(str(data), max_files=80)  # only the built-in corpus is prepared by train.py itself
    run_dirs = {}
    for name, (layout, nproc) in LAYOUTS.items():
        run_dir = root / name
        overrides = [f"output_dir={run_dir}", *layout, f"data.path={data}"]
        overrides += [
            "train.steps=3",
            "train.checkpoint_interval=3",
            "train.eval_interval=0",
            "logger=none",
            "train.compile=false",
        ]
        _torchrun(["train.py", *overrides], root / f"train_{run_dir.name}.log", nproc)
        run_dirs[name] = run_dir
    logits_dir = root / "engine_logits"
    for nproc in sorted({n for _, n in LAYOUTS.values()}):
        dirs = [str(run_dirs[k]) for k, (_, n) in LAYOUTS.items() if n == nproc]
        _torchrun([__file__, "--engine-logits", str(logits_dir), *dirs], root / f"engine{nproc}.log", nproc)
    seq_len = OmegaConf.load(run_dirs["zero2"] / "config.yaml").data.seq_len
    return {"root": root, "data": data, "runs": run_dirs, "logits": logits_dir, "seq_len": seq_len}


@pytest.mark.dist
@pytest.mark.parametrize("stage", STAGES)
def test_export_matches_engine_logits_and_generates(runs, stage):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ultrascale.export import export

    out = runs["root"] / f"hf_zero{stage}"
    stats = export(runs["runs"][f"zero{stage}"], out, max_shard_size="1MB")  # several shards even for a tiny model
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
@pytest.mark.parametrize("name", ["pp2", "pp2dp2"])
def test_pipeline_checkpoint_exports_to_the_same_logits(runs, name):
    """The exported model computes the pipeline engine's logits (its last stage's, ``eval_batch(return_logits=
    True)``) and its loss on the same batch. pp=2 x dp=2 saves each stage once, from its first dp replica."""
    from transformers import AutoModelForCausalLM

    from ultrascale.export import export

    out = runs["root"] / f"hf_{name}"
    stats = export(runs["runs"][name], out)
    ref = torch.load(runs["logits"] / f"{name}.pt")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=ref["ids"], labels=ref["ids"])
    assert stats["tensors"] == len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert ref["step"] == 3
    torch.testing.assert_close(got.logits, ref["logits"], rtol=0, atol=1e-5)
    assert abs(float(got.loss) - ref["loss"]) < 1e-5, (float(got.loss), ref["loss"])


@pytest.mark.dist
def test_tensor_parallel_checkpoint_exports_to_the_same_logits(runs):
    """tp=2: each rank's checkpoint holds its shards; the export puts every sharded tensor together."""
    from transformers import AutoModelForCausalLM

    from ultrascale.export import export

    out = runs["root"] / "hf_tp2"
    export(runs["runs"]["tp2"], out, max_shard_size="1MB")
    ref = torch.load(runs["logits"] / "tp2.pt")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ref["ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
    assert ref["step"] == 3


@pytest.mark.dist
def test_exported_tokenizer_round_trips(runs):
    """The export ships the run's tokenizer: same ids as the prepared dataset's, decodes back to the text,
    and the generation config stops at its EOS."""
    from transformers import AutoTokenizer

    from ultrascale.data.shards import load_manifest
    from ultrascale.export import export

    out = runs["root"] / "hf_tok"
    export(runs["runs"]["zero1"], out)
    original = AutoTokenizer.from_pretrained(str(runs["data"] / load_manifest(runs["data"])["tokenizer"]))
    exported = AutoTokenizer.from_pretrained(str(out))
    text = 'def f(x):\n    """Docstring: ünïcödé, tabs\tand  spaces."""\n    return {"k": x ** 2}  # ok\n'
    ids = exported(text)["input_ids"]
    assert ids == original(text)["input_ids"]
    assert exported.decode(ids) == text
    assert exported.eos_token_id == original.eos_token_id is not None
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == original.eos_token_id


@pytest.mark.dist
def test_export_refuses_bad_requests(runs, tmp_path, capsys):
    """A step that was never saved, an occupied output folder and a misspelt key: one error each, naming the
    step, the folder or the key, and nothing written."""
    from ultrascale.errors import CheckpointError, ConfigError
    from ultrascale.export import export, main

    run = runs["runs"]["zero0"]
    with pytest.raises(CheckpointError, match=r"step=7: .*step_0*7 does not exist \(have: \['step_0*3'\]\)"):
        export(run, tmp_path / "x", step=7)
    assert not (tmp_path / "x").exists()
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"out=.*occupied exists and is not empty: .*overwrite=true"):
        export(run, occupied)
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"] and (occupied / "keep.txt").read_text() == "mine"
    capsys.readouterr()
    assert main([f"run_dir={run}", f"out={tmp_path / 'y'}", "setp=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "setp" in err[0], err
    assert not (tmp_path / "y").exists()


@pytest.mark.dist
def test_eval_py_on_a_run_dir(runs):
    """``eval.py run_dir=`` scores the run's latest checkpoint: its loss on the first validation samples is the
    loss of the logits the DeepSpeed engine computed from that checkpoint on the same samples."""
    run_dir = runs["runs"]["zero2"]
    ref = torch.load(runs["logits"] / "zero2.pt")
    n = ref["ids"].shape[0]
    proc = launch([f"run_dir={run_dir}", "tasks=[perplexity]", f"perplexity.max_samples={n}"], nproc=0,
                  script=str(ROOT / "eval.py"), timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((run_dir / "eval" / "step_00000003" / "eval_results.json").read_text())
    ppl = res["tasks"]["perplexity"]
    assert res["step"] == ref["step"] == 3 and ppl["tokens"] == n * (runs["seq_len"] - 1)
    logits, ids = ref["logits"].float(), ref["ids"]
    engine_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    assert ppl["loss_per_token"] == pytest.approx(float(engine_loss), abs=1e-4), (ppl, float(engine_loss))


def _engine_logits(out: Path, run_dirs: list[Path]) -> None:
    """torchrun worker: each run's engine, rebuilt from its config and checkpoint, scores one batch."""
    from omegaconf import OmegaConf

    from ultrascale.data.shards import open_split
    from ultrascale.levers.deepspeed import build_ds_config
    from ultrascale.levers.rules import validate
    from ultrascale.paths import resolve_path
    from ultrascale.runtime import dist
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
        writer = dist.is_rank0()
        if topo.pp > 1:  # the last stage holds the logits (return_logits) and every stage the broadcast loss
            ids = torch.from_numpy(split.get(np.arange(cfg.data.micro_batch)))
            loss, logits = engine.eval_batch(iter([(ids, ids)]), return_logits=True, num_micro_batches=1)
            writer = engine.is_last_stage() and engine.grid.get_data_parallel_rank() == 0
            result = {"ids": ids, "loss": float(loss), "step": step}
            if writer:
                result["logits"] = logits.float()
        else:
            ids = torch.from_numpy(split.get(np.arange(2)))
            with torch.no_grad():
                logits = engine(input_ids=to_device(ids, engine.device)).logits.float().cpu()
            if topo.tp > 1:  # AutoTP's head is vocab-parallel: each tp rank holds its slice of the vocabulary
                import torch.distributed as tdist

                parts = [torch.empty_like(logits) for _ in range(topo.tp)]
                tdist.all_gather(parts, logits)  # world = tp here (dp = 1)
                logits = torch.cat(parts, dim=-1)
            result = {"ids": ids, "logits": logits, "step": step}
        if writer:
            torch.save(result, out / f"{run_dir.name}.pt")
        dist.barrier()
        engine.destroy()
        del engine
    dist.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["--engine-logits"]:
    _engine_logits(Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
