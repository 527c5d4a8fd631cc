"""Difficulty buckets from a prompt's mean score (the same rules offline and online).

    mastered    mean > easy
    edge        hard <= mean <= easy          (the solvability gap: train here)
    unsolvable  mean < hard

rule "mixed" also asks an edge prompt for a non-zero spread: when all its agents scored alike
every GRPO advantage of its group is zero and it teaches nothing. Such a prompt goes to the
nearer bucket: mastered when its mean is strictly closer to `easy` than to `hard`, else
unsolvable.
"""

from __future__ import annotations

import math

import numpy as np

from grouprl.errors import ConfigError

BUCKETS = ("mastered", "edge", "unsolvable")
MASTERED, EDGE, UNSOLVABLE = 0, 1, 2  # codes: index into BUCKETS, easiest first
RULES = ("mean", "mixed")


def check_thresholds(easy: float, hard: float, rule: str = "mean") -> None:
    if not (math.isfinite(easy) and math.isfinite(hard)):
        raise ConfigError(f"thresholds must be finite numbers, got easy={easy} hard={hard}")
    if hard > easy:
        raise ConfigError(
            f"threshold hard ({hard:g}) is above easy ({easy:g}); the edge bucket is hard <= mean <= easy"
        )
    if rule not in RULES:
        raise ConfigError(f"bucket rule must be one of {', '.join(RULES)}, got {rule!r}")


def assign_buckets(
    mean: np.ndarray, zero_spread: np.ndarray, *, easy: float, hard: float, rule: str = "mean"
) -> np.ndarray:
    """Bucket code (MASTERED, EDGE, UNSOLVABLE) of each prompt. [U] float, [U] bool -> [U] int8."""
    check_thresholds(easy, hard, rule)
    mean = np.asarray(mean, dtype=np.float64)
    codes = np.full(mean.shape, EDGE, dtype=np.int8)
    codes[mean > easy] = MASTERED
    codes[mean < hard] = UNSOLVABLE
    if rule == "mixed":
        flat = (codes == EDGE) & np.asarray(zero_spread, dtype=bool)
        nearer_easy = (easy - mean) < (mean - hard)
        codes[flat & nearer_easy] = MASTERED
        codes[flat & ~nearer_easy] = UNSOLVABLE
    return codes
