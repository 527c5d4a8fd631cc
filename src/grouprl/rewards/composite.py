"""The weighted sum of named reward components, robust to a component's failure.

A reward function written by a user must not stop a training run: one that raises, or
returns None, NaN/inf or a non-number, gets the configured fallback value and is counted
in `reward/errors` (its first failure is logged once), and training goes on.

Gates: a component with `gate: <other>` is called only where <other> scored above
`gate_threshold`; elsewhere its value is 0 and it is counted in `reward/gated/<name>` (a judge
behind a format gate costs nothing for malformed answers). Components run in stages, each
stage after the components gating it; inside a stage all async calls run concurrently.

Judges (`function: "judge:<name>"`, see grouprl.rewards.judges) return a `JudgeResult`: its
aggregate is the value, and each call is counted in `judge/<name>/{requests, cache_hits,
retries, failures, latency_s}` plus the mean of each score field, `judge/<name>/score/<field>`.
A failed judge call takes the judge's `fallback`, or with `on_failure: drop_group` the value
NaN: the trajectory's `reward` is then NaN, `groups_to_drop(trajectories)` names its group,
and `reward/dropped` counts such trajectories (means and std skip them).

A judge that stopped answering must not train a run on fallbacks: `failure_report()` tells, per
judge, the calls and failures since it was last asked and the failed calls in a row, and
`rewards_down(every rank's reports, ...)` says whether reward.max_consecutive_failures or
reward.max_failed_share was passed (the trainer then saves and stops).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import numbers
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grouprl.config import RewardConfig, judge_name, model_name, stages_of
from grouprl.errors import ConfigError
from grouprl.rewards.failures import (
    COMPONENT,
    JudgeTally,
)
from grouprl.rewards.judges.base import JudgeResult
from grouprl.rewards.judges.component import JudgeComponent
from grouprl.rewards.judges.parsing import looks_like_verdict
from grouprl.rewards.loader import load_reward_function
from grouprl.rewards.trl_batch import TrainerState, _batch_arguments, is_batched, trl_extras
from grouprl.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

# What a reward function may ask for by parameter name; a function with **kwargs gets all.
CONTEXT_NAMES = ("response", "ground_truth", "prompt", "extra_info", "sample", "trajectory")
# Component names that would collide with the aggregate metric keys reward/mean, ...
RESERVED_NAMES = ("mean", "std", "errors", "gated", "dropped", "not_applicable")


@dataclass
class RewardComponent:
    """One named reward: `fn(**context, **kwargs)` enters the composite as `weight * value`."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    gate: str = ""  # call only where this component scored > gate_threshold; else the value is 0
    gate_threshold: float = 0.0
    on_failure: str = "fallback"  # "fallback" | "drop_group" (value NaN: the group leaves the update)
    fallback: float | None = None  # None: the composite's fallback
    accepted: frozenset[str] | None = field(init=False, default=None)  # context fn takes; None = all
    batched: bool = field(init=False, default=False)  # TRL's signature: lists in, a list out

    def __post_init__(self) -> None:
        if self.on_failure not in ("fallback", "drop_group"):
            raise ConfigError(f"reward component {self.name!r}: on_failure must be fallback or drop_group")
        self.batched = is_batched(self.fn)
        self.accepted = None if self.batched else _accepted_context(self.name, self.fn, self.kwargs)

    def arguments(self, context: dict[str, Any]) -> dict[str, Any]:
        chosen = context if self.accepted is None else {k: context[k] for k in self.accepted}
        return {**chosen, **self.kwargs}


def _per_completion(result: Any, n: int) -> list[Any]:
    """A batched reward's list of values, one per completion (None: not applicable)."""
    if isinstance(result, (str, bytes)) or not hasattr(result, "__len__") or len(result) != n:
        shown = f"{len(result)} values" if hasattr(result, "__len__") and not isinstance(result, (str, bytes)) else type(result).__name__
        raise ValueError(f"returned {shown} for {n} completions (a TRL-style reward returns one value per completion)")
    return [_NOT_APPLICABLE if v is None else v for v in result]


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
    # required parameters nothing fills: every call would fail (checked with **kwargs too)
    missing = sorted(
        p.name
        for p in parameters
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and (p.kind is p.POSITIONAL_ONLY or p.name not in set(CONTEXT_NAMES) | set(kwargs))
    )
    if missing:
        raise ConfigError(
            f"reward component {name!r}: required argument {', '.join(missing)} is not one of "
            f"{', '.join(CONTEXT_NAMES)} nor set in its kwargs"
        )
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    keyword_names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(kwargs) - keyword_names)
    if unknown:
        raise ConfigError(f"reward component {name!r}: its function takes no argument {', '.join(unknown)}")
    return frozenset(keyword_names & set(CONTEXT_NAMES))


BATCHED = frozenset({"prompts", "completions", "completion_ids", "every data column (TRL's batch call)"})


def describe_components(cfg: RewardConfig) -> list[tuple[str, str, frozenset[str] | None]]:
    """Each rule or user reward as (name, spec, the context it reads; None = all of it, through
    **kwargs), its file imported and its signature checked as a run would (a one-line
    ConfigError otherwise). Judges and reward models are described elsewhere."""
    out = []
    for c in cfg.components:
        spec = c.function or c.name
        if judge_name(spec) is not None or model_name(spec) is not None:
            continue
        component = RewardComponent(name=c.name, fn=load_reward_function(spec), kwargs=dict(c.kwargs))
        out.append((c.name, spec, BATCHED if component.batched else component.accepted))
    return out


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


def _run_to_completion(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run in one fresh event loop; from inside a running loop, in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def groups_to_drop(trajectories: list[Trajectory]) -> set[str]:
    """Group ids (uids) with a NaN reward (a judge failure under on_failure: drop_group): the
    trainer leaves these whole groups out of the advantage and the update."""
    return {t.uid for t in trajectories if math.isnan(t.reward)}


def share_of_cap(cap: int, rank: int, world: int, what: str) -> int:
    """Rank `rank`'s part of a concurrency cap shared by `world` processes: the parts sum to
    `cap` (at least 1 each; a cap below the number of ranks is exceeded, with a warning)."""
    if world <= 1:
        return cap
    if cap < world and rank == 0:
        logger.warning(
            "%s: max_concurrent_requests=%d is below the number of ranks (%d); each rank sends one "
            "request at a time (%d in all)",
            what,
            cap,
            world,
            world,
        )
    return max(1, cap // world + (1 if rank < cap % world else 0))


class CompositeReward:
    """Scores trajectories with every component and writes `rewards` and `reward` on them.

    `score` (sync) and `await ascore` (inside an event loop) may be called on any subset of
    trajectories, e.g. one finished group at a time; overlapping `ascore` calls are safe and
    share each judge's concurrency cap and cache. Call `close()` when done to stop the judges.
    """

    def __init__(
        self,
        components: list[RewardComponent],
        fallback: float = 0.0,
        judges: dict[str, Any] | None = None,
        models: Any = None,
    ) -> None:
        names = [c.name for c in components]
        if not components:
            raise ConfigError("reward needs at least one component")
        if len(set(names)) != len(names):
            raise ConfigError(f"reward component names must be unique, got {names}")
        reserved = sorted(set(names) & set(RESERVED_NAMES))
        if reserved:
            raise ConfigError(f"reward component name {reserved[0]!r} is reserved for reward/{reserved[0]}")
        for c in components:
            if c.gate and c.gate not in names:
                raise ConfigError(
                    f"reward component {c.name!r}: gate {c.gate!r} is not a component ({', '.join(names)})"
                )
        self.components = components
        self.fallback = float(fallback)
        self.judges = dict(judges or {})  # judge name -> JudgeClient, closed by close()
        self.models = models  # the reward-model worker (rewards.models.ModelPool), closed by close()
        index = {name: i for i, name in enumerate(names)}
        self._gate_index = [index[c.gate] if c.gate else None for c in components]
        self._stages = [
            [index[n] for n in stage] for stage in stages_of({c.name: c.gate for c in components})
        ]
        self._reported: set[str] = set()  # components whose first failure was logged
        self._tally: dict[str, JudgeTally] = {}  # judge name (or COMPONENT + name) -> calls since failure_report()
        self._in_row: dict[str, int] = {}  # a non-judge component's failed calls in a row (run-long)
        self._tally_lock = threading.Lock()  # streaming scores on its own thread
        self.progress = TrainerState()  # where training is, for TRL-style rewards' trainer_state (the trainer sets it)

    @property
    def drops(self) -> bool:
        """Whether a failure can drop a group (a component with on_failure: drop_group)."""
        return any(c.on_failure == "drop_group" for c in self.components)

    def failure_report(self) -> dict[str, JudgeTally]:
        """Per judge, and per other component (keys `component:<name>`): the calls and failures
        scored since the last report (which this one resets), and its failed calls in a row now
        (run-long)."""
        with self._tally_lock:
            tally, self._tally = self._tally, {}
            in_row = dict(self._in_row)
        report = {key: t for key, t in tally.items() if key.startswith(COMPONENT)}
        for key, t in report.items():
            t.in_row = in_row.get(key[len(COMPONENT) :], 0)
        for c in self.components:
            if isinstance(c.fn, JudgeComponent):
                judge = c.fn.judge
                name = getattr(judge, "name", c.name)
                t = report.setdefault(name, tally.get(name, JudgeTally()))
                t.in_row = getattr(judge, "consecutive_failures", 0)
                t.error = t.error or getattr(judge, "last_error", "")  # else the last call sent that failed
        return report

    @classmethod
    def from_config(
        cls, cfg: RewardConfig, run_dir: str | Path | None = None, rank: int = 0, world: int = 1
    ) -> CompositeReward:
        """Build from config; judges log to `<run_dir>/judge.jsonl` unless their log_path is set.
        One of `world` ranks (processes) takes its share of each judge's concurrency cap (the cap
        is global) and logs to `judge.rank<r>.jsonl` beside rank 0's."""
        from grouprl.rewards.judges.client import JudgeClient

        judge_configs = {j.name: j for j in cfg.judges}
        judges: dict[str, Any] = {}
        components = []
        pool = None
        try:
            if any(model_name(c.function or c.name) for c in cfg.components):
                from grouprl.rewards.models import ModelPool

                cache = Path(run_dir) / "image_cache" if run_dir is not None else Path(".grouprl-image-cache")
                pool = ModelPool(cfg.models, cache_dir=next((m.cache_dir for m in cfg.models if m.cache_dir), cache))
            for c in cfg.components:
                spec = c.function or c.name
                name = judge_name(spec)
                extra: dict[str, Any] = {}
                if model_name(spec) is not None:
                    from grouprl.rewards.models import ModelComponent

                    fn = ModelComponent(pool, model_name(spec))
                elif name is None:
                    fn = load_reward_function(spec)
                else:
                    if name not in judge_configs:
                        raise ConfigError(
                            f"reward component {c.name!r} uses judge {name!r}, but reward.judges defines "
                            f"{', '.join(judge_configs) or 'none'}"
                        )
                    judge_cfg = judge_configs[name]
                    if name not in judges:
                        log_name = f"judge.rank{rank}.jsonl" if rank else "judge.jsonl"
                        log_path = Path(run_dir) / log_name if run_dir is not None else None
                        share = share_of_cap(judge_cfg.max_concurrent_requests, rank, world, f"judge {name!r}")
                        judge_cfg = dataclasses.replace(judge_cfg, max_concurrent_requests=share)
                        judges[name] = JudgeClient(
                            judge_cfg,
                            log_path=log_path,
                            max_consecutive_failures=cfg.max_consecutive_failures,
                        )
                    fn = JudgeComponent(judges[name], judge_cfg.image_base_path)
                    extra = {"on_failure": judge_cfg.on_failure, "fallback": judge_cfg.fallback}
                components.append(
                    RewardComponent(
                        name=c.name,
                        fn=fn,
                        weight=float(c.weight),
                        kwargs=dict(c.kwargs),
                        gate=c.gate,
                        gate_threshold=float(c.gate_threshold),
                        **extra,
                    )
                )
            return cls(components, fallback=cfg.fallback, judges=judges, models=pool)
        except BaseException:
            for judge in judges.values():
                judge.close()
            if pool is not None:
                pool.close()
            raise

    def close(self) -> None:
        for judge in self.judges.values():
            judge.close()
        if self.models is not None:
            self.models.close()
            self.models = None

    def step_metrics(self) -> dict[str, float]:
        """What the reward models did since the last call (items, batches, busy time, queue)."""
        return self.models.step_metrics() if self.models is not None else {}

    def score(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Score in place; return metrics. Async components run concurrently within a stage."""
        return _run_to_completion(self.ascore(trajectories))

    async def ascore(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """`score` for callers already inside an event loop."""
        # values[t][c]: the raw value, a _Failure, _GATED, or a JudgeResult, until _finish.
        values: list[list[Any]] = [[None] * len(self.components) for _ in trajectories]
        contexts = [_context(t) for t in trajectories]
        batched_calls: dict[str, list[str | None]] = {}  # a TRL-style component's calls: one a batch
        logged: dict[str, list[float]] = {}  # log_metric's values in this call
        for stage in self._stages:
            pending: list[tuple[int, int, Awaitable[Any]]] = []
            batches: dict[int, list[int]] = {}  # TRL-style components: their trajectories, called once
            for t, context in enumerate(contexts):
                for c in stage:
                    gate = self._gate_index[c]
                    if gate is not None and not _opens(values[t][gate], self.components[c].gate_threshold):
                        values[t][c] = _GATED
                        continue
                    component = self.components[c]
                    if component.batched:
                        batches.setdefault(c, []).append(t)
                        continue
                    try:
                        result = component.fn(**component.arguments(context))
                    except Exception as e:  # the function's fault: fall back, count, go on
                        values[t][c] = _Failure(f"{type(e).__name__}: {e}")
                        continue
                    if inspect.isawaitable(result):
                        pending.append((t, c, result))
                    else:
                        values[t][c] = result
            for c, rows in batches.items():
                component = self.components[c]
                extra: dict[str, list[Any]] = {}
                try:
                    arguments = {**_batch_arguments([contexts[t] for t in rows]), **component.kwargs}
                    arguments.update(trl_extras(component.fn, self.progress, extra, logged))
                    result = component.fn(**arguments)
                    if inspect.isawaitable(result):
                        result = await result
                    batch_values = _per_completion(result, len(rows))
                    batched_calls.setdefault(component.name, []).append(None)
                except Exception as e:  # the function's fault: every completion of the call fails (one failed call)
                    batch_values = [_Failure(f"{type(e).__name__}: {e}")] * len(rows)
                    batched_calls.setdefault(component.name, []).append(batch_values[0].message)
                for t, value in zip(rows, batch_values):
                    values[t][c] = value
                for column, logged_values in extra.items():  # log_extra: one value per completion of the call
                    for t, value in zip(rows, logged_values):
                        trajectories[t].extra[column] = value
            if pending:
                results = await _gather([awaitable for _, _, awaitable in pending])
                for (t, c, _), result in zip(pending, results):
                    values[t][c] = (
                        _Failure(f"{type(result).__name__}: {result}")
                        if isinstance(result, BaseException)
                        else result
                    )
        metrics = self._finish(trajectories, values, batched_calls)
        metrics.update({f"reward/logged/{name}": sum(v) / len(v) for name, v in logged.items() if v})
        return metrics

    # -- steps -------------------------------------------------------------------------
    def _finish(
        self, trajectories: list[Trajectory], values: list[list[Any]], batched_calls: dict | None = None
    ) -> dict[str, float]:
        errors = {component.name: 0 for component in self.components}
        gated = {c.name: 0 for c in self.components if c.gate}
        not_applicable = {c.name: 0 for c in self.components if c.batched}
        judged: dict[str, list[JudgeResult]] = {
            c.name: [] for c in self.components if isinstance(c.fn, JudgeComponent)
        }
        judge_fields: dict[str, float] = {}  # every judge's score fields
        for c in self.components:
            if isinstance(c.fn, JudgeComponent):
                judge_fields.update(getattr(getattr(c.fn.judge, "cfg", None), "fields", None) or {"score": 1.0})
        formatted = 0  # responses carrying judge-format text
        # a non-judge component's calls: None or the problem (a TRL-style one's: one a batch, from ascore)
        called: dict[str, list[str | None]] = {name: list(calls) for name, calls in (batched_calls or {}).items()}
        for trajectory, row in zip(trajectories, values):
            if judge_fields and looks_like_verdict(trajectory.response_text, judge_fields):
                formatted += 1
            total = 0.0
            for component, value in zip(self.components, row):
                if isinstance(value, DrawnImage):  # a reward model drew it: the record names the file
                    trajectory.artifacts[value.model] = value.path
                    value = value.score
                if value is _GATED:
                    gated[component.name] += 1
                    value = 0.0
                elif value is _NOT_APPLICABLE:  # a TRL-style reward's None: no value, no error
                    not_applicable[component.name] += 1
                    value = 0.0
                elif not isinstance(value, JudgeResult) and not component.batched:
                    called.setdefault(component.name, []).append(
                        value.message if isinstance(value, _Failure) else _problem_with(value)
                    )
                if isinstance(value, JudgeResult):
                    judged.setdefault(component.name, []).append(value)
                    value = value.aggregate if value.ok else _Failure(value.error or "judge failed")
                problem = value.message if isinstance(value, _Failure) else _problem_with(value)
                if problem is not None:
                    errors[component.name] += 1
                    self._report(component, problem)
                    value = self._failure_value(component)
                value = float(value)
                trajectory.rewards[component.name] = value
                total += component.weight * value
            trajectory.reward = total
            trajectory.seal()  # scored: read-only from here (rollout/trajectory.py)
        metrics = self._metrics(trajectories, errors)
        metrics.update({f"reward/gated/{name}": float(count) for name, count in gated.items()})
        metrics.update({f"reward/not_applicable/{name}": float(count) for name, count in not_applicable.items()})
        for name, results in judged.items():
            metrics.update(_judge_metrics(name, results))
        if judge_fields and trajectories:
            metrics["reward/judge_format_in_response"] = formatted / len(trajectories)
        self._count_judged(judged)
        self._count_called(called)
        return metrics

    def _count_called(self, called: dict[str, list[str | None]]) -> None:
        """Tally the other components' calls: failures, failures in a row (run-long), the first error."""
        with self._tally_lock:
            for name, problems in called.items():
                t = self._tally.setdefault(COMPONENT + name, JudgeTally())
                t.calls += len(problems)
                for problem in problems:
                    if problem is None:
                        self._in_row[name] = 0
                        continue
                    t.failures += 1
                    self._in_row[name] = self._in_row.get(name, 0) + 1
                    t.error = t.error or problem

    def _count_judged(self, judged: dict[str, list[JudgeResult]]) -> None:
        with self._tally_lock:
            for c in self.components:
                results = judged.get(c.name)
                if not results:
                    continue
                t = self._tally.setdefault(getattr(c.fn.judge, "name", c.name), JudgeTally())
                t.calls += len(results)
                failed = [r for r in results if not r.ok]
                t.failures += len(failed)
                sent = [r for r in failed if r.attempts]
                if sent or (failed and not t.error):  # the judge's own words before "not called" / bad input
                    t.error = (sent or failed)[-1].error or "judge failed"

    def _failure_value(self, component: RewardComponent) -> float:
        if component.on_failure == "drop_group":
            return math.nan
        return self.fallback if component.fallback is None else component.fallback

    def _report(self, component: RewardComponent, problem: str) -> None:
        if component.name in self._reported:
            return
        self._reported.add(component.name)
        first_line = (problem.splitlines() or [""])[0]
        outcome = (
            "its group is dropped"
            if component.on_failure == "drop_group"
            else f"using fallback {self._failure_value(component)}"
        )
        logger.warning(
            "reward component %r failed (%s); %s, later failures are only counted",
            component.name,
            first_line,
            outcome,
        )

    def _metrics(self, trajectories: list[Trajectory], errors: dict[str, int]) -> dict[str, float]:
        """This scoring's tallies (errors, dropped rewards). The batch's reward means are the
        step's to write, once, over the trajectories it keeps (streaming.batch_summary)."""
        metrics: dict[str, float] = {"reward/errors": float(sum(errors.values()))}
        metrics.update({f"reward/errors/{name}": float(count) for name, count in errors.items()})
        dropped = [t for t in trajectories if math.isnan(t.reward)]
        if dropped:
            metrics["reward/dropped"] = float(len(dropped))
            metrics["reward/dropped_groups"] = float(len(groups_to_drop(trajectories)))
        return metrics


@dataclass(frozen=True)
class DrawnImage:
    """A reward model's score of an image it drew for a trajectory, and where the image is:
    the composite writes the path into the trajectory's `artifacts` as it scores it."""

    score: float
    model: str
    path: str


def _numeric(value: Any) -> float | None:
    """A usable value as float (a successful JudgeResult counts by its aggregate), else None."""
    if isinstance(value, JudgeResult):
        return value.aggregate if value.ok else None
    if value is _GATED or value is _NOT_APPLICABLE or isinstance(value, _Failure) or _problem_with(value) is not None:
        return None
    return float(value)


def _opens(gate_value: Any, threshold: float) -> bool:
    """A gate opens on a usable value above the threshold; a failed or gated gate stays shut."""
    number = _numeric(gate_value)
    return number is not None and number > threshold


def _judge_metrics(name: str, results: list[JudgeResult]) -> dict[str, float]:
    sent = [r for r in results if r.attempts > 0]
    metrics = {
        f"judge/{name}/calls": float(len(results)),
        f"judge/{name}/requests": float(sum(r.attempts for r in results)),
        f"judge/{name}/cache_hits": float(sum(r.cached for r in results)),
        f"judge/{name}/retries": float(sum(r.retries for r in results)),
        f"judge/{name}/failures": float(sum(not r.ok for r in results)),
    }
    if sent:
        metrics[f"judge/{name}/latency_s"] = sum(r.latency_s for r in sent) / len(sent)
    fields: dict[str, list[float]] = {}
    for r in results:
        for field_name, score in r.scores.items():
            fields.setdefault(field_name, []).append(score)
    for field_name, scores in fields.items():
        metrics[f"judge/{name}/score/{field_name}"] = sum(scores) / len(scores)
    return metrics


@dataclass
class _Failure:
    """A component call that raised; `message` is "ExceptionType: text"."""

    message: str


_GATED = object()  # the value of a component whose gate stayed shut
_NOT_APPLICABLE = object()  # a TRL-style reward's None for a completion: counts 0, no error
