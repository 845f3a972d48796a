"""Perplexity against a direct computation, HumanEval plumbing on real problems, and the eval.py entry point.

Everything is real: a BPE tokenizer trained here on this Python's own sources, a tiny Llama built from
config, shards written in the project's format, completions executed in the real sandbox.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import needs, run_py, sandbox_missing, tool_missing
from ultrascale.config.compose import compose
from ultrascale.data.shards import write_samples
from ultrascale.errors import ConfigError
from ultrascale.eval.config import check, register_eval_configs
from ultrascale.eval.humaneval import check_program, generate, load_problems, truncate
from ultrascale.eval.perplexity import perplexity
from ultrascale.eval.sandbox import run_many
from ultrascale.paths import PROJECT_ROOT

SEQ = 64


needs_sandbox = needs(sandbox_missing())


def make_tokenizer(out: Path, vocab: int = 512):
    """A byte-level BPE trained on stdlib sources: real code text, no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in files], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast, [f.read_text(errors="replace") for f in files]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model_dir, data_dir, model, tokenizer): a tiny Llama saved as an HF dir, and packed shards."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("tiny")
    data = root / "data"
    tok, texts = make_tokenizer(data / "tokenizer")
    ids = np.concatenate([np.asarray(tok(t)["input_ids"] + [tok.eos_token_id]) for t in texts])
    samples = ids[: (len(ids) // SEQ) * SEQ].reshape(-1, SEQ)
    write_samples(
        data,
        {"train": [samples[10:]], "validation": [samples[:10]]},
        seq_len=SEQ,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        tokenizer="tokenizer",
    )
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir, data, model.eval(), tok


def test_perplexity_equals_direct_computation(tiny):
    _, data, model, _ = tiny
    got = perplexity(model, data, batch_size=3)  # 10 samples: batches of 3, 3, 3, 1
    from ultrascale.data.shards import open_split

    ids = torch.from_numpy(open_split(data, "validation").get(np.arange(10)))
    total, count = 0.0, 0
    with torch.no_grad():
        for row in ids:  # one sample at a time, log-softmax by hand, float64 accumulation
            logp = torch.log_softmax(model(input_ids=row[None]).logits[0].double(), dim=-1)
            for t in range(SEQ - 1):
                total -= float(logp[t, row[t + 1]])
                count += 1
    assert got["tokens"] == count == 10 * (SEQ - 1)
    assert got["loss_per_token"] == pytest.approx(total / count, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    # an untrained model is close to uniform over the vocab: a sanity bound that a wrong shift would break
    assert abs(got["loss_per_token"] - math.log(model.config.vocab_size)) < 0.5


def test_perplexity_shards_sum_to_the_whole(tiny):
    _, data, model, _ = tiny
    whole = perplexity(model, data, batch_size=4)
    parts = [perplexity(model, data, batch_size=4, shard=(r, 2)) for r in range(2)]
    assert sum(p["tokens"] for p in parts) == whole["tokens"]
    assert sum(p["loss_sum"] for p in parts) == pytest.approx(whole["loss_sum"], rel=1e-6)


def test_truncate_at_stop_sequences():
    body = "    return x + 1\n"
    assert truncate(body + "\ndef other():\n    pass") == body
    assert truncate(body + "\nprint(f(2))") == body
    assert truncate(body + "\n# trailing comment\n") == body
    assert truncate(body) == body


@needs_sandbox
def test_canonical_solutions_pass_and_wrong_ones_fail():
    problems = load_problems(limit=6)
    assert [p["task_id"] for p in problems] == [f"HumanEval/{i}" for i in range(6)]
    good = [check_program(p, p["canonical_solution"]) for p in problems]
    bad = [check_program(p, "    return None\n") for p in problems]
    outcomes = run_many(good + bad, workers=2)
    assert [o.passed for o in outcomes] == [True] * 6 + [False] * 6


def test_generate_greedy_and_sampled(tiny):
    _, _, model, tok = tiny
    prompts = [p["prompt"] for p in load_problems(limit=2)]
    greedy = generate(model, tok, prompts, max_new_tokens=12, batch_size=2)
    assert len(greedy) == 2 and all(len(c) == 1 for c in greedy)
    assert greedy == generate(model, tok, prompts, max_new_tokens=12, batch_size=1)  # batching (left pad) is exact
    sampled = generate(model, tok, prompts, n_samples=3, temperature=1.0, max_new_tokens=12, seed=1)
    assert all(len(c) == 3 for c in sampled)
    assert sampled == generate(model, tok, prompts, n_samples=3, temperature=1.0, max_new_tokens=12, seed=1)


def _eval_cfg(overrides):
    register_eval_configs()
    return compose(overrides, config_name="eval")


def test_eval_config_typos_and_bad_combinations_fail_with_the_key():
    with pytest.raises(ConfigError, match=r"humaneval\.limt"):
        _eval_cfg(["model_dir=x", "humaneval.limt=3"])
    with pytest.raises(ConfigError, match="exactly one of run_dir"):
        check(_eval_cfg([]))
    with pytest.raises(ConfigError, match="n_samples"):
        check(_eval_cfg(["model_dir=x", "humaneval.k=[1,10]", "humaneval.n_samples=5", "humaneval.temperature=0.8"]))
    with pytest.raises(ConfigError, match=r"tasks.*'mmlu' is not one of \[perplexity, humaneval, fim, infill\]"):
        check(_eval_cfg(["model_dir=x", "tasks=[mmlu]"]))
    with pytest.raises(ConfigError, match=r"dtype='fp8' is not one of \[fp32, bf16, fp16\]"):
        _eval_cfg(["model_dir=x", "dtype=fp8"])


@needs_sandbox
def test_eval_py_end_to_end_on_a_model_dir(tiny, tmp_path):
    model_dir, data, _, _ = tiny
    out = tmp_path / "eval_out"
    cmd = [sys.executable, str(PROJECT_ROOT / "eval.py"), f"model_dir={model_dir}", f"perplexity.data_path={data}"]
    cmd += ["humaneval.limit=2", "humaneval.max_new_tokens=16", f"output_dir={out}", "wandb=false"]
    proc = run_py(cmd[1:], timeout=600, cwd=PROJECT_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "eval_results.json").read_text())
    assert res["tasks"]["perplexity"]["tokens"] == 10 * (SEQ - 1)
    assert res["tasks"]["humaneval"]["problems"] == 2 and 0.0 <= res["tasks"]["humaneval"]["pass@1"] <= 1.0
    assert len((out / "humaneval_samples.jsonl").read_text().splitlines()) == 2
    assert "pass@1" in proc.stdout and "perplexity" in proc.stdout
    bad = subprocess.run([*cmd[:2], "model_dir=/nonexistent"], capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "model_dir" in bad.stderr


def _without_namespaces(cmd: list[str]) -> list[str]:
    """``cmd`` where the kernel refuses namespaces: root minus CAP_SYS_ADMIN (a non-root user already is)."""
    return ["setpriv", "--bounding-set=-sys_admin", *cmd] if os.geteuid() == 0 else cmd


@needs(tool_missing("setpriv", "to drop CAP_SYS_ADMIN") if os.geteuid() == 0 else "")
def test_where_namespaces_are_denied_humaneval_refuses_in_one_line_and_runs_nothing(tiny, tmp_path):
    marker = tmp_path / "ran_unsandboxed"
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from ultrascale.eval.sandbox import SandboxUnavailable, run_program\n"
        "try:\n    run_program(f'open({sys.argv[2]!r}, \"w\").write(\"x\")')\n    print('ran')\n"
        "except SandboxUnavailable as e:\n    print('refused:', e)\n"
    )
    api = subprocess.run(_without_namespaces([sys.executable, "-c", probe, str(PROJECT_ROOT), str(marker)]),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert api.returncode == 0, api.stderr[-2000:]
    assert api.stdout.startswith("refused: cannot sandbox generated code") and not marker.exists()
    model_dir = tiny[0]
    out = tmp_path / "eval_out"
    cmd = [sys.executable, str(PROJECT_ROOT / "eval.py"), f"model_dir={model_dir}", "tasks=[humaneval]",
           "humaneval.limit=1", f"output_dir={out}", "wandb=false"]  # fmt: skip
    proc = subprocess.run(_without_namespaces(cmd), capture_output=True, text=True, timeout=300, cwd=PROJECT_ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: cannot sandbox generated code") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (out / "humaneval_samples.jsonl").exists() and not (out / "eval_results.json").exists()


def _reduce_worker(rank: int, port: int, model_dir: str, data: str, out: str) -> None:
    import torch.distributed as tdist
    from transformers import AutoModelForCausalLM

    from ultrascale.eval.perplexity import reduce_across_ranks

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    got = reduce_across_ranks(perplexity(model, data, batch_size=4, shard=(rank, 2)))
    torch.save(got, f"{out}/rank{rank}.pt")
    tdist.destroy_process_group()


@pytest.mark.dist
def test_sharded_perplexity_reduces_to_the_single_rank_value(tiny, tmp_path):
    import socket

    import torch.multiprocessing as mp

    model_dir, data, model, _ = tiny
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_reduce_worker, args=(port, str(model_dir), str(data), str(tmp_path)), nprocs=2, join=True)
    whole = perplexity(model, data, batch_size=4)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["tokens"] == whole["tokens"] and got["samples"] == whole["samples"]
        assert got["loss_per_token"] == pytest.approx(whole["loss_per_token"], rel=1e-6)
