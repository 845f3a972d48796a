"""FlexAttention over document blocks computes what HF's masked sdpa computes, forward and backward, and runs
where it should: packed rows through FlexAttention, one-document rows and decoding through SDPA.

On this CPU the training path is FlexAttention's reference implementation (torch has no CPU backward kernel),
the BlockMask and the routing are the ones a GPU runs; the tables the GPU kernel reads (which tiles to skip) are
checked against the dense mask separately, since the reference math does not read them.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from transformers import AutoConfig
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from tests.conftest import FAST, check, launch, losses
from ultrascale.config.compose import compose
from ultrascale.config.topology import Topology
from ultrascale.data.bytecorpus import write_byte_dataset
from ultrascale.data.loader import make_batch
from ultrascale.errors import ConfigError
from ultrascale.levers.decide import decide
from ultrascale.levers.rules import validate
from ultrascale.model import flex as flex_mod
from ultrascale.model.build import build_hf_config, build_model
from ultrascale.model.flex import block_mask, install_flex_attention
from ultrascale.runtime.gpu import GpuInfo

EOS = 3
TINY = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip


def _model(kind: str = "llama", attn: str = "sdpa", **extra):
    cfg = {"type": kind, "name": "t", "pretrained_path": None, "init_seed": None, "attn_implementation": attn}
    return build_model(OmegaConf.create({**cfg, "config": {**TINY, **extra}}), seed=0)


def _pair(kind: str = "llama", **extra):
    plain = _model(kind, **extra)
    flex = copy.deepcopy(plain)
    install_flex_attention(flex)
    return plain, flex


def _rows(seq: int, eos_at: list[list[int]], seed: int = 0) -> torch.Tensor:
    """Packed rows with EOS at the given columns (a document starts right after each)."""
    ids = torch.randint(4, 97, (len(eos_at), seq), generator=torch.Generator().manual_seed(seed))
    for r, cols in enumerate(eos_at):
        ids[r, cols] = EOS
    return ids


LAYOUTS = {
    # several documents, one a single token, rows laid out differently (a BlockMask shared by rows would fail)
    "many_docs": (200, [[40, 41, 150], [7], [60, 61, 62, 130]]),
    # boundaries on the 128-token tiles: a document ending at a tile's last token, one starting on the next tile
    "tile_edges": (384, [[126, 127, 255], [128, 256]]),
    # one row of one document next to a packed row: the packed mask applies to the whole micro-batch
    "one_doc_row": (256, [[], [100]]),
}


def _forward_backward(model, **inputs):
    model.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flex_equals_masked_sdpa_logits_and_grads(layout):
    """A tiny GQA llama (4 query heads over 2 kv heads): same logits and parameter gradients as HF's sdpa with
    its dense block-diagonal mask."""
    seq, eos_at = LAYOUTS[layout]
    plain, flex = _pair()
    batch = make_batch(_rows(seq, eos_at).numpy(), None, EOS, True)
    ref_logits, ref_grads = _forward_backward(plain, **batch.model_inputs())
    logits, grads = _forward_backward(flex, **batch.model_inputs())
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=name)


def test_flex_keeps_the_models_sliding_window():
    """Mistral with a 48-token window: the block mask is causal AND same document AND within the window."""
    plain, flex = _pair("mistral", sliding_window=48)
    batch = make_batch(_rows(256, [[150], [30, 200]]).numpy(), None, EOS, True)
    ref_logits, ref_grads = _forward_backward(plain, **batch.model_inputs())
    logits, grads = _forward_backward(flex, **batch.model_inputs())
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=name)


def _doc_mask(position_ids: torch.Tensor, window: int | None = None):
    """HF's mask function for packed rows, as ``create_causal_mask`` composes it."""
    base = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return and_masks(base, packed_sequence_mask_function(find_packed_sequence_indices(position_ids)))


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (9, 3)])  # MHA, GQA 4:1, SmolLM2's 3:1 of 9
@pytest.mark.parametrize("window", [None, 40])
def test_kernel_gradients_of_q_k_v_equal_masked_sdpa(heads, kv_heads, window):
    seq = 200
    pos = make_batch(_rows(seq, [[40, 41, 150], [127]]).numpy(), None, EOS, True).position_ids
    fn = _doc_mask(pos, window)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, seq, 16, generator=g, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    dense = sdpa_mask(2, seq, seq, mask_function=fn, allow_is_causal_skip=False)
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=dense)
    out = flex_mod.flex(q, k, v, block_mask(fn, 2, seq, seq, torch.device("cpu")))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    d_out = torch.randn(ref.shape, generator=g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), d_out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


def test_compiled_flex_equals_masked_sdpa(monkeypatch):
    """The call a GPU makes: without gradients :func:`flex` runs ``torch.compile(flex_attention)`` with the
    BlockMask (inductor's CPU kernel here, inference only), not the reference path the tests above compare. Its
    output equals SDPA's under the dense document mask, so a call that dropped ``block_mask=`` (attention across
    documents and to the future) fails here; GQA 4:2 rides on ``enable_gqa``. Tiny on purpose: 7.2 s
    with its compile on this box's CPU."""

    def no_reference(*args, **kwargs):
        raise AssertionError("flex() without gradients ran the reference path, not the compiled call")

    monkeypatch.setattr(flex_mod, "_reference", no_reference)
    seq = 200
    pos = make_batch(_rows(seq, [[40, 41, 150], [127]]).numpy(), None, EOS, True).position_ids
    fn = _doc_mask(pos)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, seq, 16, generator=g) for h in (4, 2, 2))
    dense = sdpa_mask(2, seq, seq, mask_function=fn, allow_is_causal_skip=False)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense)
    with torch.no_grad():
        out = flex_mod.flex(q, k, v, block_mask(fn, 2, seq, seq, torch.device("cpu")))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_block_tables_list_exactly_the_tiles_the_mask_needs():
    """What the GPU kernel reads: per row and 128-token tile, skipped / full / partial. Every tile holding an
    allowed pair is listed, and only tiles allowed throughout are listed as full (computed without mask_mod)."""
    seq, tile = 384, 128
    pos = make_batch(_rows(seq, [[126, 127, 300], [], [128, 256]]).numpy(), None, EOS, True).position_ids
    fn = _doc_mask(pos)
    bm = block_mask(fn, 3, seq, seq, torch.device("cpu"))
    dense = sdpa_mask(3, seq, seq, mask_function=fn, allow_is_causal_skip=False)[:, 0]
    n = seq // tile
    tiles = dense.reshape(3, n, tile, n, tile)
    need, whole = tiles.any(dim=(2, 4)), tiles.all(dim=(2, 4))
    assert need.any(dim=-1).all() and not need.all()  # something to skip, nothing empty
    for b in range(3):
        for qb in range(n):
            partial = set(bm.kv_indices[b, 0, qb, : bm.kv_num_blocks[b, 0, qb]].tolist())
            full = set(bm.full_kv_indices[b, 0, qb, : bm.full_kv_num_blocks[b, 0, qb]].tolist())
            assert partial | full == set(need[b, qb].nonzero().flatten().tolist()), (b, qb)
            assert full <= set(whole[b, qb].nonzero().flatten().tolist()), (b, qb)


@pytest.fixture
def flex_calls(monkeypatch):
    """Count calls of the FlexAttention kernel (the real one still runs)."""
    calls = []
    real = flex_mod.flex

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_mod, "flex", counted)
    return calls


def _sdpa_calls(model, **inputs) -> int:
    with torch.profiler.profile() as prof, torch.no_grad():
        model(**inputs)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")


def test_packed_rows_run_flex_and_one_document_rows_sdpas_causal_kernel(flex_calls):
    """Not a silent fallback: packed rows are FlexAttention in every layer (no SDPA call at all); rows without a
    boundary keep SDPA's causal kernel (nothing to skip that it does not skip itself), once per layer."""
    _, flex = _pair()
    packed = make_batch(_rows(200, [[40], [7]]).numpy(), None, EOS, True)
    assert _sdpa_calls(flex, **packed.model_inputs()) == 0 and len(flex_calls) == 2
    flex_calls.clear()
    single = make_batch(_rows(200, [[], []]).numpy(), None, EOS, True)
    assert _sdpa_calls(flex, **single.model_inputs()) == 2 and not flex_calls


def test_decoding_and_padded_prompts_fall_back_to_sdpa(flex_calls):
    plain, flex = _pair()
    ids = _rows(80, [[30], []])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding, as batched generation has it
    with torch.no_grad():
        a = plain(input_ids=ids, attention_mask=mask).logits
        b = flex(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(b[mask.bool()], a[mask.bool()], rtol=0, atol=1e-5)
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    for m in (plain, flex):
        m.config.use_cache = True
    assert torch.equal(flex.generate(ids[:1, :70], **kw), plain.generate(ids[:1, :70], **kw))
    assert not flex_calls


def test_the_decision_refuses_what_flex_cannot_keep_exact():
    """The installer acts on the decision; the decision says why not (auto) or refuses (forced)."""
    h100 = GPUS["H100 SXM"]
    eager = _decide(["model.attn_implementation=eager"], gpu=h100)
    assert not eager.attention.on and "model.attn_implementation=eager" in eager.attention.why
    cfg = compose([])
    gpt2 = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2)
    d = decide(cfg, Topology(world=1), gpt2, "nccl", None, h100)
    assert not d.attention.on and "'gpt2' is not in the causal-mask list" in d.attention.why
    with pytest.raises(ConfigError, match=r"train.attention_kernel=flex needs a causal text decoder"):
        decide(compose(["train.attention_kernel=flex"]), Topology(world=1), gpt2, "nccl", None, h100)


# --- The decision (pure: a planted GPU description decides it as the card would) and the validation rules. ---

GPUS = {
    "H100 SXM": GpuInfo("NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0)),
    "H200": GpuInfo("NVIDIA H200", 141 * 2**30, (9, 0)),
    "A100 80GB": GpuInfo("NVIDIA A100-SXM4-80GB", 80 * 2**30, (8, 0)),
    "L4 24GB": GpuInfo("NVIDIA L4", 24 * 2**30, (8, 9)),
    "T4": GpuInfo("Tesla T4", 16 * 2**30, (7, 5)),
}


def _decide(overrides: list[str], backend: str = "nccl", gpu=None, world: int = 1, **topo):
    cfg = compose(overrides)
    return decide(cfg, Topology(world=world, **topo), build_hf_config(cfg.model), backend, None, gpu)


@pytest.mark.parametrize("card", list(GPUS))
def test_auto_picks_flex_on_gpus_from_ampere_and_keeps_the_cpu_rule(card):
    gpu = GPUS[card]
    d = _decide([], "nccl", gpu)
    if gpu.capability >= (8, 0):
        assert d.attention.on and d.attention.value == "flex"
        assert f"sm_{gpu.capability[0]}{gpu.capability[1]}" in d.attention.why
        assert "FlexAttention block mask" in d.document_masking.why
    else:
        assert not d.attention.on and "FlexAttention's kernels want sm_80" in d.attention.why
        assert "sdpa block-diagonal mask" in d.document_masking.why
    cpu = _decide([], "gloo", gpu)  # a CPU rank: today's rule, whatever GPU description came with it
    assert cpu.attention.on and isinstance(cpu.attention.value, int) and "query blocks" in cpu.attention.why


def test_auto_on_a_gpu_says_why_it_keeps_sdpa():
    h100 = GPUS["H100 SXM"]
    cases = {
        "data.document_masking=false": _decide(["data.document_masking=false"], gpu=h100),
        "the pipeline stages build their own masks": _decide(["zero=stage1"], gpu=h100, world=2, pp=2),
        "Ulysses wraps the attention core": _decide([], gpu=h100, world=2, sp=2),
        "model.attn_implementation=eager": _decide(["model.attn_implementation=eager"], gpu=h100),
        "no GPU description": _decide([], gpu=None),
    }
    for why, d in cases.items():
        assert not d.attention.on and why in d.attention.why, (why, d.attention.why)
    blocks = _decide(["train.attn_block_size=64"], gpu=h100)  # a block size asks for the blocks
    assert blocks.attention.value == 64


def test_named_kernels_are_what_runs():
    h100 = GPUS["H100 SXM"]
    assert not _decide(["train.attention_kernel=sdpa"], gpu=h100).attention.on
    assert _decide(["train.attention_kernel=blocks"], gpu=h100).attention.value == 64  # seq 256 in 4 blocks
    cpu_flex = _decide(["train.attention_kernel=flex"], "gloo")
    assert cpu_flex.attention.value == "flex" and "reference implementation" in cpu_flex.attention.why


@pytest.mark.parametrize(
    ("overrides", "world", "error"),
    [
        (["parallel.pp=2", "zero=stage1"], 2, r"train.attention_kernel=flex needs parallel.pp=1 \(got 2\)"),
        (["parallel.sp=2"], 2, r"train.attention_kernel=flex needs parallel.sp=1 \(got 2\)"),
        (["model.attn_implementation=eager"], 1,
         r"train.attention_kernel=flex replaces model.attn_implementation=sdpa \(got eager\)"),
        (["+model.config.attention_dropout=0.1"], 1, r"has no attention dropout"),
        (["model.type=gemma"], 1, r"needs a causal text decoder .* got model.type=gemma"),
    ],
)  # fmt: skip
def test_a_named_flex_the_run_cannot_take_is_one_error(overrides, world, error):
    with pytest.raises(ConfigError, match=error):
        validate(compose(["train.attention_kernel=flex", *overrides]), world, backend="gloo")


def test_named_blocks_of_zero_is_an_error():
    with pytest.raises(ConfigError, match=r"train.attention_kernel=blocks with train.attn_block_size=0"):
        validate(compose(["train.attention_kernel=blocks", "train.attn_block_size=0"]), 1, backend="gloo")


def test_the_engine_installs_the_decided_kernel_or_says_why_not():
    from ultrascale.train.engine import _apply_attention

    flex, blocks = _decide(["train.attention_kernel=flex"], "gloo"), _decide(["train.attention_kernel=blocks"], "gloo")
    for d, name in ((flex, "ultrascale_flex"), (blocks, "ultrascale_sdpa_blocks64")):
        model = _model()
        _apply_attention(model, d)
        assert model.config._attn_implementation == name
    with pytest.raises(ConfigError, match=r"cannot install on this model \(off \(model.attn_implementation=eager"):
        _apply_attention(_model(attn="eager"), flex)


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory):
    """Byte-level stdlib code cut to 90 bytes a file, seq 128: every row holds two or more documents."""
    return write_byte_dataset(tmp_path_factory.mktemp("packed"), seq_len=128, max_files=200, max_bytes=90)


@pytest.mark.dist
def test_flex_trains_like_masked_sdpa_on_two_ranks(packed_data, tmp_path):
    """2 ranks, ZeRO-2, rows of several documents each: FlexAttention logs the masked-sdpa run's losses."""
    runs, logs = {}, {}
    for kernel in ("sdpa", "flex"):
        out = tmp_path / kernel
        args = [*FAST, "data.seq_len=128", "zero=stage2", f"data.path={packed_data}", f"output_dir={out}",
                "train.steps=5", f"train.attention_kernel={kernel}"]  # fmt: skip
        proc = check(launch(args))
        runs[kernel], logs[kernel] = losses(out), proc.stdout + proc.stderr
    assert "FlexAttention where a row holds several documents" in logs["flex"]
    assert "FlexAttention block mask" in logs["flex"] and "sdpa block-diagonal mask" in logs["sdpa"]
    ref = runs["sdpa"]
    assert ref[5] < ref[1]
    for step, loss in ref.items():
        assert runs["flex"][step] == pytest.approx(loss, abs=1e-4), step


def test_packed_data_rows_hold_several_documents(packed_data):
    """The dist test's premise: no row of its data is one document (else FlexAttention would never run)."""
    from ultrascale.data.shards import open_split

    split = open_split(packed_data, "train", verify=False)
    rows = torch.from_numpy(split.get(np.arange(len(split))))
    assert len(rows) >= 40 and bool(((rows[:, :-1] == 256).sum(dim=1) >= 1).all())
