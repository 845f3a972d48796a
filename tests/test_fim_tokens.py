"""A pretrained model without FIM tokens learns to infill (issue 48 part 2): data prep appends the sentinels to its
tokenizer (``tokenizer.add_fim=true``), the model's embedding and head grow to match, new rows at the mean of the old,
under every ZeRO stage, and the export writes the grown tokenizer with the weights.

The "pretrained" model here is a real one made in the test: a random tiny ``LlamaForCausalLM`` saved with a small
byte-level BPE trained on stdlib code that has ``<|endoftext|>`` and no FIM token, so data prep, the tokenizer check,
the ZeRO-3 build, training and the export all run as they do for SmolLM2 (``recipes/smollm2_135m_fim.yaml``), in
seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TEST_ENV, check, launch

FIM = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]


def make_pretrained(out: Path, tied: bool, vocab: int = 384) -> Path:
    """A tiny Llama and a ``vocab``-token BPE without FIM tokens, saved as an HF model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    eos = "<|endoftext|>"
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos, "unk_token": eos,
            "pad_token": eos, "model_max_length": 256, "clean_up_tokenization_spaces": False}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(conf))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def prepare_fim(out: Path, tok_dir: Path, extra: list[str] | None = None) -> dict:
    from data_prep.api import prepare

    return prepare(str(out), seq_len=64, max_files=12,
                   overrides=[f"tokenizer.path={tok_dir}", "tokenizer.add_fim=true", *(extra or [])])  # fmt: skip


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return make_pretrained(tmp_path_factory.mktemp("pre") / "untied", tied=False)


@pytest.fixture(scope="module")
def fim_data(tmp_path_factory, untied) -> Path:
    out = tmp_path_factory.mktemp("fim") / "data"
    prepare_fim(out, untied)
    return out


def test_add_fim_grows_the_tokenizer_by_exactly_the_sentinels_after_the_old_vocabulary(fim_data, untied):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from ultrascale.data.tokcheck import vocab_sha256

    old = Tokenizer.from_file(str(untied / "tokenizer.json")).get_vocab(with_added_tokens=True)
    new = Tokenizer.from_file(str(fim_data / "tokenizer" / "tokenizer.json")).get_vocab(with_added_tokens=True)
    n = len(old)
    assert {t: i for t, i in new.items() if t not in FIM} == old  # every old id keeps its token
    assert [new[t] for t in FIM] == list(range(n, n + 4))  # StarCoder's order, right after the old vocabulary
    m = json.loads((fim_data / "manifest.json").read_text())
    assert m["vocab_size"] == n + 4
    assert m["tokenizer_added"] == {"base": str(untied), "base_vocab_size": n, "base_vocab_sha256": vocab_sha256(untied),
                                    "tokens": {t: n + k for k, t in enumerate(FIM)}}  # fmt: skip
    assert all(m["special_tokens"][t] == n + k for k, t in enumerate(FIM))
    assert m["pack"]["train"]["fim"].get("psm") and m["pack"]["train"]["fim"].get("spm")
    hf = AutoTokenizer.from_pretrained(str(fim_data / "tokenizer"))  # what training, eval and the export load
    assert len(hf) == n + 4 and hf.convert_tokens_to_ids(FIM) == list(range(n, n + 4))
    assert set(FIM) <= set(hf.all_special_tokens)  # text never encodes to them; decode(skip_special) drops them
    assert hf("<fim_prefix>x").input_ids[0] == n
    import numpy as np

    from ultrascale.data.shards import open_split

    train = open_split(fim_data, "train")
    ids = train.get(np.arange(len(train)))
    assert {n, n + 1, n + 2} <= set(np.unique(ids).tolist())  # the samples hold the new ids


def test_a_tokenizer_without_fim_tokens_is_refused_in_one_line_without_add_fim(untied, tmp_path):
    from data_prep.api import prepare
    from ultrascale.errors import ConfigError, DataError

    with pytest.raises(DataError, match=r"lacks the FIM tokens .*tokenizer\.add_fim=true") as e:
        prepare(str(tmp_path / "d"), seq_len=64, max_files=2, overrides=[f"tokenizer.path={untied}"])
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()
    with pytest.raises(ConfigError, match=r"tokenizer\.add_fim=true needs tokenizer\.path"):
        prepare(str(tmp_path / "e"), seq_len=64, max_files=2, overrides=["tokenizer.add_fim=true"])


def _build(model_dir: Path, vocab: int):
    from omegaconf import OmegaConf

    from ultrascale.model.build import build_hf_config, build_model

    mc = OmegaConf.create({"type": "llama", "name": "t", "config": {"vocab_size": vocab}, "init_seed": None,
                           "pretrained_path": str(model_dir), "attn_implementation": "sdpa"})  # fmt: skip
    return build_model(mc, seed=0, hf_config=build_hf_config(mc))


@pytest.mark.parametrize("tied", [True, False])
def test_grown_rows_start_at_the_mean_of_the_old_rows_and_old_rows_are_untouched(tmp_path, tied):
    """The whole-model build (ZeRO 0-2; ZeRO-3 reads through the same weights in test_fim_zero3_...)."""
    from safetensors.torch import load_file

    src = make_pretrained(tmp_path / "m", tied=tied)
    saved = load_file(src / "model.safetensors")
    emb = saved["model.embed_tokens.weight"]
    n = emb.shape[0]
    model = _build(src, n + 4)
    got_emb, got_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert got_emb.shape == (n + 4, emb.shape[1]) and model.config.vocab_size == n + 4
    torch.testing.assert_close(got_emb[:n], emb, rtol=0, atol=0)
    torch.testing.assert_close(got_emb[n:], emb.mean(0).expand(4, -1), rtol=0, atol=1e-7)
    if tied:
        assert got_head is got_emb
    else:
        head = saved["lm_head.weight"]
        torch.testing.assert_close(got_head[:n], head, rtol=0, atol=0)
        torch.testing.assert_close(got_head[n:], head.mean(0).expand(4, -1), rtol=0, atol=1e-7)
    for k, v in saved.items():  # every other tensor as saved
        if "embed_tokens" not in k and "lm_head" not in k:
            torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)
    assert _build(src, n).get_input_embeddings().weight.shape[0] == n  # not grown: from_pretrained as before
    from ultrascale.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.config\.vocab_size=380 is below .* can grow"):
        _build(src, n - 4)


@pytest.mark.dist
def test_fim_zero3_training_from_the_grown_model_and_export_round_trip(fim_data, untied, tmp_path):
    """2 CPU ranks: the FIM recipe under ZeRO-3 from the tiny pretrained model (grown by 4 rows at build time, from
    the partitioned parameters), 2 steps; then the engine rebuilt from the checkpoint scores a batch holding the FIM
    ids, and the exported model (grown tokenizer + weights, through ``from_pretrained``) gives the same logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ultrascale.export import export
    from ultrascale.runtime.dist import free_port

    n = json.loads((fim_data / "manifest.json").read_text())["tokenizer_added"]["base_vocab_size"]
    run = tmp_path / "run"
    overrides = ["recipe=smollm2_135m_fim", f"model.pretrained_path={untied}", f"model.config.vocab_size={n + 4}",
                 f"data.path={fim_data}", "zero=stage3", "train.tokens=null", "train.steps=2",
                 "optim.sched.warmup_tokens=null", "optim.sched.warmup_steps=1", "optim.lr=1e-2",
                 "train.checkpoint_interval=2", "train.log_interval=1", f"output_dir={run}", "logger=none",
                 "data.seq_len=64", "data.micro_batch=2", "data.global_batch=4", "train.eval_interval=0"]  # fmt: skip
    check(launch(overrides))
    out = tmp_path / "engine.pt"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           "tests/dist_scripts/fim_engine_logits.py", str(run), str(out), str(untied)]  # fmt: skip
    check(subprocess.run(cmd, cwd=ROOT, env={**os.environ, **TEST_ENV}, capture_output=True, text=True, timeout=300))
    ref = torch.load(out)
    # built under zero.Init from the pretrained weights: the new rows were the mean of the old, on every rank
    assert ref["built_rows_are_mean"] and ref["built_old_rows_equal"]
    ids = ref["ids"]
    assert ids.shape[0] == 2 and all(((r >= n) & (r < n + 4)).any() for r in ids)  # each sample holds FIM ids
    hf_dir = tmp_path / "hf"
    export(run, hf_dir)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert len(tok) == n + 4 and tok.convert_tokens_to_ids(FIM) == list(range(n, n + 4))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert model.config.vocab_size == n + 4
    from safetensors.torch import load_file

    start = load_file(untied / "model.safetensors")["model.embed_tokens.weight"].mean(0)
    emb = model.get_input_embeddings().weight
    assert not torch.allclose(emb[n], start) and not torch.allclose(emb[n + 1], start)  # the sentinels' rows trained
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] == n + 4
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
