"""What passes between the two halves of a training step (step.py): a step's groups, scored
(`StepBatch`, built once at the end of Collector.collect and never written after), and the
collector's own records while it collects (`Pending`, `Generated`, `Settled`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grouprl.data import Sample
from grouprl.rollout.trajectory import Trajectory


@dataclass(frozen=True)
class Group:
    """One drawn prompt and its n trajectories."""

    place: int | None  # its place in the step's whole batch (over every rank); None: a pad
    sample: Sample
    prompt: list[int]
    trajectories: list[Trajectory]  # n, in sample order


@dataclass(frozen=True)
class Loaded:
    """How an asynchronous batch's weights reached the generation copy (the pipeline measures it)."""

    waited: float  # seconds generation waited for the version it samples from
    push: float  # seconds the weights took into the copy (and into an engine's own copy, vLLM's)


@dataclass(frozen=True)
class StepBatch:
    """This rank's groups of one step, scored: what collect hands learn, built once at the end
    of collect and never written after."""

    step: int  # steps done before this one (the sampling streams are keyed by it)
    version: int  # the policy version (updates done) whose weights sampled it
    groups: list[Group]  # batch order; pads (zero-mask copies that keep the ranks' shares equal) last
    dropped_groups: int  # groups a failed judge took out, over every rank
    reward_errors: int  # this rank's reward component failures (fallback values used)
    metrics: Mapping[str, float]  # what collecting measured (read-only)
    started: float  # perf_counter when collecting began
    pushed_before: float | None = None  # the engine's push seconds then (synchronous, an engine with its own weights)
    loaded: Loaded | None = None  # asynchronous: how its weights reached the generation copy

    @property
    def trajectories(self) -> list[Trajectory]:
        """Every row the update takes, pads included."""
        return [t for g in self.groups for t in g.trajectories]

    @property
    def real_groups(self) -> list[Group]:
        """The groups without the pads."""
        return [g for g in self.groups if g.place is not None]

    @property
    def real_trajectories(self) -> list[Trajectory]:
        """The trajectories without the pads."""
        return [t for g in self.real_groups for t in g.trajectories]

    @property
    def places(self) -> list[int]:
        """Each real group's place in the step's whole batch."""
        return [g.place for g in self.real_groups]


@dataclass(frozen=True)
class Learned:
    """What learn hands back for the logs: its metrics (this rank's, read-only), each real
    trajectory's advantage in batch order (advantages live in the update's tensors, not in the
    trajectories), and the optimizer steps it skipped."""

    metrics: Mapping[str, float]
    advantages: tuple[float, ...]
    skipped_steps: int


NOT_LEARNED = Learned(metrics={}, advantages=(), skipped_steps=0)  # a step whose groups were all dropped


@dataclass
class Generated:
    """One rollout's trajectories, their rewards in flight (`stream`) or still to be taken."""

    trajectories: list[Trajectory]
    stream: Any  # rewards.streaming.RewardBatch, or None (scored when the batch is finished)
    start: float  # perf_counter: generation began / ended
    end: float
    stats: dict[str, float]  # the rollout's own figures (runner.stats)


@dataclass
class Settled:
    """A step's groups once scored: judge failures, dropped groups and filtering done."""

    groups: list[Group]  # this rank's, pads last
    dropped_groups: int
    metrics: dict[str, float]


@dataclass
class Pending:
    """A step's batch between Collector.start and Collector.finish (the collector's own record,
    written while it collects; finish turns it into the StepBatch)."""

    step: int
    version: int
    groups: list[Group]  # this rank's drawn groups (no trajectories yet)
    started: float
    pushed_before: float | None
    loaded: Loaded | None
    epoch: float = 0.0  # the sampler's epoch at the draw
    rollouts: int = 0  # rollouts of this step so far (a refill samples from new streams)
    generated: Generated | None = None
    settled: Settled | None = None  # dynamic filtering settles the batch in start


def staleness(step: int, version: int, trajectories: list[Trajectory], loaded: Loaded) -> dict[str, float]:
    """How old an asynchronous batch's samples are at the update of `step`, and the wait for them."""
    ages = [step - (t.version if t.version is not None else version) for t in trajectories]
    turn_versions = [turn["version"] for t in trajectories for turn in t.turns if "version" in turn]
    out = {
        "rollout/staleness_mean": sum(ages) / max(len(ages), 1),
        "rollout/staleness_max": float(max(ages, default=0)),
        "rollout/policy_version": float(version),
        "time/wait_weights": loaded.waited,
    }
    if turn_versions:  # partial rollouts: turns that took newer weights than their first
        out["rollout/turn_versions"] = float(len(set(turn_versions)))
    return out
