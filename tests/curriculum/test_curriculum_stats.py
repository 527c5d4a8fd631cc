"""Per-uid statistics, bucket rules and orders on hand-worked examples."""

import math
import random
import statistics

import numpy as np
import pytest

from grouprl.curriculum.buckets import EDGE, MASTERED, UNSOLVABLE, assign_buckets, check_thresholds
from grouprl.curriculum.order import curriculum_order
from grouprl.curriculum.stats import pearson, uid_stats
from grouprl.errors import ConfigError

# scores per uid, records interleaved as a log would hold them
GROUPS = {
    "a": [1.0, 0.5, 0.5, 0.0],
    "b": [0.25, 0.25],
    "c": [0.75],
    "d": [0.875, 1.0, 0.75, 1.0],
}


def interleaved(groups):
    uids = list(groups)
    records = [(u, s) for k in range(4) for u in uids for i, s in enumerate(groups[u]) if i == k]
    codes = np.array([uids.index(u) for u, _ in records])
    scores = np.array([s for _, s in records])
    return uids, codes, scores


def test_statistics_worked_by_hand():
    uids, codes, scores = interleaved(GROUPS)
    stats = uid_stats(uids, codes, scores, easy=0.75, hard=0.25)
    assert stats.uids == ["a", "b", "c", "d"]
    assert stats.n.tolist() == [4, 2, 1, 4]
    assert stats.mean.tolist() == [0.5, 0.25, 0.75, 0.90625]
    # a: deviations .5 0 0 -.5 -> var .125; d: squares of (-1, 3, -5, 3)/32 sum to 44/1024 over 4
    assert stats.std[0] == pytest.approx(math.sqrt(0.125), abs=1e-15)
    assert stats.std[3] == pytest.approx(math.sqrt(44 / 1024 / 4), abs=1e-15)
    assert stats.std[1] == 0.0 and stats.std[2] == 0.0
    assert stats.min.tolist() == [0.0, 0.25, 0.75, 0.75]
    assert stats.max.tolist() == [1.0, 0.25, 0.75, 1.0]
    assert stats.pass_rate.tolist() == [0.25, 0.0, 1.0, 1.0]  # >= easy (0.75) counts
    assert stats.pass_any.tolist() == [True, False, True, True]
    assert stats.mixed.tolist() == [True, False, False, False]  # some >= easy and some <= hard
    assert stats.zero_spread.tolist() == [False, True, True, False]


def test_mean_of_equal_scores_is_exact_so_thresholds_hold():
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004; its naive mean would be just above the threshold
    stats = uid_stats(["x"], np.zeros(3, dtype=np.int64), np.full(3, 0.1), easy=0.7, hard=0.1)
    assert stats.mean[0] == 0.1 and stats.std[0] == 0.0
    assert assign_buckets(stats.mean, stats.zero_spread, easy=0.7, hard=0.1).tolist() == [EDGE]


def test_statistics_match_a_reference_loop():
    rng = random.Random(3)
    groups = {
        f"u{i}": [rng.choice([0.0, 0.25, 0.3, 0.7, 1.0]) for _ in range(rng.randint(1, 7))]
        for i in range(200)
    }
    uids = list(groups)
    records = [(u, s) for u in uids for s in groups[u]]
    rng.shuffle(records)
    codes = np.array([uids.index(u) for u, _ in records])
    scores = np.array([s for _, s in records])
    stats = uid_stats(uids, codes, scores, easy=0.7, hard=0.25)
    order = {u: i for i, u in enumerate(stats.uids)}
    for u, values in groups.items():
        i = order[u]
        assert stats.n[i] == len(values)
        assert stats.mean[i] == pytest.approx(statistics.fmean(values), abs=1e-12)
        assert stats.std[i] == pytest.approx(statistics.pstdev(values), abs=1e-12)
        assert stats.pass_rate[i] == sum(v >= 0.7 for v in values) / len(values)
        assert stats.mixed[i] == (any(v >= 0.7 for v in values) and any(v <= 0.25 for v in values))


def test_uids_without_records_are_left_out():
    stats = uid_stats(["a", "b", "c"], np.array([2, 0, 2]), np.array([1.0, 0.5, 0.0]), easy=0.7, hard=0.1)
    assert stats.uids == ["a", "c"] and stats.mean.tolist() == [0.5, 0.5]


# ---------------------------------------------------------------------------- buckets
MEANS = np.array([0.5, 0.25, 0.75, 0.90625, 0.2, 0.5])
FLAT = np.array([False, True, True, False, True, True])


def test_mean_rule_boundaries_are_edge():
    codes = assign_buckets(MEANS, FLAT, easy=0.75, hard=0.25, rule="mean")
    assert codes.tolist() == [EDGE, EDGE, EDGE, MASTERED, UNSOLVABLE, EDGE]


def test_mixed_rule_moves_flat_edge_prompts_to_the_nearer_bucket():
    codes = assign_buckets(MEANS, FLAT, easy=0.75, hard=0.25, rule="mixed")
    # 0.25 flat: 0.5 from easy, 0 from hard -> unsolvable; 0.75 flat -> mastered;
    # 0.5 flat is equally far from both -> unsolvable (only strictly nearer easy is mastered)
    assert codes.tolist() == [EDGE, UNSOLVABLE, MASTERED, MASTERED, UNSOLVABLE, UNSOLVABLE]


def test_threshold_checks():
    with pytest.raises(ConfigError, match=r"hard \(0.8\) is above easy \(0.7\)"):
        check_thresholds(0.7, 0.8)
    with pytest.raises(ConfigError, match="finite"):
        check_thresholds(float("nan"), 0.1)
    with pytest.raises(ConfigError, match="rule must be one of mean, mixed"):
        check_thresholds(0.7, 0.1, "median")
    check_thresholds(0.5, 0.5)  # a single-value edge is allowed
    with pytest.raises(ConfigError):
        assign_buckets(MEANS, FLAT, easy=0.1, hard=0.7)


# ---------------------------------------------------------------------------- orders
UIDS = ["d", "b", "a", "c", "e"]
ORDER_MEANS = np.array([0.5, 0.7, 0.5, 0.2, 0.7])


def test_easy_to_hard_and_hard_to_easy_break_ties_by_uid():
    assert curriculum_order(UIDS, ORDER_MEANS, "easy-to-hard").tolist() == [1, 4, 2, 0, 3]  # b e a d c
    assert curriculum_order(UIDS, ORDER_MEANS, "hard-to-easy").tolist() == [3, 2, 0, 1, 4]  # c a d b e


def test_spread_deals_one_prompt_per_stratum_into_each_batch():
    # easy-first b e a d c, two strata [b e a] [d c] -> b d e c a
    assert curriculum_order(UIDS, ORDER_MEANS, "spread", batch_size=2).tolist() == [1, 0, 4, 3, 2]
    uids = [f"u{i}" for i in range(7)]
    means = np.linspace(0.9, 0.3, 7)  # already easy-first
    order = curriculum_order(uids, means, "spread", batch_size=3).tolist()
    assert order == [0, 3, 5, 1, 4, 6, 2]  # strata [0 1 2] [3 4] [5 6]
    # a batch at least as large as the bucket: nothing to interleave
    assert curriculum_order(uids, means, "spread", batch_size=10).tolist() == list(range(7))


def test_random_order_is_seeded_and_independent_of_input_order():
    uids = [f"u{i:02d}" for i in range(20)]
    means = np.zeros(20)
    first = [uids[i] for i in curriculum_order(uids, means, "random", seed=5)]
    assert sorted(first) == uids
    assert first == [uids[i] for i in curriculum_order(uids, means, "random", seed=5)]
    shuffled = uids[::-1]
    assert [shuffled[i] for i in curriculum_order(shuffled, means, "random", seed=5)] == first
    assert [uids[i] for i in curriculum_order(uids, means, "random", seed=6)] != first


def test_order_checks_and_empty_input():
    assert curriculum_order([], np.array([]), "spread").tolist() == []
    with pytest.raises(ConfigError, match="order must be one of"):
        curriculum_order(UIDS, ORDER_MEANS, "shortest-first")
    with pytest.raises(ConfigError, match="batch size"):
        curriculum_order(UIDS, ORDER_MEANS, "spread", batch_size=0)


def test_pearson_against_statistics_correlation():
    x = np.array([1.0, 2.0, 3.0, np.nan, 5.0])
    y = np.array([2.0, 4.0, 7.0, 1.0, np.nan])
    assert pearson(x, y) == pytest.approx(statistics.correlation([1, 2, 3], [2, 4, 7]), abs=1e-12)
    assert pearson(np.array([1.0, 1.0]), np.array([0.0, 1.0])) is None  # no spread: undefined
    assert pearson(np.array([1.0]), np.array([2.0])) is None
