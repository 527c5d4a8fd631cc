"""Reward functions written for TRL's GRPOTrainer: lists in (one entry a completion, every
dataset column as a list), a list of floats out (None: not applicable to that completion)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

# the parameters that mark a reward function written for TRL's GRPOTrainer: it takes lists (one
# entry a completion) and returns a list of floats (None: not applicable to that completion)
BATCH_NAMES = ("completions", "prompts", "completion_ids")


def is_batched(fn: Callable[..., Any]) -> bool:
    """`fn` takes TRL's batch arguments (`completions`, `prompts`, `completion_ids`)."""
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name in names for name in BATCH_NAMES)


def _batch_arguments(contexts: list[dict[str, Any]]) -> dict[str, Any]:
    """What TRL passes a reward function for these completions: `prompts` and `completions`
    (text, or message lists where the data's prompts were messages), `completion_ids`, and each
    dataset column as a list (the columns in extra_info, the ground truth under its own column's
    name and as `ground_truth`)."""
    samples = [c["sample"] for c in contexts]
    conversational = all(s.conversational for s in samples)
    arguments: dict[str, Any] = {
        "prompts": [s.messages if conversational else c["prompt"] for s, c in zip(samples, contexts)],
        "completions": [
            [{"role": "assistant", "content": c["response"]}] if conversational else c["response"] for c in contexts
        ],
        "completion_ids": [list(c["trajectory"].response_ids) for c in contexts],
        "ground_truth": [s.ground_truth for s in samples],
        "data_source": [s.data_source for s in samples],
    }
    for column in dict.fromkeys(k for s in samples for k in s.extra_info):
        if column not in arguments:
            arguments[column] = [s.extra_info.get(column) for s in samples]
    for column in dict.fromkeys(s.truth_column for s in samples):
        if column and "." not in column and column not in arguments:
            arguments[column] = [s.ground_truth for s in samples]
    return arguments
