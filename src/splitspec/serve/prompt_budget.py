"""How much of a prompt the model reads and how many tokens its reply may have (vLLM's rules, OpenAI's errors)."""

from __future__ import annotations

from splitspec.serve.errors import CONTEXT_EXCEEDED, invalid


def token_budget(prompt_tokens: int, requested: int | None, default: int | None, max_positions: int, param: str) -> int:
    """Tokens the completion may have: as requested, else the server's ``default`` (generation_config.json's
    max_new_tokens) up to what the context has left, else all it has left (400 if none, or if the prompt has no
    token: a tokenizer without a BOS token encodes "" to nothing, and a model needs one to start)."""
    if prompt_tokens == 0:
        raise invalid(f"The {param} is empty: it encodes to no token, and generation needs at least one.", param)
    room = max_positions - prompt_tokens
    if requested is None:
        requested = room if default is None else min(default, max(room, 1))  # vLLM: min(default, room)
    if requested > room or room < 1:
        raise invalid(
            f"This model's maximum context length is {max_positions} tokens. However, you requested "
            f"{prompt_tokens + max(requested, 1)} tokens ({prompt_tokens} in the {param}, "
            f"{max(requested, 1)} for the completion). Please reduce the length of the {param} or the completion.",
            param=param,
            code=CONTEXT_EXCEEDED,
        )
    return requested


def kept_prompt(prompt_ids: list[int], keep: int | None, max_positions: int) -> list[int]:
    """The prompt the model reads: its last ``keep`` tokens (``truncate_prompt_tokens``, vLLM's left truncation; -1:
    as many as the model's positions), or all of it (None). A limit over the model's positions is a 400, as vLLM's."""
    if keep is None:
        return prompt_ids
    if keep > max_positions:
        raise invalid(
            f"truncate_prompt_tokens ({keep}) is more than this model's {max_positions} positions",
            "truncate_prompt_tokens",
        )
    return prompt_ids[-(max_positions if keep == -1 else keep) :]
