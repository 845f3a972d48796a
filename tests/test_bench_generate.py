"""``bench/bench_generate.py`` compares like with like: one stopping rule (the new text only) and one tokenization
on both sides, a near tie only where our token is HF's second choice, the roofline's prefill counting the head
once per prompt, HF swept over batch sizes and length order, and ``--rounds`` pairing the two sides."""

from __future__ import annotations

import importlib.util
import json
import statistics

import pytest

from tests.conftest import ROOT, run_py
from tests.test_generate import PROMPTS, tiny  # noqa: F401  (the module's tiny model fixture)
from ultrascale.generate import Sampler, SamplingParams


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "bench" / "bench_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_stops_on_the_new_text_only_as_ours_does(tiny, bench):  # noqa: F811
    """A prompt ending in a newline, and a stop sequence that is that newline plus how the completion starts: it
    occurs across the prompt boundary only. HF's own ``stop_strings`` stop there; the bench's HF side, like ours,
    searches the new text and generates the same completion."""
    model, tok = tiny
    prompt = PROMPTS[0]
    assert prompt.endswith("\n")
    free = Sampler(model, tok).generate([prompt], SamplingParams(max_new_tokens=16))[0][0].text
    stop = "\n" + free[:2]
    assert stop not in free and len(free) > 4
    params = SamplingParams(max_new_tokens=16, stop=(stop,))
    ours = bench.run_ours(model, tok, [prompt], params, 4)
    hf = bench.run_hf(model, tok, [prompt], params, 8)
    assert hf["texts"] == ours["texts"] == [[free]] and hf["ids"] == ours["ids"]
    # a stop inside one row's new text stops that row on both sides at the same token, and the padding HF goes on
    # adding to it while the other row generates (here the EOS token) is not counted
    other = Sampler(model, tok).generate([PROMPTS[1]], SamplingParams(max_new_tokens=16))[0][0].text
    inner = next(free[i : i + 2] for i in range(3, len(free) - 1) if free[i : i + 2] not in other)
    two = SamplingParams(max_new_tokens=16, stop=(inner,))
    pair = [prompt, PROMPTS[1]]
    ours, hf = bench.run_ours(model, tok, pair, two, 4), bench.run_hf(model, tok, pair, two, 8)
    assert ours["finish"] == [["stop"], ["length"]] and hf["texts"] == ours["texts"]
    assert hf["ids"] == ours["ids"] and hf["tokens"] == ours["tokens"] and len(ours["ids"][0][0]) < 16
    # what the bench used to run: HF's stop_strings match the prompt's last newline plus the first new tokens
    enc = tok([prompt], return_tensors="pt", add_special_tokens=False)
    old = model.generate(**enc, max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tok,
                         pad_token_id=tok.pad_token_id)  # fmt: skip
    assert old.shape[1] - enc["input_ids"].shape[1] <= 2


def test_both_sides_feed_the_model_the_same_token_ids(tiny, bench, monkeypatch):  # noqa: F811
    """With a tokenizer that adds a BOS by default, HF's side gets exactly the ids the sampler prefills."""
    import copy

    from tokenizers.processors import TemplateProcessing

    model, tok = tiny
    bos = copy.deepcopy(tok)
    bos.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.eos_token} $A", special_tokens=[(tok.eos_token, tok.eos_token_id)]
    )
    assert bos("x = 1")["input_ids"][0] == tok.eos_token_id  # it does add one by default
    fed = []
    real = model.generate

    def spy(input_ids=None, attention_mask=None, **kw):
        fed.extend(row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask))
        return real(input_ids=input_ids, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(model, "generate", spy)
    bench.run_hf(model, bos, PROMPTS[:3], SamplingParams(max_new_tokens=2), 8)
    sampler = Sampler(model, bos)
    assert fed == [sampler.encode(p) for p in PROMPTS[:3]]


def test_a_near_tie_is_our_token_as_hfs_second_choice(bench):
    """HF's top two within NEAR_TIE is not enough: our token must be the second one."""
    ours = {"texts": [["ab"], ["ac"], ["ad"], ["same"]], "ids": [[[1, 2]], [[1, 3]], [[1, 4]], [[9]]]}
    hf = {"texts": [["ax"], ["ax"], ["ax"], ["same"]], "ids": [[[1, 5]]] * 3 + [[[9]]]}
    close, far = 0.1 * bench.NEAR_TIE, 10 * bench.NEAR_TIE
    tops = {0: [((9.0, 1), (8.0, 7)), ((5.0, 5), (5.0 - close, 2))],  # ours = HF's 2nd, close: a near tie
            1: [((9.0, 1), (8.0, 7)), ((5.0, 5), (5.0 - close, 7))],  # ours (3) is not HF's 2nd (7): a divergence
            2: [((9.0, 1), (8.0, 7)), ((5.0, 5), (5.0 - far, 4))]}  # ours = HF's 2nd, but far: a divergence  # fmt: skip
    got = bench.compare_greedy(ours, hf, lambda which: {p: tops[p] for p in which})
    assert (got["identical"], got["near_tie_divergences"], got["other_divergences"]) == (1, 1, 2)
    assert [d["near_tie"] for d in got["divergences"]] == [True, False, False] and not got["identical_greedy"]


def test_the_roofline_counts_the_head_once_per_prompt_in_prefill(tiny, bench):  # noqa: F811
    """Prefill's logits are the last position's only: body FLOPs for every prompt token, head FLOPs per prompt."""
    model, _ = tiny
    body = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    head = model.lm_head.weight.numel()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one matrix, counted as the head
    got = bench.work_flops(model, prompt_tokens=300, prefill_rows=4, generated=50)
    assert got == 2 * (body * (300 + 50) + head * (4 + 50))


def test_hf_batches_sort_by_token_length_and_spread_is_a_median_and_range(tiny, bench):  # noqa: F811
    _, tok = tiny
    prompts = ["a b c d e f g h", "x", "def f(a, b):\n    return a + b", "y = 2"]
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    order = [i for b in bench.hf_order(tok, prompts, 3, sort=True) for i in b]
    assert [lengths[i] for i in order] == sorted(lengths)
    assert bench.hf_order(tok, prompts, 3, sort=False) == [[0, 1, 2], [3]]
    assert bench.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}


def test_the_cli_sweeps_hf_pairs_rounds_and_checks_newline_prompts(tiny, tmp_path):  # noqa: F811
    """The whole bench on the tiny model: HF at every batch size and at its best length-sorted, ``--rounds 2``
    paired rounds, the speedup against HF's best, greedy identity also on prompts ending in a newline."""
    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    out = tmp_path / "r.json"
    run = run_py(["bench/bench_generate.py", "--model", str(tmp_path / "m"), "--limit", "3",
                          "--max-new-tokens", "6", "--hf-batch-sizes", "1,2", "--rounds", "2", "--newline", "2",
                          "--threads", "1", "--json", str(out)], timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert {"hf_b1", "hf_b2", "hf_best", "ours"} <= set(got["tokens_per_s"])
    best = got["hf_best"]["setting"]
    assert best.endswith("_sorted") or best in ("hf_b1", "hf_b2")
    assert f"hf_b{got['hf_best']['batch_size']}_sorted" in got["tokens_per_s"]  # the best batch, length-sorted
    assert got["rounds"]["n"] == 2 and len(got["rounds"]["pairs"]) == 2
    assert got["speedup"] == pytest.approx(statistics.median(o / h for o, h in got["rounds"]["pairs"]))
    assert got["newline_prompts"]["n"] == 2 and got["newline_prompts"]["identical_greedy"]
    assert got["identical_greedy"]
    assert "* HF's best:" in run.stdout and "speedup vs HF's best" in run.stdout


def test_prompts_from_a_file_are_healed_as_humaneval_s_are(bench, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f():\n    '''Doc.'''\n", "x = 1\n\n"]))
    healed, source = bench.load_prompts(5, f)
    assert healed == ["def f():\n    '''Doc.'''", "x = 1"] and "healed" in source
    assert bench.load_prompts(5, f, heal_prompts=False)[0] == ["def f():\n    '''Doc.'''\n", "x = 1\n\n"]


def test_hf_stopping_copies_the_new_tokens_to_the_host_once_a_step_not_once_a_row(tiny, bench):  # noqa: F811
    """On a GPU each device-to-host copy is a sync: the stopping rule reads the batch's new tokens in one copy a
    step. Planted: a tensor type that counts its host reads (tolist/numpy/cpu/item), 4 rows over 3 steps."""
    import torch

    _, tok = tiny

    class Counting(torch.Tensor):
        reads = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.item):
                cls.reads += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    prompt = torch.tensor(tok(["def f(x):", "import os", "class A:", "x = 1"], padding=True)["input_ids"])
    stops = bench._stopping()(prompt.shape[1], ("\nclass",), tok)
    ids = prompt
    for t in range(3):
        ids = torch.cat([ids, torch.full((4, 1), 100 + t)], dim=1)
        stops(ids.as_subclass(Counting), None)
    assert Counting.reads == 3
    assert stops.new == [[100, 101, 102]] * 4
