"""The docstring -> function instruction format, in one place: ``data_prep.instruct`` writes its conversations
with it, and an evaluation that prompts a chat model (``python -m ultrascale.ssd.evaluate --chat``) renders the
same turns, so a model is asked for HumanEval's code exactly as its fine-tuning set asked for code.
"""

from __future__ import annotations

from typing import Any

INSTRUCTION = "Complete the following Python code:"
"""The user turn's first line (``data_prep.instruct instruction=`` changes it for a set)."""
FENCE = "```"


def user_turn(prompt: str, instruction: str = INSTRUCTION) -> str:
    """The user asks for the code: the instruction, then the prompt (imports, helpers, signature, docstring)."""
    return f"{instruction}\n\n{FENCE}python\n{prompt}{FENCE}"


def _answer_up_to_body(prompt: str) -> str:
    return f"{FENCE}python\n{prompt}"


def assistant_turn(prompt: str, body: str) -> str:
    """The answer repeats the prompt before the body, so the body is learned right after the docstring, where a
    completion benchmark asks for it."""
    return f"{_answer_up_to_body(prompt)}{body}{FENCE}"


def chat_prompt(tokenizer: Any, prompt: str, instruction: str = INSTRUCTION) -> str:
    """What a chat model is prompted with to complete ``prompt``: the user turn rendered by the tokenizer's own
    chat template, the assistant turn opened, and the answer prefilled up to the body (``assistant_turn`` without
    its body and closing fence). The model's continuation is the body, scored as a plain completion would be."""
    opened = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_turn(prompt, instruction)}], tokenize=False, add_generation_prompt=True
    )
    return opened + _answer_up_to_body(prompt)
