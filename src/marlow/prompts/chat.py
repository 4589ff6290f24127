"""Prompt token ids through a tokenizer's chat template.

One function, used by the workflow engine (to build every turn's prompt) and by the tiny world's
pre-training corpus, so the tiny model is trained on exactly the token ids the sampler later
feeds it. It works for the tiny character tokenizer and for real chat tokenizers (Qwen3: the
``enable_thinking=False`` kwarg turns thinking off; templates without that variable ignore it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = tuple[str, str]  # (role: user | assistant, content)


def chat_prompt_text(tokenizer: Any, user_text: str, history: Sequence[Message] = ()) -> str:
    """The rendered chat prompt for one user message after ``history`` (earlier messages, in
    order), ending with the assistant header."""
    messages = [{"role": role, "content": content} for role, content in history]
    return tokenizer.apply_chat_template(
        [*messages, {"role": "user", "content": user_text}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )


def chat_prompt_ids(tokenizer: Any, user_text: str, history: Sequence[Message] = ()) -> list[int]:
    """Token ids of the chat prompt for one user message after ``history`` (no extra BOS: the
    template has it). A prompt longer than the model's positions is returned whole, without
    the tokenizer's warning: the workflow engine ends such an episode itself, counted
    (``rollout.max_prompt_tokens``, ``EpisodeRules.within_context``)."""
    text = chat_prompt_text(tokenizer, user_text, history)
    # a Hugging Face tokenizer (it knows a model_max_length) takes the flag; stand-ins need not
    quiet = {"verbose": False} if hasattr(tokenizer, "model_max_length") else {}
    return list(tokenizer(text, add_special_tokens=False, **quiet)["input_ids"])
