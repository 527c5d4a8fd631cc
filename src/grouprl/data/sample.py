"""The unit of data every room passes around before generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One prompt with what is needed to score answers to it.

    `uid` is stable across runs (from the dataset's id/uid/index, else a hash of the prompt):
    it is the group id of the sample's n_agent trajectories, and the key logs and curricula
    join on.
    """

    uid: str
    messages: list[dict[str, Any]]  # chat turns [{role, content}], ending with the user turn
    ground_truth: Any = None
    images: list[Any] = field(default_factory=list)  # bytes or paths; kept for VLM policies
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    conversational: bool = True  # the file's prompt was a list of messages (TRL's "conversational" data)
    truth_column: str = ""  # the column the ground truth came from (reward_model.ground_truth, answer, solution, ...)
