"""Our GRPO loss and gradient against TRL 1.16's own, on the fixed batch of ``tests/fixtures/grpo_trl_1.16.pt``.

The fixture is TRL's ``GRPOTrainer._compute_loss`` on a real trainer (``bench/grpo_trl_fixture.py``, rerun by
``make bench-grpo`` in an environment of its own; TRL is not in the project's). Here the same weights and batch go
through our path: the unpadded packing, the forward, log-probs at the sampling temperature, the clipped surrogate,
the KL and each ``loss_type``'s reduction; loss and every parameter's gradient agree to 1e-5 in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ultrascale.config.grpo import LossType, ScaleRewards
from ultrascale.train.grpo.batch import completion_logps, pack
from ultrascale.train.grpo.loss import Objective, TokenTerms, advantages, micro_loss

FIXTURE = Path(__file__).parent / "fixtures" / "grpo_trl_1.16.pt"


@pytest.fixture(scope="module")
def fx() -> dict:
    return torch.load(FIXTURE, weights_only=False)


def _model(fx: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in fx["config"].items() if k not in ("architectures", "transformers_version")})
    model = LlamaForCausalLM(cfg).float()
    model.load_state_dict(fx["state_dict"])
    return model.train()


def _unpadded(fx: dict) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    b = fx["batch"]
    prompts = [r[m.bool()].tolist() for r, m in zip(b["prompt_ids"], b["prompt_mask"])]
    completions = [r[m.bool()].tolist() for r, m in zip(b["completion_ids"], b["completion_mask"])]
    return prompts, completions, b["completion_mask"].bool()


@pytest.mark.parametrize("case", ["grpo/beta=0.0", "grpo/beta=0.04", "dr_grpo/beta=0.0", "dr_grpo/beta=0.04",
                                  "dapo/beta=0.0", "dapo/beta=0.04"])  # fmt: skip
def test_loss_and_gradient_equal_trl(fx: dict, case: str) -> None:
    c = fx["cases"][case]
    model = _model(fx)
    prompts, completions, cmask = _unpadded(fx)
    packed = pack(prompts, completions, pad=0)
    logps, _ = completion_logps(lambda **kw: model(**kw).logits, packed, fx["temperature"])
    # the per-token inputs TRL was given ([rows, max_len] grids) in our flat order
    assert torch.allclose(logps.detach(), c["per_token_logps"][cmask], atol=1e-5), "log-probs differ from TRL's"
    ref = c["ref_per_token_logps"][cmask] if c["ref_per_token_logps"] is not None else None
    terms = TokenTerms(logps, c["old_per_token_logps"][cmask], fx["batch"]["advantages"], packed.rows,
                       torch.ones_like(logps), ref)  # fmt: skip
    obj = Objective(LossType(c["loss_type"]), fx["epsilon"], fx["epsilon_high"], c["beta"], fx["max_completion_length"])
    loss, _ = micro_loss(terms, obj, n_rows=len(prompts), total_rows=len(prompts), total_tokens=float(cmask.sum()))
    loss.backward()
    assert abs(loss.item() - c["loss"].item()) < 1e-5, (loss.item(), c["loss"].item())
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(c["grads"])
    for name, want in c["grads"].items():
        torch.testing.assert_close(grads[name], want, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{case} {n}: {m}")


def test_a_wrong_reduction_is_caught(fx: dict) -> None:
    """The parity test can fail: dapo's reduction scored as grpo's differs from TRL's dapo loss."""
    c = fx["cases"]["dapo/beta=0.0"]
    model = _model(fx)
    prompts, completions, cmask = _unpadded(fx)
    logps, _ = completion_logps(lambda **kw: model(**kw).logits, pack(prompts, completions, 0), fx["temperature"])
    terms = TokenTerms(logps, c["old_per_token_logps"][cmask], fx["batch"]["advantages"],
                       pack(prompts, completions, 0).rows, torch.ones_like(logps))  # fmt: skip
    obj = Objective(LossType.grpo, fx["epsilon"], fx["epsilon_high"], 0.0, fx["max_completion_length"])
    loss, _ = micro_loss(terms, obj, len(prompts), len(prompts), float(cmask.sum()))
    assert abs(loss.item() - c["loss"].item()) > 1e-3


def test_group_advantages_are_the_normalised_rewards() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv, zero = advantages(r, 4, ScaleRewards.group)
    g = r[:4]
    want = (g - g.mean()) / (g.std() + 1e-4)  # torch.std is Bessel-corrected, as TRL's nanstd
    torch.testing.assert_close(adv[:4], want)
    assert adv[4:].abs().max() == 0 and zero.tolist() == [False] * 4 + [True] * 4
    adv_none, _ = advantages(r, 4, ScaleRewards.none)
    torch.testing.assert_close(adv_none[:4], g - g.mean())
    adv_b, _ = advantages(r, 4, ScaleRewards.batch)
    torch.testing.assert_close(adv_b, (r - torch.tensor([0.25] * 4 + [1.0] * 4)) / (r.std() + 1e-4))
    nan = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    adv_n, _ = advantages(nan, 4, ScaleRewards.group)
    assert adv_n[1] == 0 and torch.isfinite(adv_n).all()
