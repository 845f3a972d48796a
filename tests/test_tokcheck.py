"""A pretrained model never meets prepared data of another tokenizer (issue 48 part 4).

``recipe=smollm2_135m_lora data.path=data/stdlib`` used to train SmolLM2 on the project's own BPE ids without a
word. The data here is real: data prep's own BPE on stdlib files, and SmolLM2's tokenizer (``smollm2_data``).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_py


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory) -> Path:
    """20 stdlib files through data prep with its own freshly trained 512-token BPE, 64-token samples."""
    from data_prep.api import prepare

    out = tmp_path_factory.mktemp("bpe") / "data"
    prepare(str(out), seq_len=64, vocab_size=512, max_files=20)
    return out


def _swapped_tokenizer(smollm2: Path, out: Path) -> Path:
    """SmolLM2's tokenizer with two ordinary tokens' ids swapped: the same size and special-token ids, another
    vocabulary (only the hash tells them apart)."""
    shutil.copytree(smollm2, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "def", "class"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def _legacy(tok_dir: Path, out: Path) -> Path:
    """``tok_dir``'s tokenizer re-saved in the legacy form, as a slow tokenizer's ``save_pretrained`` leaves it:
    ``vocab.json`` + ``merges.txt`` and a ``tokenizer_config.json`` naming ``GPT2Tokenizer`` (how ``AutoTokenizer``
    knows what to build), no ``tokenizer.json``."""
    from tokenizers import Tokenizer

    out.mkdir(parents=True)
    Tokenizer.from_file(str(tok_dir / "tokenizer.json")).model.save(str(out))
    conf = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**conf, "tokenizer_class": "GPT2Tokenizer"}))
    return out


def _legacy_model(smollm2: Path, out: Path) -> Path:
    """SmolLM2 as a model directory whose tokenizer is in the legacy form (the weights linked, not copied)."""
    _legacy(smollm2, out)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(smollm2 / name, out / name)
    (out / "model.safetensors").symlink_to((smollm2 / "model.safetensors").resolve())
    return out


def _dataset(out: Path, tok_dir: Path, vocab_size: int, special: dict | None, with_hash: bool,
             added: dict | None = None) -> Path:  # fmt: skip
    """Shards whose manifest says what data prep's would: the tokenizer's hash, and ``added`` as ``tokenizer_added``
    (data prep's ``tokenizer.add_fim``)."""
    import numpy as np

    from ultrascale.data.shards import write_samples
    from ultrascale.data.tokcheck import ADDED_KEY, VOCAB_KEY, vocab_sha256

    shutil.copytree(tok_dir, out / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors"))
    ids = np.arange(64 * 4).reshape(4, 64) % 1000
    extra = {"special_tokens": special} if special else {}
    if with_hash:
        extra[VOCAB_KEY] = vocab_sha256(out / "tokenizer")
    if added:
        extra[ADDED_KEY] = added
    write_samples(out, {"train": [ids], "validation": [ids]}, seq_len=64, vocab_size=vocab_size, eos_token_id=0,
                  tokenizer="tokenizer", extra=extra)  # fmt: skip
    return out


def test_data_prep_records_the_vocabulary_hash_both_sides_compute_alike(bpe_data, smollm2_data, smollm2_135m):
    from ultrascale.data.tokcheck import VOCAB_KEY, vocab_sha256

    bpe, smol = (json.loads((d / "manifest.json").read_text()) for d in (bpe_data, smollm2_data))
    assert bpe[VOCAB_KEY] == vocab_sha256(bpe_data / "tokenizer")
    assert smol[VOCAB_KEY] == vocab_sha256(smollm2_135m)  # the model's own directory: the same vocabulary
    assert bpe[VOCAB_KEY] != smol[VOCAB_KEY]


def test_the_models_own_tokenizer_passes(smollm2_data, smollm2_135m):
    from ultrascale.config.compose import compose
    from ultrascale.data.prepare import check_prepared
    from ultrascale.data.tokcheck import check_tokenizer, pretrained_dir

    check_tokenizer(smollm2_data, "data.path", smollm2_135m, "model.pretrained_path")
    cfg = compose(["recipe=smollm2_135m_lora", f"model.pretrained_path={smollm2_135m}", f"data.path={smollm2_data}",
                   "data.seq_len=64"])  # fmt: skip
    assert "train /" in check_prepared(cfg.data, 49152, model_dir=pretrained_dir(cfg.model))


@pytest.mark.parametrize("form", ["tokenizer.json", "legacy"])
def test_train_refuses_another_tokenizers_data_in_one_line_and_writes_nothing(bpe_data, smollm2_135m, tmp_path,
                                                                              tmp_path_factory, form):  # fmt: skip
    """The issue's command, on one rank: the refusal comes from the preflight, before the run directory exists.
    ``legacy``: the model's tokenizer as vocab.json + merges.txt (issue 54), which used to pass unseen and train."""
    legacy = tmp_path_factory.mktemp("legacy") / "smollm2"  # outside the cwd, so the line shows it whole
    model = smollm2_135m if form == "tokenizer.json" else _legacy_model(smollm2_135m, legacy)
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=smollm2_135m_lora", f"model.pretrained_path={model}",
           f"data.path={bpe_data}", "data.seq_len=64", "train.steps=2", f"output_dir={out}"]  # fmt: skip
    # 120 s is a hang guard: without the check this trains (and writes a checkpoint)
    proc = run_py(cmd[1:], timeout=120, cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr[-3000:]
    line = errors[0]
    assert f"data.path={bpe_data}" in line and f"by {bpe_data / 'tokenizer'}," in line, line
    assert f"model.pretrained_path={model}" in line and "512 vs 49,152 tokens" in line, line
    assert f"tokenizer.path={model} fim.rate=0 pack.seq_len=64" in line, line
    assert ("has written its tokenizer.json" in line) == (form == "legacy"), line  # what data prep reads
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))


def test_the_same_tokenizer_in_the_legacy_form_passes(smollm2_data, smollm2_135m, tmp_path):
    """SmolLM2's tokenizer as vocab.json + merges.txt is read through AutoTokenizer to the vocabulary its
    tokenizer.json has, so data tokenized by it passes (before issue 54 it passed unread, with no hash)."""
    from ultrascale.data.tokcheck import check_tokenizer, read_vocab, vocab_sha256

    legacy = _legacy(smollm2_135m, tmp_path / "legacy")
    assert not (legacy / "tokenizer.json").exists()
    assert read_vocab(legacy) == read_vocab(smollm2_135m)  # token -> id, the 17 added tokens included
    assert vocab_sha256(legacy) == vocab_sha256(smollm2_135m)
    check_tokenizer(smollm2_data, "data.path", legacy, "model.pretrained_path")


def test_another_tokenizer_in_the_legacy_form_is_refused_in_one_line(smollm2_data, smollm2_135m, tmp_path):
    """The strongest case: the same size and special ids, two ordinary tokens' ids swapped, only in vocab.json."""
    from ultrascale.data.tokcheck import check_tokenizer
    from ultrascale.errors import DataError

    legacy = _legacy(_swapped_tokenizer(smollm2_135m, tmp_path / "swapped"), tmp_path / "legacy")
    with pytest.raises(DataError, match=r"49,152 vs 49,152 tokens, vocabulary sha256 \w{12} vs \w{12}") as e:
        check_tokenizer(smollm2_data, "data.path", legacy, "model.pretrained_path")
    assert "\n" not in str(e.value), str(e.value)


def test_a_tokenizer_that_cannot_be_read_here_is_refused_in_one_line_saying_what_is_missing(
    smollm2_data, smollm2_135m, tmp_path, monkeypatch
):
    """tokenizer.model alone needs sentencepiece (transformers, without it, would blame tiktoken); vocab.json +
    merges.txt that name no class cannot be built by AutoTokenizer. Neither passes in silence."""
    from ultrascale.data.tokcheck import check_tokenizer
    from ultrascale.errors import DataError

    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # not installed, as on this box, whatever is
    spm = tmp_path / "spm"
    spm.mkdir()
    (spm / "tokenizer.model").write_bytes(b"\n\x00")  # never opened: what reads it is missing
    want = rf"{re.escape(str(spm / 'tokenizer.model'))} is a sentencepiece tokenizer .*`pip install sentencepiece`"
    with pytest.raises(DataError, match=want) as e:
        check_tokenizer(smollm2_data, "data.path", spm, "model.pretrained_path")
    assert "\n" not in str(e.value), str(e.value)
    bare = _legacy(smollm2_135m, tmp_path / "bare")
    (bare / "tokenizer_config.json").unlink()
    want = r"has vocab\.json \+ merges\.txt but no tokenizer\.json, and AutoTokenizer cannot load it \w+ \(ValueError"
    with pytest.raises(DataError, match=want) as e:
        check_tokenizer(smollm2_data, "data.path", bare, "model.pretrained_path")
    assert "\n" not in str(e.value), str(e.value)


def test_a_vocabulary_of_the_same_size_and_special_ids_is_told_apart_by_its_hash(smollm2_135m, tmp_path):
    from ultrascale.data.tokcheck import check_tokenizer
    from ultrascale.errors import DataError

    swapped = _swapped_tokenizer(smollm2_135m, tmp_path / "swapped")
    data = _dataset(tmp_path / "data", swapped, 49152, {"<|endoftext|>": 0}, with_hash=True)
    with pytest.raises(DataError, match=r"49,152 vs 49,152 tokens, vocabulary sha256 \w{12} vs \w{12}"):
        check_tokenizer(data, "data.path", smollm2_135m, "model.pretrained_path")


def test_fim_data_grown_from_one_base_passes_that_base_only(smollm2_135m, tmp_path):
    """``tokenizer.add_fim`` data (issue 48): SmolLM2's tokenizer with the 4 FIM sentinels appended, the manifest's
    ``tokenizer_added`` written by data prep's own ``grown_record``. ``_differences`` lets it through for a model of
    that base vocabulary (the model grows the new rows), and for no other: not for a base of the same size and
    special ids with two ordinary ids swapped. Issue 54's planted ``if added:`` let it through for any model."""
    from data_prep.tokenizer import FIM_TOKENS, add_special
    from data_prep.tokens import grown_record
    from ultrascale.data.tokcheck import check_tokenizer
    from ultrascale.errors import DataError

    grown = tmp_path / "grown"
    shutil.copytree(smollm2_135m, grown, ignore=shutil.ignore_patterns("*.safetensors"))
    added = grown_record(str(smollm2_135m), add_special(grown, FIM_TOKENS))
    data = _dataset(tmp_path / "data", grown, 49152 + 4, {"<|endoftext|>": 0}, with_hash=True, added=added)
    check_tokenizer(data, "data.path", smollm2_135m, "model.pretrained_path")  # its own base
    other = _swapped_tokenizer(smollm2_135m, tmp_path / "other")
    with pytest.raises(DataError, match=r"49,156 vs 49,152 tokens, vocabulary sha256 \w{12} vs \w{12}"):
        check_tokenizer(data, "data.path", other, "model.pretrained_path")


def test_a_manifest_without_the_hash_falls_back_to_size_and_special_ids(smollm2_135m, tiny_data, tmp_path):
    """Manifests from before the hash stay readable: what they record (size, special-token ids) is compared."""
    from ultrascale.data.tokcheck import check_tokenizer
    from ultrascale.errors import DataError

    swapped = _swapped_tokenizer(smollm2_135m, tmp_path / "swapped")
    same = _dataset(tmp_path / "same", swapped, 49152, {"<|endoftext|>": 0, "<fim_prefix>": None}, with_hash=False)
    check_tokenizer(same, "data.path", smollm2_135m, "model.pretrained_path")  # all the old manifest can tell
    moved = _dataset(tmp_path / "moved", swapped, 49152, {"<|endoftext|>": 7}, with_hash=False)
    with pytest.raises(DataError, match=r"<\|endoftext\|> is id 7 vs 0"):
        check_tokenizer(moved, "data.path", smollm2_135m, "model.pretrained_path")
    with pytest.raises(DataError, match=r"257 vs 49,152 tokens"):  # byte-level data: no tokenizer, no hash
        check_tokenizer(tiny_data, "data.path", smollm2_135m, "model.pretrained_path")


def test_eval_perplexity_refuses_another_tokenizers_data_before_loading_the_model(bpe_data, smollm2_135m):
    from ultrascale.config.compose import compose, typed
    from ultrascale.data.tokcheck import shown
    from ultrascale.errors import DataError
    from ultrascale.eval.config import register_eval_configs
    from ultrascale.eval.run import run

    register_eval_configs()
    cfg = compose([f"model_dir={smollm2_135m}", "tasks=[perplexity]", f"perplexity.data_path={bpe_data}",
                   "output_dir=/nonexistent/never"], config_name="eval")  # fmt: skip
    want = rf"perplexity.data_path={re.escape(shown(bpe_data))} .* not by model_dir={re.escape(shown(smollm2_135m))}'s"
    with pytest.raises(DataError, match=want):
        run(typed(cfg))


def test_missing_data_for_a_pretrained_recipe_names_the_command_with_its_tokenizer(smollm2_135m, tmp_path,
                                                                                     monkeypatch):  # fmt: skip
    """Without its data a pretrained recipe used to suggest `python -m data_prep input=...`, which trains a fresh
    BPE that the model cannot read; it gives data prep with the model's tokenizer (as the recipe's Setup does)."""
    from ultrascale.config.compose import compose
    from ultrascale.data.prepare import check_prepared
    from ultrascale.data.tokcheck import pretrained_dir
    from ultrascale.errors import DataError

    monkeypatch.chdir(ROOT)  # where the recipe's relative model.pretrained_path is typed
    missing = tmp_path / "stdlib_smollm2"
    cfg = compose(["recipe=smollm2_135m_lora", f"data.path={missing}"])
    assert pretrained_dir(cfg.model) == smollm2_135m.resolve()
    with pytest.raises(DataError) as e:
        check_prepared(cfg.data, 49152, model_dir=pretrained_dir(cfg.model))
    msg = str(e.value)
    assert f"`python -m data_prep output_dir={missing} tokenizer.path=models/smollm2-135m fim.rate=0 " \
           "pack.seq_len=256`" in msg, msg  # fmt: skip
    assert "input=<your source dir> output_dir=" not in msg, msg
    # a model trained from scratch still gets the generic command
    fresh = compose([f"data.path={missing}"])
    with pytest.raises(DataError, match=r"python -m data_prep input=<your source dir> output_dir="):
        check_prepared(fresh.data, 4096, model_dir=pretrained_dir(fresh.model))
