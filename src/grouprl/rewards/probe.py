"""The dry run's check of the rewards: each rule or user reward called once on the first row
of the training data, that row's ground truth (or a short text where it has none) as the
completion, with what a run passes it (TRL's batch arguments for a TRL-style function). An
import that fails inside the function, a column the data lacks, a return that is not a number
(or, TRL-style, a list of one per completion) is one error line before any model loads, not a
run whose reward is a fallback on every call. Judges and reward models are not called (they
are services and models; the run checks them as they start)."""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from pathlib import Path
from typing import Any

from grouprl.config import judge_name, model_name
from grouprl.errors import ConfigError

PLACEHOLDER = "42"  # the completion where the row has no ground truth


def probe_rewards(cfg) -> list[str]:
    """One line per reward called (its value), or ConfigError naming the reward and what failed."""
    from grouprl.data import load_samples
    from grouprl.errors import UserError
    from grouprl.rewards.composite import RewardComponent, _context
    from grouprl.rewards.loader import load_reward_function
    from grouprl.rewards.trl_batch import TrainerState, _batch_arguments, trl_extras
    from grouprl.rollout.trajectory import Trajectory

    files = [f for f in cfg.data.train_files if Path(f).is_file()]
    if not files:
        return [f"rewards: not called ({'the training data is not on this machine' if cfg.data.train_files else 'no data file: the built-in task'})"]
    try:
        sample = load_samples(files[:1], max_samples=1)[0]
    except (UserError, IndexError) as e:  # the data's own problem: the data line says it
        return [f"rewards: not called (the first row of {files[0]} is not a sample here: {str(e)[:120]})"]
    where = f"row 1 of {files[0]}"
    completion = PLACEHOLDER if sample.ground_truth is None else str(sample.ground_truth)
    trajectory = Trajectory(sample=sample, index=0, prompt_ids=[0], response_text=completion, response_ids=[0] * len(completion))
    context = _context(trajectory)
    lines = []
    for c in cfg.reward.components:
        spec = c.function or c.name
        if judge_name(spec) or model_name(spec):
            continue
        component = RewardComponent(c.name, load_reward_function(spec), kwargs=dict(c.kwargs))
        try:
            if component.batched:
                arguments = {**_batch_arguments([context]), **component.kwargs}
                arguments.update(trl_extras(component.fn, TrainerState(), {}, {}))
                value = _settled(component.fn(**arguments))
                value = _one_of(value, f"{c.name} ({spec})")
            else:
                value = _settled(component.fn(**component.arguments(context)))
        except ConfigError:
            raise
        except Exception as e:  # the user's function: its failure is the line
            first = (str(e).splitlines() or [""])[0]
            raise ConfigError(f"reward {c.name} ({spec}) fails when called on {where} with {completion!r} as the "
                              f"completion: {type(e).__name__}: {first}") from None  # fmt: skip
        if value is not None and not (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)):
            raise ConfigError(f"reward {c.name} ({spec}) returned {type(value).__name__} {str(value)[:60]!r} on {where}: "
                              "a reward returns a finite number (TRL-style: a list of one number or None per completion)")  # fmt: skip
        lines.append(f"reward {c.name}: called once on {where}, {completion[:40]!r} as the completion: {value}")
    return lines


def _settled(result: Any) -> Any:
    if inspect.isawaitable(result):
        async def wait():
            return await result

        return asyncio.run(wait())
    return result


def _one_of(result: Any, name: str) -> Any:
    if isinstance(result, (str, bytes)) or not hasattr(result, "__len__") or len(result) != 1:
        shown = f"{len(result)} values" if hasattr(result, "__len__") and not isinstance(result, (str, bytes)) else type(result).__name__
        raise ConfigError(f"reward {name} returned {shown} for 1 completion (a TRL-style reward returns one value per completion)")
    return result[0]
