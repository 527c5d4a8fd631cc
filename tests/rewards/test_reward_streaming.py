"""StreamingRewards: groups scored in the background while the caller keeps working, with the
same rewards and metrics as scoring the whole batch at once."""

import asyncio
import math
import time

import pytest

from grouprl.data.sample import Sample
from grouprl.rewards.composite import CompositeReward, RewardComponent
from grouprl.rewards.streaming import StreamingRewards, _covered, batch_summary
from grouprl.rollout.trajectory import Trajectory

JUDGE_LATENCY = 0.2


async def slow_judge(response):  # an API judge: waits, then scores the response length
    await asyncio.sleep(JUDGE_LATENCY)
    return len(response) / 10


def length_parity(response):
    return float(len(response) % 2)


def batch(groups=4, n=3):
    out = []
    for g in range(groups):
        sample = Sample(uid=f"u{g}", messages=[{"role": "user", "content": "q"}])
        out.append(
            [
                Trajectory(sample=sample, index=j, prompt_ids=[1], response_text="x" * (g + j))
                for j in range(n)
            ]
        )
    return out


def reward():
    return CompositeReward(
        [
            RewardComponent("judge", slow_judge, weight=0.8),
            RewardComponent("parity", length_parity, weight=0.2),
        ]
    )


def test_groups_are_scored_while_generation_goes_on_and_match_whole_batch_scoring():
    groups = batch()
    streaming = StreamingRewards(reward())
    try:
        start = time.perf_counter()
        for group in groups:  # "generation": a group finishes every 0.1 s
            time.sleep(0.1)
            streaming.submit(group)
        generation_end = time.perf_counter()
        finished = streaming.finish(generation_end)
        waited = time.perf_counter() - generation_end
    finally:
        streaming.close()
    # the last group was submitted at the end: only its judge latency is left to wait for
    assert waited < JUDGE_LATENCY + 0.1
    assert finished.reward_s == pytest.approx(waited, abs=0.02)
    assert finished.hidden_s > 0.2  # three groups' judge calls ran during "generation"
    assert finished.span_s >= 0.3 + JUDGE_LATENCY - 0.02
    assert time.perf_counter() - start < 4 * 0.1 + JUDGE_LATENCY + 0.2  # not 4 x (0.1 + 0.2)

    expected_trajectories = [t for g in batch() for t in g]
    expected = reward().score(expected_trajectories)
    scored = [t for g in groups for t in g]
    assert [t.reward for t in scored] == pytest.approx([t.reward for t in expected_trajectories], abs=1e-12)
    # the tallies as one scoring's; the means are the batch summary's over the same trajectories
    assert finished.metrics == {k: pytest.approx(v, abs=1e-12) for k, v in expected.items()}
    assert not any(k in expected for k in ("reward/mean", "reward/std", "reward/judge"))
    summary = batch_summary(scored)
    assert summary["reward/mean"] == pytest.approx(sum(t.reward for t in scored) / len(scored), abs=1e-12)
    assert summary["reward/judge"] == pytest.approx(sum(t.rewards["judge"] for t in scored) / len(scored), abs=1e-12)


def test_counts_are_summed_over_groups():
    def fails_on_short(response):
        if len(response) < 2:
            raise ValueError("too short")
        return 1.0

    streaming = StreamingRewards(CompositeReward([RewardComponent("rule", fails_on_short)]))
    try:
        for group in batch(groups=3, n=2):  # lengths 0,1 | 1,2 | 2,3: three failures
            streaming.submit(group)
        metrics = streaming.finish().metrics
    finally:
        streaming.close()
    assert metrics["reward/errors"] == 3 and metrics["reward/errors/rule"] == 3


def test_batch_summary_leaves_nan_out():
    groups = batch(groups=1, n=3)[0]
    for t, r in zip(groups, [1.0, math.nan, 0.0]):
        t.reward, t.rewards = r, {"judge": r}
    summary = batch_summary(groups)
    assert summary == {"reward/judge": 0.5, "reward/mean": 0.5, "reward/std": 0.5}


def test_hidden_time_counts_scoring_not_the_gap_between_groups():
    """An agent batch: one group ends early and is scored, the rest end with the last turn.
    Only the early group's scoring overlaps generation, not the idle gap after it."""
    groups = batch(groups=3, n=2)
    streaming = StreamingRewards(reward())
    try:
        streaming.submit(groups[0])  # scored from 0 to ~JUDGE_LATENCY
        time.sleep(JUDGE_LATENCY + 0.4)  # later turns generate; no reward work in flight
        for group in groups[1:]:
            streaming.submit(group)
        finished = streaming.finish(time.perf_counter())
    finally:
        streaming.close()
    assert JUDGE_LATENCY - 0.01 <= finished.hidden_s <= JUDGE_LATENCY + 0.1
    assert finished.span_s >= 2 * JUDGE_LATENCY + 0.4 - 0.01
    assert finished.reward_s >= JUDGE_LATENCY - 0.01  # the last groups' judge after generation


def test_covered_is_the_union_cut_at_the_end_of_generation():
    intervals = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.6), (6.0, 7.0)]
    assert _covered(intervals, 10.0) == pytest.approx(2.0 + 1.0 + 1.0)
    assert _covered(intervals, 3.5) == pytest.approx(2.0 + 0.5)
    assert _covered(intervals, 0.25) == pytest.approx(0.25)
    assert _covered([], 5.0) == 0.0


def test_batch_summary_is_exactly_rounded_whatever_the_order():
    """The means are the exactly rounded ones (math.fsum), so groups summarised as they were
    streamed or in batch order give the same bits."""
    import random
    from fractions import Fraction

    groups = batch(groups=8, n=4)  # 32 rows: dividing the exact sum by 32 rounds nothing more
    rng = random.Random(0)
    for t in (t for g in groups for t in g):
        t.reward, t.rewards = rng.choice([0.1, 0.2, 0.7, 1.0 / 3]), {"judge": rng.random()}
    flat = [t for g in groups for t in g]
    want = batch_summary(flat)
    assert want["reward/mean"] == float(sum(Fraction(t.reward) for t in flat) / len(flat))
    for _ in range(5):
        rng.shuffle(groups)
        assert batch_summary([t for g in groups for t in g]) == want
