"""Streaming rewards: a group is scored as soon as its n trajectories are complete, while the
other groups are still generating. The trainer submits groups from the generator's callback:
`HFEngine.generate(on_group_done=...)` for single-turn rollouts, `AgentLoop.run(on_group_done=...)`
for the agent loop (a group there is complete once all its samples have ended and been answered).

Generation runs on the caller's thread; scoring runs on a background thread that owns an
asyncio event loop, so the judges' HTTP calls of finished groups are in flight while the model
keeps decoding (torch releases the GIL in its kernels). Rule rewards of a group are computed on
that thread too, off the decode loop. `finish()` waits for what is still being scored and
returns the scorings' tallies (`Finished.metrics`: errors, judge calls; the batch's reward
means are the step's to write, over the groups it keeps: `batch_summary`), plus how much of the
reward work was hidden behind generation:

    reward_s   wall time the step waited for rewards after generation ended (time/reward)
    span_s     first group submitted -> last group scored
    hidden_s   wall time before generation ended during which some group was being scored (the
               union of the groups' submitted -> scored intervals): an agent group scored
               early, then nothing until the last turn, counts only its own scoring time
               (time/reward_hidden)
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from grouprl.rewards.composite import CompositeReward
from grouprl.rollout.trajectory import Trajectory

# metrics that are counts: summed over groups (everything else of a group is a mean over it)
_COUNT_SUFFIXES = ("/calls", "/requests", "/cache_hits", "/retries", "/failures")

def _is_count(key: str) -> bool:
    return key.startswith(("reward/errors", "reward/gated/", "reward/not_applicable/", "reward/dropped")) or key.endswith(_COUNT_SUFFIXES)

@dataclass(frozen=True)
class Finished:
    """A batch's scorings, once every group is scored: their tallies and the reward time."""

    metrics: dict[str, float]  # the groups' tallies merged (combine): counts summed, means weighted
    reward_s: float  # waited after generation ended
    span_s: float  # first group submitted -> last group scored
    hidden_s: float  # scoring time before generation ended

class StreamingRewards:
    """Scores groups in the background: `submit(group)` during generation, then `finish()`; or,
    where batches overlap (asynchronous training: one batch still being scored while the next
    generates), `open()` a `RewardBatch` per batch, each with its own submit / finish."""

    def __init__(self, reward: CompositeReward):
        self.reward = reward
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grouprl-rewards", daemon=True)
        self._thread.start()
        self._batch = RewardBatch(self)

    def open(self) -> RewardBatch:
        """A batch of groups of its own, scored on the shared background loop."""
        return RewardBatch(self)

    def submit(self, group: list[Trajectory]) -> None:
        """Start scoring one finished group (its trajectories are scored in place)."""
        self._batch.submit(group)

    def finish(self, generation_end: float | None = None) -> Finished:
        """Wait for every group submitted since the last finish; their merged tallies."""
        return self._batch.finish(generation_end)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

class RewardBatch:
    """One batch's groups on a StreamingRewards loop: submit each as it completes, then finish."""

    def __init__(self, streaming: StreamingRewards):
        self.streaming = streaming
        self._pending: list[tuple[list[Trajectory], Future]] = []
        self._intervals: list[list[float]] = []  # per group [submitted, scored] (perf_counter)

    def submit(self, group: list[Trajectory]) -> None:
        """Start scoring one finished group (its trajectories are scored in place)."""
        interval = [time.perf_counter(), math.inf]
        self._intervals.append(interval)
        future = asyncio.run_coroutine_threadsafe(self._score(group, interval), self.streaming._loop)
        self._pending.append((group, future))

    async def _score(self, group: list[Trajectory], interval: list[float]) -> dict[str, float]:
        try:
            return await self.streaming.reward.ascore(group)
        finally:
            interval[1] = time.perf_counter()

    def finish(self, generation_end: float | None = None) -> Finished:
        """Wait for every submitted group; this batch's merged tallies and reward time.
        `generation_end` (perf_counter) is when generation finished, for the hidden time."""
        generation_end = time.perf_counter() if generation_end is None else generation_end
        parts = [(len(group), future.result()) for group, future in self._pending]  # a component's fault is already a fallback
        done = time.perf_counter()
        intervals = sorted((start, min(end, done)) for start, end in self._intervals)
        first = intervals[0][0] if intervals else done
        self._pending, self._intervals = [], []
        return Finished(
            metrics=combine(parts),
            reward_s=max(0.0, done - generation_end),
            span_s=max((end for _, end in intervals), default=first) - first,
            hidden_s=_covered(intervals, generation_end),
        )

def combine(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Reward metrics of several parts (groups, ranks) as one, from (weight, metrics) pairs:
    counts summed, the rest means weighted by `weight` (the part's trajectories) where the part
    has a value (not NaN). Every key of any part is kept; one no part has a value for is NaN."""
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    for weight, metrics in parts:
        for key, value in metrics.items():
            totals.setdefault(key, 0.0)
            weights.setdefault(key, 0.0)
            if _is_count(key):
                totals[key] += value
            elif not math.isnan(value):
                totals[key] += value * weight
                weights[key] += weight
    return {k: v if _is_count(k) else v / weights[k] if weights[k] else math.nan for k, v in totals.items()}

def _covered(intervals: list[tuple[float, float]], until: float) -> float:
    """Length of the union of sorted (start, end) intervals, cut at `until`."""
    total, reach = 0.0, -math.inf
    for start, end in intervals:
        start, end = max(start, reach), min(end, until)
        if end > start:
            total += end - start
        reach = max(reach, end)
    return total

def batch_summary(trajectories: list[Trajectory]) -> dict[str, float]:
    """reward/<component>, reward/mean and reward/std (population) over `trajectories`; NaN
    rewards (a judge that failed under on_failure=drop_group) are left out of the means. Sums are
    exactly rounded (math.fsum), so the figures do not depend on the order the groups came in
    (streamed as they finish, or in batch order)."""
    if not trajectories:
        return {}
    out = {}
    for name in trajectories[0].rewards:
        out[f"reward/{name}"] = _mean([t.rewards[name] for t in trajectories if not math.isnan(t.rewards[name])])
    rewards = [t.reward for t in trajectories if not math.isnan(t.reward)]
    mean = _mean(rewards)
    out["reward/mean"] = mean
    out["reward/std"] = math.sqrt(_mean([(r - mean) ** 2 for r in rewards])) if rewards else math.nan
    return out

def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan
