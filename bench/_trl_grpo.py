"""TRL's side of ``bench/bench_grpo.py``: ``GRPOTrainer`` on the same model, problems, G, prompts per step, completion
length, sampling, loss, lr, LoRA and sandbox reward as our recipe, for ``--steps`` steps; prints one JSON line with
each step's wall time and its generation and reward time (TRL's ``_generate`` and ``_calculate_rewards``, timed
from outside). Run by the bench in TRL's own environment (``.cache/venv-trl``), never in the project's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--continuous-batching", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ultrascale.eval.humaneval import heal
    from ultrascale.eval.problems import humaneval_problems
    from ultrascale.train.grpo.rewards import ExecutionReward

    problems = humaneval_problems("dev", 0)
    rows = [{"prompt": heal(p["prompt"])[0], "full_prompt": p["prompt"], "tests": p["tests"],
             "entry_point": p["entry_point"]} for p in problems]  # fmt: skip
    execution = ExecutionReward(a.timeout, 2)

    def reward(prompts, completions, full_prompt, tests, entry_point, **kw):
        # the completion follows the healed prompt: put back the newlines healing took, as our sampler's path does
        texts = [c[len(fp) - len(p):] if c.startswith("\n" * (len(fp) - len(p))) else c
                 for p, c, fp in zip(prompts, completions, full_prompt)]  # fmt: skip
        from ultrascale.eval.humaneval import truncate

        return execution(full_prompt, [truncate(t) for t in texts], tests, entry_point)

    times: dict[str, list[float]] = {"gen": [], "reward": []}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            times[name].append(time.perf_counter() - t0)
            return out

        return wrapper

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps, self.t0, self.tokens = [], None, []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(time.perf_counter() - self.t0)

    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"trl_grpo_bench_{os.getpid()}"
    args = GRPOConfig(output_dir=str(out_dir), num_generations=a.generations, max_completion_length=a.max_completion_length,
                      temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", beta=0.0, learning_rate=a.lr,
                      lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.0,
                      per_device_train_batch_size=4, gradient_accumulation_steps=a.prompts * a.generations // 4,
                      max_steps=a.steps, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                      bf16=False, gradient_checkpointing=False, seed=a.seed, disable_tqdm=True,
                      use_transformers_continuous_batching=a.continuous_batching)  # fmt: skip
    clock = StepClock()
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]),
                          callbacks=[clock])  # fmt: skip
    trainer._generate = timed("gen", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer.train()
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h]
    print(json.dumps({"trl": trl.__version__, "continuous_batching": a.continuous_batching, "step_s": clock.steps,
                      "gen_s": times["gen"], "reward_s": times["reward"], "mean_length": lengths,
                      "completions_per_step": a.prompts * a.generations}))  # fmt: skip


if __name__ == "__main__":
    main()
