"""A planted reward function, named by dotted path in ``grpo.reward_funcs`` as a user names theirs (TRL's calling
convention): the share of a completion's characters that are vowels. A random tiny model's completions differ in
it, so its groups carry signal where the execution reward gives all zeros."""

from __future__ import annotations


def vowels(prompts: list[str], completions: list[str], completion_ids: list[list[int]], task_id: list[str],
           **columns) -> list[float | None]:  # fmt: skip
    assert len(prompts) == len(completions) == len(completion_ids) == len(task_id)
    return [sum(ch in "aeiou" for ch in c) / len(c) if c else None for c in completions]
