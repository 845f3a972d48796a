"""The sampler (``ultrascale/generate/``) against HF: the same greedy tokens as ``model.generate`` whatever the
batching does (refills, compaction, padding), on the dynamic path and on the static cache (the path CUDA graphs
replay, run eagerly here), sampling processed in HF's order and drawn on the device, per-row stopping, one
prefill per prompt for its n samples, and every generating path going through it."""

from __future__ import annotations

import pytest
import torch

from tests.test_eval import make_tokenizer
from ultrascale.generate import Sampler, SamplingParams
from ultrascale.generate.draft import lookup
from ultrascale.generate.sampling import process_logits, sample_tokens
from ultrascale.generate.static_cache import bucket
from ultrascale.levers.decide import decide_static

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


REFILLS_AND_COMPACTIONS = {1: (False, False), 3: (True, True), 32: (False, True)}
"""At 1 row a row finishes before the next prompt comes in; at 3 rows for 7 prompts, prompts are prefilled beside
rows in flight and finished rows are squeezed out; at 32 all 7 prompts start at once and only leave."""

PATHS = [("dynamic", {}), ("static", {"static": "on"}), ("static, host reads every 4 steps", {"static": "on", "sync_every": 4})]  # fmt: skip


@pytest.mark.parametrize("path", PATHS, ids=[p for p, _ in PATHS])
@pytest.mark.parametrize("batch_size", [1, 3, 32])
def test_greedy_tokens_equal_hf_generate_through_refills_and_compaction(tiny, batch_size, path):
    """3 rows in flight for 7 prompts of mixed lengths: rows finish, are compacted out, new prompts are prefilled
    and merged with left padding (dynamic) or loaded into free slots (static); every completion's tokens equal HF
    generate on that prompt alone, and the refills and compactions the test is named for did happen."""
    model, tok = tiny
    # rows stop at different steps (on "ar" or "VE"), some run to the length limit: rows leave the batch while
    # others go on, and the next prompts are merged in beside the ones still running
    params = SamplingParams(max_new_tokens=24, stop=("ar", "VE"))
    sampler = Sampler(model, tok, batch_size=batch_size, **path[1])
    got = sampler.generate(PROMPTS, params)
    st = sampler.stats
    assert sampler.static == (path[0] != "dynamic") and bool(st.buckets) == sampler.static
    assert (st.refills > 0, st.compactions > 0) == REFILLS_AND_COMPACTIONS[batch_size], (st.refills, st.compactions)
    if "every 4" in path[0]:  # the new tokens came back in windows, not once per step
        assert st.host_reads < st.decode_steps
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


STATIC_CASES = [
    ("greedy", SamplingParams(max_new_tokens=40, stop=("VE",)), 3),
    ("sampled", SamplingParams(n=2, temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=16, seed=5, stop=("ar", "VE")), 5),
]  # fmt: skip


@pytest.mark.parametrize("case", STATIC_CASES, ids=[c[0] for c in STATIC_CASES])
def test_the_static_cache_gives_the_dynamic_paths_tokens(tiny, case):
    """The static path (slots, buckets, windows of host reads) against today's path (left-padded merges,
    drafting): the same tokens, texts and finishes, greedy and sampled (the noise is keyed by sample and step,
    so where a row sat and what shared its step do not matter)."""
    model, tok = tiny
    _, params, batch_size = case
    ref = Sampler(model, tok, batch_size=4).generate(PROMPTS, params)
    for kw in ({"sync_every": 1}, {"sync_every": 3}):
        sampler = Sampler(model, tok, batch_size=batch_size, static="on", **kw)
        got = sampler.generate(PROMPTS, params)
        assert [[(c.ids, c.text, c.finish) for c in cs] for cs in got] == [[(c.ids, c.text, c.finish) for c in cs] for cs in ref], kw  # fmt: skip
        st = sampler.stats
        assert st.refills > 0 and st.compactions > 0, (st.refills, st.compactions)
        # rows ran in the bucket above the batch, and after a compaction in a smaller one
        assert max(st.buckets) == bucket(batch_size) and min(st.buckets) < bucket(batch_size), st.buckets


def test_decode_attention_switches_the_implementation_and_puts_it_back(tiny, monkeypatch):
    """While generating, the decoding steps go through ``decode_attn_forward``; afterwards (also after an error,
    and for training's blocked implementation) the model has the implementation it had before: the in-training
    eval generates with the model being trained."""
    import ultrascale.generate.attention as attn
    from ultrascale.model.attention import implementation_name

    model, tok = tiny
    seen = []
    real = attn.decode_attn_forward

    def spy(module, *args, **kw):
        seen.append(module.config._attn_implementation)
        return real(module, *args, **kw)

    monkeypatch.setattr(attn, "decode_attn_forward", spy)
    before = model.config._attn_implementation
    assert before == "sdpa"
    Sampler(model, tok, batch_size=2).generate(PROMPTS[:2], SamplingParams(max_new_tokens=4))
    assert seen and set(seen) == {attn.DECODE_ATTENTION}
    assert model.config._attn_implementation == before
    assert all(m.config._attn_implementation == before for m in model.modules() if hasattr(m, "config"))
    blocked = implementation_name(8)
    model.set_attn_implementation(blocked)
    try:
        Sampler(model, tok, batch_size=2, static="on").generate(PROMPTS[:2], SamplingParams(max_new_tokens=4))
        assert model.config._attn_implementation == blocked

        def boom(*args, **kw):
            assert model.config._attn_implementation == attn.DECODE_ATTENTION
            raise KeyboardInterrupt

        monkeypatch.setattr(Sampler, "_generate", boom)
        with pytest.raises(KeyboardInterrupt):
            Sampler(model, tok).generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))
        assert model.config._attn_implementation == blocked
    finally:
        model.set_attn_implementation(before)


def test_the_gumbel_draw_follows_the_processed_distribution():
    """Argmax of scores + noise is a sample of softmax(scores): 40,000 draws of one row (one step each) land on
    each token at its probability, never on a token top-k/top-p removed; two rows' keys give other draws."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 40_000
    steps = torch.arange(n)
    keys = torch.full((n,), 12345)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.95, n=2)
    picks = sample_tokens(logits.expand(n, -1), params, keys, steps)
    p = process_logits(logits, 0.7, 5, 0.95).softmax(-1)[0]
    freq = torch.bincount(picks, minlength=6).float() / n
    assert p[-2:].sum() == 0 and freq[-2:].sum() == 0  # filtered tokens are never drawn
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 4 * sigma + 1e-9).all(), (freq, p)
    other = sample_tokens(logits.expand(n, -1), params, keys + 1, steps)
    assert (other != picks).float().mean() > 0.3  # another sample's key: another sequence of draws
    again = sample_tokens(logits.expand(n, -1), params, keys, steps)
    assert torch.equal(again, picks)  # a pure function of (key, step)


HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default",
              "aten.is_nonzero.default", "aten.equal.default", "aten.masked_select.default"}  # fmt: skip
"""Ops that read a device value back to the host: each stalls a GPU's step, and none can be captured in a graph."""
HOST_DATA = "host data"
"""A tensor built from host data (``torch.tensor([...])``): a copy a captured graph would not repeat."""


def _ops_in(fn) -> set[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            if str(func) == "aten.lift_fresh.default" and args[0].dim() > 0:  # a 0-d one is a Python scalar
                self.ops.add(HOST_DATA)
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        fn()
    return rec.ops


def test_a_sampled_step_reads_nothing_back_to_the_host(tiny):
    """Drawing the next tokens of a batch (temperature, top-k, top-p, the draw) reads nothing back per row (the
    dynamic path hands the rows' keys and steps in; the static path keeps them on the device, next test)."""
    model, tok = tiny
    sampler = Sampler(model, tok)
    from ultrascale.generate.rows import Row
    from ultrascale.generate.sampling import pick_tokens, row_key

    rows = [Row(0, s, row_key(1, 0, s), tokens=[1] * s) for s in range(4)]
    logits = torch.randn(4, len(tok))
    params = SamplingParams(n=4, temperature=0.8, top_k=20, top_p=0.9)
    ops = _ops_in(lambda: pick_tokens(logits, rows, params, sampler.pad))
    assert "aten.argmax.default" in ops and not ops & HOST_READS, ops & HOST_READS


def test_the_static_step_is_capturable_no_host_value_enters_or_leaves(tiny):
    """What a CUDA graph would hold (the static step over the full width, then the draw) reads no device value
    back and builds no tensor from host data: CPU stands in for the capture CI cannot run."""
    from ultrascale.generate.attention import decode_attention

    model, tok = tiny
    sampler = Sampler(model, tok, batch_size=4, static="on")
    sampler.generate(PROMPTS[:4], SamplingParams(max_new_tokens=6))
    slots = sampler.static_decoder.slots
    params = SamplingParams(n=4, temperature=0.8, top_k=20, top_p=0.9)

    def step():
        logits = slots.forward(sampler.lm.base, sampler.lm.head_logits, 4, slots.width)
        sample_tokens(logits, params, slots.keys[:4], slots.steps[:4])

    with torch.no_grad(), decode_attention(model):
        ops = _ops_in(step)
    assert "aten.index_put_.default" in ops and not ops & {*HOST_READS, HOST_DATA}, ops & {*HOST_READS, HOST_DATA}


def test_static_decisions_and_buckets():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decide_static(cuda, "auto", True, True)[:2] == (True, True)
    assert decide_static(cpu, "auto", True, True)[:2] == (False, False)  # nothing to capture on a CPU
    assert decide_static(cpu, "on", True, True)[:2] == (True, False)
    assert decide_static(cuda, "eager", True, True)[:2] == (True, False)
    assert decide_static(cuda, "off", True, True)[:2] == (False, False)
    assert decide_static(cuda, "auto", False, True)[:2] == (False, False)  # no plain head: the model's own forward
    assert decide_static(cuda, "auto", True, False)[:2] == (False, False)  # eager attention: a bool mask is no bias
    with pytest.raises(ValueError, match="static='yes'"):
        decide_static(cpu, "yes", True, True)
    assert [bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_eager_tokens(tiny):
    """On a GPU: the captured steps (one graph per bucket) give the dynamic path's greedy tokens."""
    model, tok = tiny
    model = model.cuda()
    try:
        params = SamplingParams(max_new_tokens=24, stop=("ar", "VE"))
        ref = Sampler(model, tok, batch_size=3, static="off").generate(PROMPTS, params)
        sampler = Sampler(model, tok, batch_size=3)
        got = sampler.generate(PROMPTS, params)
        assert sampler.graphs and sampler.stats.graphs > 0, sampler.static_why
        assert [c.ids for (c,) in got] == [c.ids for (c,) in ref]
    finally:
        model.cpu()


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
    assert lookup(prompt, [5, 6], k=3) == [1, 2, 5]  # the 2-gram (5, 6) last occurred at 5..6: 1, 2, then 5, 6
    assert lookup(prompt, [7, 8], k=2) == [9, 5]  # a 3-gram (6, 7, 8) has no earlier match; (7, 8) does
    assert lookup(prompt, [42], k=4) == []  # never seen: no draft
    assert lookup([], [3, 3, 3], k=2) == [3]  # only what exists is copied


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
    from ultrascale.eval import humaneval
    from ultrascale.ssd.sample import generate_all

    model, tok = tiny
    calls = []
    real = Sampler.generate

    def spy(self, prompts, params, progress=False, extra_stops=None):
        calls.append(params)
        return real(self, prompts, params, progress, extra_stops)

    monkeypatch.setattr(Sampler, "generate", spy)
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
    from ultrascale.ssd.config import SampleConfig

    cfg = SampleConfig(n=3, temperature=0.8, top_p=0.95, top_k=0, max_new_tokens=8, batch_size=4, seed=3, extra_stops=[],
                       heal_newline=True)  # fmt: skip
    out, _ = generate_all(tmp_path / "m", [{"prompt": p} for p in PROMPTS[:2]], cfg)
    assert len(out) == 2 and all(len(c) == 3 for c in out)
    assert calls[-1].n == 3 and calls[-1].temperature == 0.8 and calls[-1].top_p == 0.95


class _Out:
    passed, status, returncode, error = False, "failed", 1, ""


def test_a_reused_static_cache_gives_the_same_tokens(tiny):
    """The static cache (and on a GPU its graphs) is kept across ``generate`` calls when it is large enough, and
    nothing of the last call leaks into the next: the same tokens, and the same columns attended as a fresh one."""
    model, tok = tiny
    sampler = Sampler(model, tok, batch_size=3, static="on")
    params = SamplingParams(max_new_tokens=24, stop=("ar", "VE"))
    first = sampler.generate(PROMPTS, params)
    slots = sampler.static_decoder.slots
    again = sampler.generate(PROMPTS[::-1], params)
    assert sampler.static_decoder.slots is slots
    assert [c.ids for (c,) in again] == [c.ids for (c,) in first][::-1]
    fresh = Sampler(model, tok, batch_size=3, static="on")
    fresh.generate(PROMPTS[::-1], params)
    assert sampler.stats.cache_cells == fresh.stats.cache_cells
