"""Chat messages -> prompt token ids, and what to do with a prompt that is too long."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from grouprl.errors import ConfigError

OVERFLOW_MODES = ("skip", "truncate")


def encode_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` followed by the assistant's generation prompt, as a flat list.

    Uses the tokenizer's chat template. A tokenizer without one (a base model) gets
    "role: content" lines followed by "assistant:", tokenized with its special tokens.
    """
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        text = "".join(f"{m['role']}: {_text(m.get('content', ''))}\n" for m in messages) + "assistant:"
        encoded = tokenizer(text)
    return _flat_ids(encoded)


def with_system_prompt(messages: list[dict[str, Any]], text: str | None) -> list[dict[str, Any]]:
    """`messages` with `text` as the system message (replacing a first one; None: unchanged):
    data.system_prompt, applied alike wherever a prompt of a data file is read."""
    if text is None:
        return messages
    rest = messages[1:] if messages and messages[0].get("role") == "system" else messages
    return [{"role": "system", "content": text}, *rest]


def _text(content: Any) -> str:
    if isinstance(content, list):  # multimodal content parts: keep the text ones
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _flat_ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); older
    # versions a list of ints; return_tensors callers a tensor. Accept all of them.
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    encoded = list(encoded)
    if encoded and isinstance(encoded[0], (list, tuple)):  # a batch of one
        if len(encoded) != 1:
            raise ValueError(f"expected the ids of one prompt, got a batch of {len(encoded)}")
        encoded = list(encoded[0])
    return [int(token) for token in encoded]


def fit_prompt(
    ids: list[int], max_len: int, overflow: Literal["skip", "truncate"] = "skip"
) -> list[int] | None:
    """`ids` if it fits in `max_len`; else None (skip) or its last `max_len` tokens (truncate).

    Truncation keeps the end because the question and the generation prompt sit there.
    """
    if overflow not in OVERFLOW_MODES:
        raise ConfigError(f"prompt overflow must be one of {', '.join(OVERFLOW_MODES)}, got {overflow!r}")
    if max_len < 1:
        raise ConfigError(f"max prompt length must be >= 1, got {max_len}")
    if len(ids) <= max_len:
        return list(ids)
    return list(ids[-max_len:]) if overflow == "truncate" else None
