"""The weighted sum of named reward components, robust to a component's failure.

A reward function written by a user must not stop a training run: one that raises, or
returns None, NaN/inf or a non-number, gets the configured fallback value and is counted
in `reward/errors` (its first failure is logged once), and training goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from grouprl.config import RewardConfig
from grouprl.errors import ConfigError
from grouprl.rewards.loader import load_reward_function
from grouprl.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

# What a reward function may ask for by parameter name; a function with **kwargs gets all.
CONTEXT_NAMES = ("response", "ground_truth", "prompt", "extra_info", "sample", "trajectory")
# Component names that would collide with the aggregate metric keys reward/mean, ...
RESERVED_NAMES = ("mean", "std", "errors")


@dataclass
class RewardComponent:
    """One named reward: `fn(**context, **kwargs)` enters the composite as `weight * value`."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    accepted: frozenset[str] | None = field(init=False, default=None)  # context fn takes; None = all

    def __post_init__(self) -> None:
        self.accepted = _accepted_context(self.name, self.fn, self.kwargs)

    def arguments(self, context: dict[str, Any]) -> dict[str, Any]:
        chosen = context if self.accepted is None else {k: context[k] for k in self.accepted}
        return {**chosen, **self.kwargs}


def _accepted_context(name: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> frozenset[str] | None:
    """Check at construction (not mid-run) that `fn` can be called by keyword with what we pass."""
    clashes = sorted(set(kwargs) & set(CONTEXT_NAMES))
    if clashes:
        raise ConfigError(
            f"reward component {name!r}: kwargs may not set {', '.join(clashes)} (filled per trajectory)"
        )
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    keyword_names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(kwargs) - keyword_names)
    if unknown:
        raise ConfigError(f"reward component {name!r}: its function takes no argument {', '.join(unknown)}")
    missing = sorted(
        p.name
        for p in parameters
        if p.default is p.empty
        and p.kind is not p.VAR_POSITIONAL
        and (p.kind is p.POSITIONAL_ONLY or p.name not in set(CONTEXT_NAMES) | set(kwargs))
    )
    if missing:
        raise ConfigError(
            f"reward component {name!r}: required argument {', '.join(missing)} is not one of "
            f"{', '.join(CONTEXT_NAMES)} nor set in its kwargs"
        )
    return frozenset(keyword_names & set(CONTEXT_NAMES))


def _prompt_text(messages: list[dict[str, Any]]) -> str:
    """The last user turn's text; multimodal content lists keep only their text parts."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content", "")
            if isinstance(content, list):
                return "".join(part.get("text", "") for part in content if isinstance(part, dict))
            return str(content)
    return ""


def _context(trajectory: Trajectory) -> dict[str, Any]:
    sample = trajectory.sample
    return {
        "response": trajectory.response_text,
        "ground_truth": sample.ground_truth,
        "prompt": _prompt_text(sample.messages),
        "extra_info": sample.extra_info,
        "sample": sample,
        "trajectory": trajectory,
    }


def _problem_with(value: Any) -> str | None:
    """Why `value` is not a usable reward, or None when it is."""
    if isinstance(value, numbers.Real) or (getattr(value, "ndim", None) == 0 and hasattr(value, "item")):
        return None if math.isfinite(float(value)) else f"ValueError: returned {float(value)}"
    return f"TypeError: returned {type(value).__name__}, not a number"


async def _gather(awaitables: list[Awaitable[Any]]) -> list[Any]:
    return await asyncio.gather(*awaitables, return_exceptions=True)


def _run_to_completion(awaitables: list[Awaitable[Any]]) -> list[Any]:
    """Await all in one fresh event loop; from inside a running loop, in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_gather(awaitables))
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, _gather(awaitables)).result()


class CompositeReward:
    """Scores trajectories with every component and writes `rewards` and `reward` on them."""

    def __init__(self, components: list[RewardComponent], fallback: float = 0.0) -> None:
        names = [c.name for c in components]
        if not components:
            raise ConfigError("reward needs at least one component")
        if len(set(names)) != len(names):
            raise ConfigError(f"reward component names must be unique, got {names}")
        reserved = sorted(set(names) & set(RESERVED_NAMES))
        if reserved:
            raise ConfigError(f"reward component name {reserved[0]!r} is reserved for reward/{reserved[0]}")
        self.components = components
        self.fallback = float(fallback)
        self._reported: set[str] = set()  # components whose first failure was logged

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> CompositeReward:
        components = [
            RewardComponent(
                name=c.name,
                fn=load_reward_function(c.function or c.name),
                weight=float(c.weight),
                kwargs=dict(c.kwargs),
            )
            for c in cfg.components
        ]
        return cls(components, fallback=cfg.fallback)

    def score(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Score in place; return metrics. Sync components run here, async ones concurrently."""
        values, pending = self._call_components(trajectories)
        if pending:
            results = _run_to_completion([awaitable for _, _, awaitable in pending])
            self._collect(values, pending, results)
        return self._finish(trajectories, values)

    async def ascore(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """`score` for callers already inside an event loop."""
        values, pending = self._call_components(trajectories)
        if pending:
            results = await _gather([awaitable for _, _, awaitable in pending])
            self._collect(values, pending, results)
        return self._finish(trajectories, values)

    # -- steps -------------------------------------------------------------------------
    def _call_components(self, trajectories: list[Trajectory]):
        # values[t][c] is the raw value, or an error string until replaced by the fallback.
        values: list[list[Any]] = [[None] * len(self.components) for _ in trajectories]
        pending: list[tuple[int, int, Awaitable[Any]]] = []
        for t, trajectory in enumerate(trajectories):
            context = _context(trajectory)
            for c, component in enumerate(self.components):
                try:
                    result = component.fn(**component.arguments(context))
                except Exception as e:  # the function's fault: fall back, count, go on
                    values[t][c] = _Failure(f"{type(e).__name__}: {e}")
                    continue
                if inspect.isawaitable(result):
                    pending.append((t, c, result))
                else:
                    values[t][c] = result
        return values, pending

    @staticmethod
    def _collect(values: list[list[Any]], pending, results: list[Any]) -> None:
        for (t, c, _), result in zip(pending, results):
            values[t][c] = (
                _Failure(f"{type(result).__name__}: {result}") if isinstance(result, Exception) else result
            )

    def _finish(self, trajectories: list[Trajectory], values: list[list[Any]]) -> dict[str, float]:
        errors = {component.name: 0 for component in self.components}
        for trajectory, row in zip(trajectories, values):
            total = 0.0
            for component, value in zip(self.components, row):
                problem = value.message if isinstance(value, _Failure) else _problem_with(value)
                if problem is not None:
                    errors[component.name] += 1
                    self._report(component.name, problem)
                    value = self.fallback
                value = float(value)
                trajectory.rewards[component.name] = value
                total += component.weight * value
            trajectory.reward = total
        return self._metrics(trajectories, errors)

    def _report(self, name: str, problem: str) -> None:
        if name in self._reported:
            return
        self._reported.add(name)
        first_line = (problem.splitlines() or [""])[0]
        logger.warning(
            "reward component %r failed (%s); using fallback %s, later failures are only counted",
            name,
            first_line,
            self.fallback,
        )

    def _metrics(self, trajectories: list[Trajectory], errors: dict[str, int]) -> dict[str, float]:
        metrics: dict[str, float] = {"reward/errors": float(sum(errors.values()))}
        metrics.update({f"reward/errors/{name}": float(count) for name, count in errors.items()})
        if not trajectories:
            return metrics
        count = len(trajectories)
        for component in self.components:
            metrics[f"reward/{component.name}"] = sum(t.rewards[component.name] for t in trajectories) / count
        mean = sum(t.reward for t in trajectories) / count
        metrics["reward/mean"] = mean
        # population std (ddof=0): the spread of this batch, not an estimate of a wider one
        metrics["reward/std"] = math.sqrt(sum((t.reward - mean) ** 2 for t in trajectories) / count)
        return metrics


@dataclass
class _Failure:
    """A component call that raised; `message` is "ExceptionType: text"."""

    message: str
