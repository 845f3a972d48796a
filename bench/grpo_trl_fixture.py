"""Write TRL's own GRPO loss and gradient on a fixed batch, the fixture ``tests/test_grpo_loss.py`` holds our loss to.

Run in an environment with ``trl==1.16.0`` (``make grpo-fixture``, or ``make bench-grpo``, which reruns it): TRL stays
out of the project's environment, so CI compares against the committed file, and this script is how the file is
remade. A tiny random Llama (seeded), a fixed batch of left-padded prompts and right-padded completions of unequal
lengths, advantages of both signs and old log-probs away from the current ones (so both clips act); for each
``loss_type`` in grpo, dr_grpo, dapo, with ``beta`` 0 and 0.04 (reference log-probs given), the loss of
``GRPOTrainer._compute_loss`` on a real trainer and every parameter's gradient, fp32.

    .cache/venv-trl/bin/python bench/grpo_trl_fixture.py --out tests/fixtures/grpo_trl_1.16.pt
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

VOCAB, PROMPT, COMPLETION, ROWS = 64, 7, 9, 6
TEMPERATURE, EPSILON, EPSILON_HIGH = 0.7, 0.2, 0.28
CASES = [(lt, beta) for lt in ("grpo", "dr_grpo", "dapo") for beta in (0.0, 0.04)]


def model_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Prompts left-padded to PROMPT, completions right-padded to COMPLETION; rows 0 and 3 end in EOS early."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([7, 5, 6, 7, 3, 4])
    completion_len = torch.tensor([4, 9, 6, 2, 9, 7])
    prompt_ids = torch.zeros(ROWS, PROMPT, dtype=torch.long)
    prompt_mask = torch.zeros(ROWS, PROMPT, dtype=torch.long)
    completion_ids = torch.zeros(ROWS, COMPLETION, dtype=torch.long)
    completion_mask = torch.zeros(ROWS, COMPLETION, dtype=torch.long)
    for i in range(ROWS):
        p, c = int(prompt_len[i]), int(completion_len[i])
        prompt_ids[i, PROMPT - p :] = torch.randint(3, VOCAB, (p,), generator=g)
        prompt_mask[i, PROMPT - p :] = 1
        completion_ids[i, :c] = torch.randint(3, VOCAB, (c,), generator=g)
        completion_mask[i, :c] = 1
    completion_ids[0, 3] = completion_ids[3, 1] = 1  # EOS
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "noise_old": 0.3 * torch.randn(ROWS, COMPLETION, generator=g),
            "noise_ref": 0.2 * torch.randn(ROWS, COMPLETION, generator=g)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures/grpo_trl_1.16.pt")
    a = ap.parse_args()
    import trl
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    base = LlamaForCausalLM(model_config()).float()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    b = batch()
    data = Dataset.from_list([{"prompt": "t3 t4"}] * 8)
    cases = {}
    for loss_type, beta in CASES:
        with tempfile.TemporaryDirectory() as d:
            model_dir = Path(d) / "model"  # a path, so that TRL builds its reference model (beta > 0) from it
            base.save_pretrained(model_dir)
            args = GRPOConfig(output_dir=d, loss_type=loss_type, beta=beta, temperature=TEMPERATURE, epsilon=EPSILON,
                              epsilon_high=EPSILON_HIGH, max_completion_length=COMPLETION, num_generations=2,
                              per_device_train_batch_size=2, report_to=[], use_cpu=True, bf16=False,
                              gradient_accumulation_steps=1)  # fmt: skip
            trainer = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=args, train_dataset=data, processing_class=tokenizer())  # fmt: skip
            trainer.current_gradient_accumulation_steps = 1
            trainer.model.train()
            with torch.no_grad():  # the current log-probs, to build old and reference log-probs around them
                ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
                mask = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
                cur, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION)
            inputs = {k: b[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
            inputs["old_per_token_logps"] = cur + b["noise_old"]
            inputs["num_items_in_batch"] = b["completion_mask"].sum()
            if beta:
                inputs["ref_per_token_logps"] = cur + b["noise_ref"]
            trainer.model.zero_grad()
            loss = trainer._compute_loss(trainer.model, inputs)
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        cases[f"{loss_type}/beta={beta}"] = {"loss_type": loss_type, "beta": beta, "loss": loss.detach().clone(),
                                             "grads": grads, "old_per_token_logps": inputs["old_per_token_logps"],
                                             "ref_per_token_logps": inputs.get("ref_per_token_logps"),
                                             "per_token_logps": cur}  # fmt: skip
        print(
            f"{loss_type:8s} beta={beta:<5} loss {loss.item():+.8f}  grad norm "
            f"{torch.sqrt(sum((g**2).sum() for g in grads.values())).item():.6f}"
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": trl.__version__, "torch_version": torch.__version__, "state_dict": state,
                "config": model_config().to_dict(), "batch": b, "temperature": TEMPERATURE, "epsilon": EPSILON,
                "epsilon_high": EPSILON_HIGH, "max_completion_length": COMPLETION, "cases": cases}, out)  # fmt: skip
    print(f"wrote {out} ({out.stat().st_size:,} bytes) from trl {trl.__version__}")


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
