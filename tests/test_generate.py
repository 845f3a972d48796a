"""The sampler (``ultrascale/generate.py``) against HF: the same greedy tokens as ``model.generate`` whatever the
batching does (refills, compaction, padding), sampling processed in HF's order, per-row stopping, one prefill
per prompt for its n samples, and every generating path going through it."""

from __future__ import annotations

import pytest
import torch

from tests.test_eval import make_tokenizer
from ultrascale.generate import Sampler, SamplingParams, _lookup, process_logits

PROMPTS = [
    "def add(a, b):\n",
    "import os\n\nclass Path:\n    def __init__(self, name):\n        self.name = name\n",
    "x = [",
    "def fib(n):\n    if n < 2:\n        return n\n",
    "for i in range(10):\n    print(i",
    "# a comment\nimport sys\nimport re\n\ndef main(argv):\n    pattern = re.compile(",
    "while True:\n",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok, _ = make_tokenizer(tmp_path_factory.mktemp("tok"))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      initializer_range=0.2)  # fmt: skip
    # a 10x wider init than HF's: attention, not the residual stream's current token, decides the next token, so a
    # mask, position or cache row out of place changes the output (at 0.02 the model repeats its last token)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval(), tok


def _hf_greedy(model, tok, prompt: str, max_new: int) -> tuple[list[int], list[float]]:
    """HF generate on one prompt alone (no padding): its tokens and each step's top-2 logit gap."""
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id,
                         return_dict_in_generate=True, output_scores=True)  # fmt: skip
    ids = out.sequences[0, enc["input_ids"].shape[1] :].tolist()
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return ids, gaps


@pytest.mark.parametrize("batch_size", [1, 3, 32])
def test_greedy_tokens_equal_hf_generate_through_refills_and_compaction(tiny, batch_size):
    """3 rows in flight for 7 prompts of mixed lengths: rows finish, are compacted out, new prompts are prefilled
    and merged with left padding; every completion's tokens equal HF generate on that prompt alone."""
    model, tok = tiny
    # rows stop at different steps (on "ar" or "VE"), some run to the length limit: rows leave the batch while
    # others go on, and the next prompts are merged in beside the ones still running
    params = SamplingParams(max_new_tokens=24, stop=("ar", "VE"))
    got = Sampler(model, tok, batch_size=batch_size).generate(PROMPTS, params)
    assert {c.finish for (c,) in got} == {"stop", "length"}
    for prompt, (c,) in zip(PROMPTS, got):
        ref, gaps = _hf_greedy(model, tok, prompt, 24)
        eos = next((i for i, t in enumerate(ref) if t == tok.eos_token_id), None)
        ref = ref[: eos + 1] if eos is not None else ref
        first = next((i for i, (a, b) in enumerate(zip(c.ids, ref)) if a != b), None)
        assert first is None or gaps[first] < 1e-4, (prompt, first, c.ids, ref)  # only a near-tie may differ
        if first is None:
            assert list(c.ids) == ref[: len(c.ids)]
            full = tok.decode(ref[:-1] if eos is not None else ref, skip_special_tokens=True)
            if c.finish == "stop":
                assert c.text == full[: min(i for i in (full.find("ar"), full.find("VE")) if i >= 0)]
            else:
                assert list(c.ids) == ref and c.finish == ("eos" if eos is not None else "length") and c.text == full


def test_prompt_lookup_drafts_are_verified_so_greedy_output_does_not_change(tiny):
    """Drafting on (the default) and off give the same tokens; drafts were proposed and some accepted, so the
    verify-forward, the holes left by rejected drafts and their compaction were all exercised."""
    model, tok = tiny
    params = SamplingParams(max_new_tokens=48, stop=("VE",))
    plain = Sampler(model, tok, batch_size=4, draft=0)
    off = plain.generate(PROMPTS, params)
    drafting = Sampler(model, tok, batch_size=4, draft=8)
    on = drafting.generate(PROMPTS, params)
    assert [c.ids for (c,) in on] == [c.ids for (c,) in off]
    assert [(c.text, c.finish) for (c,) in on] == [(c.text, c.finish) for (c,) in off]
    st = drafting.stats
    assert 0 < st.accepted < st.drafted  # some drafts kept, some rejected (holes)
    assert st.decode_steps < plain.stats.decode_steps  # accepted drafts are tokens without a step of their own


def test_the_draft_is_what_followed_the_last_ngram_most_recently():
    prompt = [5, 6, 7, 8, 9, 5, 6, 1, 2]
    assert _lookup(prompt, [5, 6], k=3) == [1, 2, 5]  # the 2-gram (5, 6) last occurred at 5..6: 1, 2, then 5, 6
    assert _lookup(prompt, [7, 8], k=2) == [9, 5]  # a 3-gram (6, 7, 8) has no earlier match; (7, 8) does
    assert _lookup(prompt, [42], k=4) == []  # never seen: no draft
    assert _lookup([], [3, 3, 3], k=2) == [3]  # only what exists is copied


def test_sampling_applies_temperature_then_top_k_then_top_p_as_hf_does():
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(6, 200) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.3, 20, 1.0), (0.8, 0, 0.9), (1.6, 20, 0.8), (0.5, 5, 0.5), (2.0, 50, 0.95)]:
        hf = LogitsProcessorList([TemperatureLogitsWarper(t)]
                                 + ([TopKLogitsWarper(k)] if k else []) + ([TopPLogitsWarper(p)] if p < 1 else []))  # fmt: skip
        assert torch.equal(process_logits(logits, t, k, p), hf(None, logits.clone())), (t, k, p)
    # the order is not a detail: top-p before the temperature keeps another set of tokens
    hf_other = LogitsProcessorList([TopPLogitsWarper(0.8), TemperatureLogitsWarper(1.6)])(None, logits.clone())
    assert not torch.equal(torch.isinf(process_logits(logits, 1.6, 0, 0.8)), torch.isinf(hf_other))


def test_a_row_that_hits_a_stop_sequence_stops_and_the_others_go_on(tiny):
    model, tok = tiny
    prompts = PROMPTS[:3]
    free = Sampler(model, tok, batch_size=8).generate(prompts, SamplingParams(max_new_tokens=20))
    text = free[0][0].text
    assert len(text) > 6 and free[1][0].finish == "length"
    others = free[1][0].text + "\x00" + free[2][0].text
    # a string row 0 writes after its first tokens, and the other rows never write
    stop = next(text[i : i + 3] for i in range(3, len(text) - 2) if text[i : i + 3] not in others)
    got = Sampler(model, tok, batch_size=8).generate(prompts, SamplingParams(max_new_tokens=20, stop=(stop,)))
    assert got[0][0].finish == "stop" and got[0][0].text == text[: text.index(stop)]
    assert got[0][0].tokens < free[0][0].tokens  # it stopped generating, not just cut the text
    for p in (1, 2):  # the other rows generated their full completions
        assert got[p][0].text == free[p][0].text and got[p][0].finish == free[p][0].finish
    # a stop for one prompt only (a method's end): the same cut for it, nothing for the others
    own = Sampler(model, tok, batch_size=8).generate(prompts, SamplingParams(max_new_tokens=20),
                                                     extra_stops=[(stop,), (), ()])  # fmt: skip
    assert [(c.text, c.finish) for (c,) in own] == [(c.text, c.finish) for (c,) in got]


def test_the_samples_of_a_prompt_share_one_prefill_and_still_differ(tiny):
    model, tok = tiny
    sampler = Sampler(model, tok, batch_size=16)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=7)
    got = sampler.generate(PROMPTS[:3], params)
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS[:3]]
    assert sampler.stats.prefill_tokens == 3 * max(lengths)  # one left-padded row per prompt, not per sample
    for cs in got:
        assert len(cs) == 4 and len({c.ids for c in cs}) > 1  # T > 0: the samples differ
    # a sample depends on (seed, prompt, sample), not on what shared its batch
    again = Sampler(model, tok, batch_size=5).generate(PROMPTS[:3], params)
    assert [[c.ids for c in cs] for cs in again] == [[c.ids for c in cs] for cs in got]


def test_in_training_humaneval_and_ssd_sampling_generate_through_the_sampler(tiny, monkeypatch, tmp_path):
    """Both callers end in Sampler.generate (spied on), with their own settings."""
    import ultrascale.generate as gen
    from ultrascale.eval import humaneval
    from ultrascale.ssd.sample import generate_all

    model, tok = tiny
    calls = []
    real = gen.Sampler.generate

    def spy(self, prompts, params, progress=False, extra_stops=None):
        calls.append(params)
        return real(self, prompts, params, progress, extra_stops)

    monkeypatch.setattr(gen.Sampler, "generate", spy)
    monkeypatch.setattr(humaneval, "check_available", lambda: None)
    monkeypatch.setattr(humaneval, "run_many", lambda programs, limits, workers: [_Out() for _ in programs])
    # the in-training evaluator, on the engine's module (a stand-in trainer with just what it reads)
    from types import SimpleNamespace

    from ultrascale.train.evaluate import Evaluator

    trainer = SimpleNamespace(engine=SimpleNamespace(module=model), decisions=SimpleNamespace(compile=SimpleNamespace(on=False)),
                              cfg=SimpleNamespace(train=SimpleNamespace(eval_humaneval_max_new_tokens=8)))  # fmt: skip
    res = Evaluator(trainer, 1, 2, tok, tmp_path)._humaneval(1)
    assert res["humaneval_problems"] == 2 and calls[-1].greedy and calls[-1].stop == humaneval.STOP_SEQUENCES
    assert (tmp_path / "humaneval" / "step_00000001.jsonl").exists()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"n": 3, "temperature": 0.8, "top_p": 0.95, "max_new_tokens": 8, "batch_size": 4,
                            "seed": 3, "extra_stops": [], "heal_newline": True})  # fmt: skip
    out, _ = generate_all(tmp_path / "m", [{"prompt": p} for p in PROMPTS[:2]], cfg)
    assert len(out) == 2 and all(len(c) == 3 for c in out)
    assert calls[-1].n == 3 and calls[-1].temperature == 0.8 and calls[-1].top_p == 0.95


class _Out:
    passed, status, returncode, error = False, "failed", 1, ""
