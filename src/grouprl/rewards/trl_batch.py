"""Reward functions written for TRL's GRPOTrainer: lists in (one entry a completion, every
dataset column as a list), a list of floats out (None: not applicable to that completion).
As TRL calls them: once per batch of completions (with reward.streaming, once per group, as
each group finishes), with `trainer_state` (`global_step`, `epoch`), `log_metric(name, value)`
(its mean over the step in metrics.jsonl as `reward/logged/<name>`) and `log_extra(column,
values)` (one value per completion, in each trajectory's rollouts.jsonl record under `extra`)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass
class TrainerState:
    """What TRL's `trainer_state` tells a reward: the optimizer steps done and the epoch."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0


def trl_extras(fn: Callable[..., Any], state: TrainerState, extra: dict[str, list[Any]],
               logged: dict[str, list[float]]) -> dict[str, Any]:  # fmt: skip
    """TRL's trainer_state, log_metric and log_extra, for a function that can take them."""

    def log_metric(name: str, value: float) -> None:
        if isinstance(value, (int, float)) and math.isfinite(value):
            logged.setdefault(str(name), []).append(float(value))

    def log_extra(column: str, values: list[Any]) -> None:
        extra.setdefault(str(column), []).extend(list(values))

    offered = {"trainer_state": state, "log_metric": log_metric, "log_extra": log_extra}
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return offered
    return {k: v for k, v in offered.items() if k in parameters}


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
