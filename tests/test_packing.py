"""Padding-free packing: documents in one row train as if alone, and supervised loss masks survive the shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ultrascale.data.loader import IGNORE, StepBatches, make_batch
from ultrascale.data.shards import open_split, write_samples
from ultrascale.errors import DataError

EOS = 299


def _tiny(attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def _docs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[*torch.randint(0, EOS, (n,), generator=g).tolist(), EOS] for n in lengths]


def test_positions_restart_after_eos_and_doc_starts_are_not_targets():
    row = np.array([[5, 6, EOS, 7, 8, 9, EOS, 4]], dtype=np.int64)
    b = make_batch(row, None, EOS, document_masking=True)
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert b.labels.tolist() == [[5, 6, EOS, IGNORE, 8, 9, EOS, IGNORE]]
    plain = make_batch(row, None, EOS, document_masking=False)
    assert plain.position_ids is None and torch.equal(plain.labels, plain.input_ids)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_per_document_loss_equals_each_document_alone(attn):
    """With cross-document attention blocked, a document's loss inside a packed row is its loss alone."""
    model = _tiny(attn)
    docs = _docs((20, 35, 9))
    row = [t for d in docs for t in d]
    row = np.array([row + [1] * (80 - len(row))], dtype=np.int64)
    b = make_batch(row, None, EOS, document_masking=True)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, position_ids=b.position_ids).logits
        per_token = F.cross_entropy(logits[0, :-1], b.labels[0, 1:], ignore_index=IGNORE, reduction="none")
        off = 0
        for d in docs:
            alone = model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss
            packed = per_token[off : off + len(d) - 1].mean()  # positions of d predicting d's own next tokens
            assert abs(float(alone) - float(packed)) < 1e-5, (len(d), float(alone), float(packed))
            off += len(d)
        # ...and without document masking the later documents see the earlier ones: the test can fail.
        leaky = model(input_ids=b.input_ids).logits
        off = len(docs[0])
        d = docs[1]
        alone = model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss
        leaked = F.cross_entropy(leaky[0, off : off + len(d) - 1], b.input_ids[0, off + 1 : off + len(d)])
        assert abs(float(alone) - float(leaked)) > 1e-3


def test_flattened_batch_is_one_row_with_the_same_targets():
    row = np.array([[5, 6, EOS, 7], [8, EOS, 9, 10]], dtype=np.int64)
    b = make_batch(row, None, EOS, document_masking=True)
    f = b.flattened()
    assert f.input_ids.shape == (1, 8) and f.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    assert f.labels[0, 4] == 8  # row 2 starts a new sequence: varlen attention sees position 0 there


def test_loss_masks_round_trip_through_shards_and_become_ignored_labels(tmp_path):
    ids = np.arange(24, dtype=np.int64).reshape(3, 8) % 50
    mask = np.zeros_like(ids, dtype=bool)
    mask[:, 5:] = True  # completion tokens only
    write_samples(tmp_path, {"train": [ids], "validation": [ids]}, seq_len=8, vocab_size=50, eos_token_id=49,
                  tokenizer="tokenizer", loss_masks={"train": [mask], "validation": [mask]})  # fmt: skip
    split = open_split(tmp_path, "train")
    assert split.has_loss_mask and np.array_equal(split.get_loss_mask(np.array([2, 0])), mask[[2, 0]])
    b = StepBatches(split, 3, 3, 0, 1, seed=0).get(0, 0)
    assert (b.labels[:, :5] == IGNORE).all() and (b.labels[:, 5:] == b.input_ids[:, 5:]).all()


def test_a_corrupt_loss_mask_is_named(tmp_path):
    ids = np.ones((2, 8), dtype=np.int64)
    write_samples(tmp_path, {"train": [ids]}, seq_len=8, vocab_size=50, eos_token_id=49, tokenizer="t",
                  loss_masks={"train": [ids > 0]})  # fmt: skip
    (tmp_path / "train" / "mask_00000.npy").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"mask_00000.npy is corrupt"):
        open_split(tmp_path, "train")
