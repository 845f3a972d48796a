"""The dry run's GRPO section: what the step's rollouts run on, and on a GPU cluster the step predicted by phase,
generation against training, so a user sees the generation share before booking the machines.

Generation is :mod:`ultrascale.cost.decode`'s roofline for one rank's waves of completions at full length; the
policy update is :func:`ultrascale.cost.timing.step_time` for the step's completions as rows of prompt + completion
tokens, times ``num_iterations``, plus the extra forwards (old log-probs when ``num_iterations > 1``, the reference
when ``beta > 0``); under ZeRO-3 the replica's refresh is one all-gather of the weights. The reward runs on the
host's CPUs in the sandbox and is not predicted: ``reward_s`` in ``metrics.jsonl`` measures it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ultrascale.cost.decode import DecodeRate, RolloutPlan, rollout_time
from ultrascale.cost.memory import DTYPE_BYTES
from ultrascale.model.arch import arch_from_hf

if TYPE_CHECKING:
    from ultrascale.config.root import RootConfig
    from ultrascale.cost.memory import Layout
    from ultrascale.levers.decide import Decisions

CHARS_PER_TOKEN = 3.5
"""Python source per BPE token, for a prompt length when the model's tokenizer is not on this machine."""


@dataclass(frozen=True)
class GRPOStepPlan:
    """Seconds of one GRPO step on the cluster, by phase."""

    generation: float
    sync: float
    train: float
    tokens_per_s: float
    """Generated tokens per second per GPU."""
    bound: str
    prompt_len: int
    prompt_src: str

    @property
    def step(self) -> float:
        return self.generation + self.sync + self.train

    @property
    def generation_share(self) -> float:
        return self.generation / self.step


def prompt_tokens(cfg: RootConfig) -> tuple[int, str]:
    """The pool's mean prompt length in tokens, and where it came from: HumanEval's prompts (the half trained on)
    through the model's tokenizer when its directory is here, else their characters / :data:`CHARS_PER_TOKEN`; a
    mined or JSONL pool is not read by a dry run: half of ``data.seq_len`` is assumed."""
    p = cfg.problems
    if str(p.source) != "humaneval":
        return cfg.data.seq_len // 2, f"assumed: half of data.seq_len (problems.source={p.source} is not read here)"
    from ultrascale.eval.problems import humaneval_problems

    prompts = [x["prompt"] for x in humaneval_problems(p.split, p.split_seed)]
    path = cfg.model.pretrained_path
    if path and (Path(path) / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        n = sum(len(tok(x, add_special_tokens=False)["input_ids"]) for x in prompts) / len(prompts)
        return round(n), f"mean of the {len(prompts)} HumanEval {p.split} prompts, {path}'s tokenizer"
    n = sum(len(x) for x in prompts) / len(prompts) / CHARS_PER_TOKEN
    return round(n), f"mean of the {len(prompts)} HumanEval {p.split} prompts at {CHARS_PER_TOKEN} characters a token"


def plan_grpo_step(cfg: RootConfig, d: Decisions, t: Any, layout: Layout) -> GRPOStepPlan:
    """The step on ``t``'s cluster (a dry run's ``Target`` for GPUs: ``t.cluster`` and ``t.gpu`` set); ``layout``:
    the run's as the planner counts it (``plan.dryrun.planned_layout``)."""
    from ultrascale.config.search import SearchConfig
    from ultrascale.cost.timing import step_time

    g, c = cfg.grpo, t.cluster
    arch = arch_from_hf(d.hf_config)
    dtype = str(cfg.precision.dtype)
    card = t.gpu.identified().card
    tflops = card.tflops.get(dtype) or card.tflops["fp32"]
    rate = DecodeRate.of_card(card.hbm_tbps, tflops, c.matmul_efficiency, arch.layers)
    prompt_len, src = prompt_tokens(cfg)
    plan = RolloutPlan(g.prompts_per_step // d.topo.dp, g.num_generations, max(g.sampler_batch_size, g.num_generations),
                       prompt_len, g.max_completion_length)  # fmt: skip
    gen = rollout_time(arch, plan, dtype, rate)
    s = SearchConfig()
    lay = replace(layout, global_batch=g.prompts_per_step * g.num_generations,
                  seq_len=prompt_len + g.max_completion_length)  # fmt: skip
    tm = step_time(arch, lay, c, overlap=s.overlap, recompute_overhead=s.recompute_overhead)
    forward = tm.compute / 3  # a forward is a third of forward + backward
    train = tm.step * g.num_iterations + forward * ((g.num_iterations > 1) + (g.beta > 0))
    sync = 0.0
    if d.zero_stage == 3 and d.topo.dp > 1:
        n = d.topo.dp
        inter = n > c.gpus_per_node
        bw = (c.inter_node_gbps if inter else c.intra_node_gbps) * 1e9
        sync = arch.total_params * DTYPE_BYTES[dtype] * (n - 1) / n / bw
    return GRPOStepPlan(gen.seconds, sync, train, gen.tokens_per_s, gen.bound, prompt_len, src)


def grpo_lines(cfg: RootConfig, d: Decisions, t: Any, layout: Layout) -> list[str]:
    """The section's lines: the rollouts' weights, and on a GPU cluster (``t``, a dry run's ``Target``) the
    predicted step by phase."""
    g = cfg.grpo
    if g is None:
        return []
    lines = ["== GRPO step ==",
             f"{g.prompts_per_step} prompts x {g.num_generations} generations x <= {g.max_completion_length} tokens "
             f"a step, {g.prompts_per_step // d.topo.dp} prompt(s) a rank; rollouts on {d.rollout_weights.why}"]  # fmt: skip
    if t.cluster is None or t.gpu is None or t.gpu.identified().card is None:
        return [*lines, "generation share: predicted for a GPU cluster (add cluster=h100_8x); on CPU ranks it is "
                        "measured: gen_s, reward_s, fwd_s, bwd_s in metrics.jsonl, stacked by the comb report"]  # fmt: skip
    if t.gpu.identified().card.hbm_tbps is None:
        return [
            *lines,
            f"generation share: no memory-bandwidth figure for {t.gpu.name} in ultrascale.runtime.gpu.CARDS",
        ]
    p = plan_grpo_step(cfg, d, t, layout)
    sync = f" + replica refresh {p.sync:.3g} s" if p.sync else ""
    return [
        *lines,
        f"predicted on {t.cluster.name} (planner: ultrascale/cost/decode.py, cost/timing.py): step {p.step:.3g} s = "
        f"generation {p.generation:.3g} s{sync} + policy update {p.train:.3g} s (x{g.num_iterations} iteration(s)"
        f"{', + reference forward' if g.beta > 0 else ''}); reward not predicted (CPU sandbox: reward_s measures it)",
        f"generation share {p.generation_share:.0%}; {p.tokens_per_s:,.0f} generated tokens/s per GPU, decode "
        f"{p.bound}-bound; completions at full length, prompts {p.prompt_len} tokens ({p.prompt_src})",
    ]
