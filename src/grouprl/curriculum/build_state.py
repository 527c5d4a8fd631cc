"""What a curriculum build works from: the options (`grouprl curriculum build`'s flags) and the
state the report and the summary are computed from."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from grouprl.curriculum.join import AUTO, Join
from grouprl.curriculum.logs import LogFields, LogScores
from grouprl.curriculum.stats import UidStats


@dataclass
class BuildOptions:
    logs: list[str]
    dataset: list[str]
    out: str
    fields: LogFields = field(default_factory=LogFields)
    dataset_uid_field: str = AUTO
    easy: float = 0.7
    hard: float = 0.1
    rule: str = "mean"
    order: str = "easy-to-hard"
    batch_size: int = 8
    """Prompts per training step: the `spread` order's strata and the report's batch checks."""
    seed: int = 0
    allow_empty_edge: bool = False
    """Write the folder even when no prompt lands in the edge bucket (otherwise an error)."""


@dataclass
class Build:
    """Everything the report and the summary are computed from."""

    options: BuildOptions
    logs: LogScores
    join: Join
    matched: UidStats  # one entry per matched uid, in dataset row order
    bucket_of: np.ndarray  # int8 [M]
    ordered: dict[str, np.ndarray]  # bucket -> positions into `matched`, in curriculum order
    correlation: float | None
    dataset_rows: int
    typical_n: int
    agent_repeats: int | None  # records repeating a (uid, agent) pair; None without --agent-field
