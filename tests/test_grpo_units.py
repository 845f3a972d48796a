"""GRPO's refusals and its rewards, without ranks: each refusal is one line naming the key, the value and the fix;
the execution reward never raises and counts how each program ended; the sampler's log-probs are those of the
distribution it sampled from."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SMOLLM2, needs, sandbox_missing
from ultrascale.config.compose import compose
from ultrascale.errors import ConfigError
from ultrascale.levers.rules import validate
from ultrascale.train.grpo import rewards as R

RECIPE = ["recipe=smollm2_135m_grpo", f"model.pretrained_path={SMOLLM2}"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["grpo.prompts_per_step=3", "data.global_batch=24"], "grpo.prompts_per_step=3 must be a multiple"),
        (["data.global_batch=16"], "data.global_batch=16 must be grpo.prompts_per_step x grpo.num_generations = 32"),
        (["stability=default"], "grpo needs stability.spike=none (got skip)"),
        (["train.eval_interval=5"], "train.eval_interval=5 evaluates held-out data"),
        (["grpo.reward_weights=[1.0,2.0]"], "grpo.reward_weights has 2 weights for 1"),
        (["finetune=none", "parallel.tp=2"], "grpo needs parallel.pp=tp=sp=1"),
    ],
)
def test_a_config_grpo_cannot_run_is_refused_in_one_line(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate(compose([*RECIPE, *overrides]), 2)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_recipe_validates_and_a_bad_reward_path_is_named() -> None:
    d = validate(compose(RECIPE), 2)
    assert d.zero_stage == 2 and d.finetune.on
    g = compose([*RECIPE, "grpo.reward_funcs=[nowhere.at_all]"]).grpo
    with pytest.raises(ConfigError, match=r"grpo.reward_funcs: 'nowhere.at_all' does not import"):
        R.load(g.reward_funcs, g)


def test_without_root_or_cap_sys_admin_the_execution_reward_is_refused_before_any_model(monkeypatch) -> None:
    monkeypatch.setattr(R.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(R, "_has_cap_sys_admin", lambda: False)
    with pytest.raises(ConfigError) as e:
        R.require_sandbox(["execution"])
    msg = str(e.value)
    assert "needs root or CAP_SYS_ADMIN" in msg and "uid 1000" in msg and "--cap-add SYS_ADMIN" in msg
    R.require_sandbox(["format"])  # no sandbox needed: nothing to refuse


@needs(sandbox_missing())
def test_timeouts_crashes_and_a_raising_reward_function_score_without_raising() -> None:
    ex = R.ExecutionReward(timeout_s=1.0, workers=2)
    prompt = "def f(x):\n"
    tests = {"ok": "def check(c):\n    assert c(2) == 4\n", "sleep": "def check(c):\n    import time\n    time.sleep(30)\n",
             "kill": "def check(c):\n    import os\n    os.kill(os.getpid(), 9)\n"}  # fmt: skip

    def boom(prompts, completions, **kw):
        raise RuntimeError("planted")

    rewards, per_fn, counts = R.score([ex, boom], [1.0, 1.0], [prompt] * 4,
                                      ["    return 2 * x\n", "    return x\n", "    return x\n", "    return x\n"],
                                      {"tests": [tests["ok"], tests["ok"], tests["sleep"], tests["kill"]],
                                       "entry_point": ["f"] * 4, "completion_ids": [[1]] * 4})  # fmt: skip
    assert rewards == [1.0, 0.0, 0.0, 0.0] and per_fn[0] == rewards
    assert counts["passed"] == 1 and counts["failed"] == 1 and counts["timeout"] == 1 and counts["crashed"] == 1
    assert counts["reward_error"] == 4


def test_sampler_logprobs_are_those_of_the_tempered_distribution(tmp_path) -> None:
    """Against a plain forward: the log-prob of each sampled id under logits / temperature, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.test_grpo_loss import FIXTURE  # noqa: F401 - same tiny shapes as the parity fixture
    from ultrascale.generate import Sampler, SamplingParams
    from ultrascale.train.grpo.batch import completion_logps, pack

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=1)).eval()  # fmt: skip

    class Tok:  # ids in, ids out: the sampler needs encode/decode only
        eos_token_id, pad_token_id = 1, 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [int(t) for t in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(i) for i in ids)

    sampler = Sampler(model, Tok(), batch_size=4, draft=0)
    out = sampler.generate(["5 6 7", "9 10"], SamplingParams(n=3, temperature=0.7, top_k=20, max_new_tokens=6,
                                                              seed=3, logprobs=True))  # fmt: skip
    comps = [c for cs in out for c in cs]
    prompts = [[5, 6, 7]] * 3 + [[9, 10]] * 3
    p = pack(prompts, [list(c.ids) for c in comps], pad=0)
    want, _ = completion_logps(lambda **kw: model(**kw).logits, p, 0.7)
    got = torch.tensor([lp for c in comps for lp in c.logps])
    assert len(got) == len(want) and torch.allclose(got, want.detach(), atol=1e-4)


@needs(sandbox_missing())
def test_the_pool_keeps_the_problems_whose_pass_rate_is_strictly_between_0_and_1(tmp_path, smollm2_135m) -> None:
    """A random tiny model on three planted problems: one passes whatever is written, one never passes, one passes
    when the text the model wrote (a raw string literal's body) has an even length: only that one is kept, with
    its pass rate, and the report says the pool is below the minimum."""
    import json
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from ultrascale.train.grpo import pool

    model = tmp_path / "tiny"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(model)  # fmt: skip
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_135m / f, model / f)

    def planted(name: str, body: str) -> dict:
        return {"task_id": f"planted/{name}", "prompt": f'def {name}(a):\n    """Return a."""\n    note = r"""',
                "entry_point": name, "tests": f'"""\n    return a\n\n\ndef check(candidate):\n{body}'}  # fmt: skip

    even = ("    notes = [c for c in candidate.__code__.co_consts if isinstance(c, str) and c != 'Return a.']\n"
            "    assert len(notes[0]) % 2 == 0\n")  # fmt: skip
    src = tmp_path / "problems.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in (
        planted("same", "    assert candidate(3) == 3\n"), planted("never", "    assert candidate(3) == 4\n"),
        planted("even", even))))  # fmt: skip
    out = tmp_path / "not_yet" / "pool.jsonl"  # the tool makes its directory (before sampling, not after)
    got = pool.main(["--model", str(model), "--out", str(out), "--source", "jsonl", "--jsonl", str(src),
                     "--samples", "8", "--max-new-tokens", "12", "--timeout", "5"])  # fmt: skip
    kept = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [p["task_id"] for p in kept] == ["planted/even"] and 0 < kept[0]["pass_rate"] < 1
    assert got["always_pass"] == 1 and got["always_fail"] == 1 and got["kept"] == 1 < got["min_pool"]
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["kept"] == 1 and report["pass_rates"]["planted/same"] == 1.0


def test_problems_task_ids_keep_a_measured_pool_of_the_split_and_refuse_an_id_outside_it() -> None:
    """The pool tool's HumanEval pool trains by id (a JSONL of HumanEval problems would be decontaminated away)."""
    from ultrascale.eval.problems import build

    cfg = compose([*RECIPE, "problems.task_ids=[HumanEval/7,HumanEval/29]"]).problems
    problems, report = build(cfg)
    assert [p["task_id"] for p in problems] == ["HumanEval/7", "HumanEval/29"] and report["kept"] == 2
    test_half = compose([*RECIPE, "problems.split=test"]).problems
    outside = next(p["task_id"] for p in build(test_half)[0])
    with pytest.raises(ConfigError, match=r"problems\.task_ids: \['" + outside + r"'\] are not in"):
        build(compose([*RECIPE, f"problems.task_ids=[{outside}]"]).problems)
