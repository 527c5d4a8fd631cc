"""The curriculum section: the online curriculum sampler and dynamic filtering."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from grouprl.errors import need


@dataclass
class CurriculumConfig:
    easy: float = 0.7
    """A prompt whose moving-average score is above this is mastered."""
    hard: float = 0.1
    """A prompt whose moving-average score is below this is unsolvable (edge: hard <= score <= easy)."""
    rule: Literal["mean", "mixed"] = "mixed"
    """mixed: an edge prompt whose latest group scored all alike (zero advantage) goes to the nearer other bucket."""
    order: Literal["easy-to-hard", "hard-to-easy", "spread", "random"] = "easy-to-hard"
    """Order of prompts inside a bucket (see grouprl.curriculum.order); ties by uid."""
    ema: float = 0.5
    """Weight of a prompt's newest group mean in its moving-average score (1.0 = the latest visit only)."""
    rebucket_every: int = 10
    """Re-bucket every prompt from its moving-average score every this many steps."""
    weights: dict[str, float] = field(
        default_factory=lambda: {"mastered": 0.05, "edge": 0.7, "unsolvable": 0.05, "unseen": 0.2}
    )
    """Share of each batch drawn from mastered, edge, unsolvable, unseen (a bucket left out gets 0; an empty bucket's share goes to the rest)."""
    dynamic_filter: bool = False
    """Over-sample prompts and drop groups whose rewards are all equal, keeping the batch size."""
    max_oversample: float = 2.0
    """With dynamic_filter: most prompts generated per step, as a multiple of data.train_batch_size."""
    init_from_build: bool = True
    """Start prompts carrying extra_info.curriculum (`grouprl curriculum build` output) from that score."""

    def __post_init__(self) -> None:
        need(
            self.hard <= self.easy,
            f"config key 'curriculum.hard' ({self.hard}) must be <= curriculum.easy ({self.easy})",
        )
        need(0 < self.ema <= 1, f"config key 'curriculum.ema' must be in (0, 1], got {self.ema}")
        need(
            self.rebucket_every >= 1,
            f"config key 'curriculum.rebucket_every' must be >= 1, got {self.rebucket_every}",
        )
        need(
            self.max_oversample >= 1,
            f"config key 'curriculum.max_oversample' must be >= 1, got {self.max_oversample}",
        )
        pools = ("mastered", "edge", "unsolvable", "unseen")
        for key, value in self.weights.items():
            need(
                key in pools,
                f"config key 'curriculum.weights' has unknown bucket {key!r}; allowed: {', '.join(pools)}",
            )
            need(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                f"config key 'curriculum.weights.{key}' must be a number >= 0, got {value!r}",
            )
        need(
            sum(self.weights.values()) > 0,
            "config key 'curriculum.weights' must give some bucket a weight > 0",
        )

