"""Per-uid difficulty statistics over the scored records of the logs.

For a uid with agent scores x_1..x_n:
    mean, std = population std sqrt(mean((x - mean)^2)), min, max,
    pass_rate = #{x_i >= easy} / n      (pass@1 at the easy threshold)
    pass_any  = any x_i >= easy         (pass@n)
    mixed     = any x_i >= easy and any x_i <= hard
    zero_spread = max == min            (all agents scored alike: a GRPO group with zero advantage)
Computed with one sort and `reduceat`, so a million records take well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class UidStats:
    """Columnar: entry i describes uids[i]."""

    uids: list[str]
    n: np.ndarray  # int64 [U]
    mean: np.ndarray  # float64 [U]
    std: np.ndarray  # float64 [U]
    min: np.ndarray  # float64 [U]
    max: np.ndarray  # float64 [U]
    pass_rate: np.ndarray  # float64 [U]
    pass_any: np.ndarray  # bool [U]
    mixed: np.ndarray  # bool [U]

    @property
    def zero_spread(self) -> np.ndarray:
        return self.max == self.min

    def __len__(self) -> int:
        return len(self.uids)

    def take(self, index: np.ndarray) -> UidStats:
        return UidStats(
            [self.uids[i] for i in index],
            *(
                getattr(self, name)[index]
                for name in ("n", "mean", "std", "min", "max", "pass_rate", "pass_any", "mixed")
            ),
        )


def uid_stats(
    uids: list[str], codes: np.ndarray, scores: np.ndarray, *, easy: float, hard: float
) -> UidStats:
    """Statistics of every uid code that has at least one score (codes index `uids`)."""
    counts = np.bincount(codes, minlength=len(uids))
    present = np.flatnonzero(counts)  # codes with records, ascending
    order = np.argsort(codes, kind="stable")
    sorted_scores = scores[order]  # [R] grouped by code
    n = counts[present]
    starts = np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.intp)
    if len(present) == 0:
        empty = np.empty(0)
        return UidStats([], n, empty, empty, empty, empty, empty, empty.astype(bool), empty.astype(bool))
    lo = np.minimum.reduceat(sorted_scores, starts)
    hi = np.maximum.reduceat(sorted_scores, starts)
    mean = np.add.reduceat(sorted_scores, starts) / n
    # rounding can put the mean of equal scores a hair off them (3 x 0.1 -> 0.10000000000000002),
    # which would flip a bucket at a threshold: pin it inside [min, max], and exactly on equal scores
    mean = np.clip(mean, lo, hi)
    group = np.repeat(np.arange(len(present)), n)  # [R] position of each sorted record's uid
    deviation = sorted_scores - mean[group]
    std = np.sqrt(np.add.reduceat(deviation * deviation, starts) / n)
    std[lo == hi] = 0.0
    passed = sorted_scores >= easy
    pass_rate = np.add.reduceat(passed.astype(np.float64), starts) / n
    low = np.logical_or.reduceat(sorted_scores <= hard, starts)
    pass_any = np.logical_or.reduceat(passed, starts)
    return UidStats(
        [uids[c] for c in present], n.astype(np.int64), mean, std, lo, hi, pass_rate, pass_any, pass_any & low
    )


def pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson correlation over pairs where both are finite; None when undefined."""
    both = np.isfinite(x) & np.isfinite(y)
    if both.sum() < 2:
        return None
    x, y = x[both] - x[both].mean(), y[both] - y[both].mean()
    denominator = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / denominator) if denominator > 0 else None
