"""What the agent loop keeps per trajectory and writes about it: the trajectory under
construction (`Rollout`), the groups handed over as they complete (`Groups`), a turn's record and
the loop's counts."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grouprl.data.sample import Sample
from grouprl.rollout.actions import Action
from grouprl.rollout.engines.base import Generation
from grouprl.rollout.tools.base import AgentState, Observation
from grouprl.rollout.trajectory import Trajectory

RECORD_CHARS = 300  # turn records keep this much of an argument or observation

GroupCallback = Callable[[int, list[Trajectory]], None]


@dataclass
class Rollout:
    """One trajectory under construction."""

    state: AgentState
    trajectory: Trajectory
    text: list[str] = field(default_factory=list)  # response text pieces, observations marked
    evidence: list[str] = field(default_factory=list)  # successful tool observations, for the answer
    needs_answer: bool = False
    final: bool = False  # nothing will be appended any more (answer written when one was due)
    released: bool = False  # its row in the engine's session is dropped

    def append(self, ids: list[int], mask: int, text: str, log_probs: list[float] | None = None) -> None:
        """Append tokens; `log_probs` are the engine's for a policy segment (mask 1): without
        them the trajectory has no rollout log-probs at all."""
        t = self.trajectory
        t.response_ids.extend(ids)
        t.loss_mask.extend([mask] * len(ids))
        if t.rollout_log_probs is not None:
            if mask and log_probs is None:
                t.rollout_log_probs = None
            else:
                t.rollout_log_probs.extend(log_probs if mask else [0.0] * len(ids))
        self.text.append(text)


class Groups:
    """Marks trajectories final and reports each group once, when its last trajectory is."""

    def __init__(self, rollouts: list[Rollout], n: int, on_group_done: GroupCallback | None):
        self.rollouts, self.n, self.on_group_done = rollouts, n, on_group_done
        self.group_of = {id(r): k // n for k, r in enumerate(rollouts)}
        self.open = [n] * (len(rollouts) // n) if n else []  # trajectories not yet final, per group

    def final(self, rollouts: list[Rollout]) -> None:
        completed = []
        for r in rollouts:
            assert not r.final, "a trajectory is final once"
            r.final = True
            r.trajectory.response_text = "".join(r.text)
            r.trajectory.retrieved = list(r.state.retrieved_ids)
            g = self.group_of[id(r)]
            self.open[g] -= 1
            if self.open[g] == 0:
                completed.append(g)
        if self.on_group_done is not None:
            for g in sorted(completed):
                self.on_group_done(g, [r.trajectory for r in self.rollouts[g * self.n : (g + 1) * self.n]])


def turn_record(
    turn: int,
    g: Generation,
    action: Action,
    obs: Observation | None,
    version: int | None = None,
    state: AgentState | None = None,
) -> dict[str, Any]:
    record = {
        "turn": turn,
        "text": g.text[:RECORD_CHARS],  # what the policy wrote: its thoughts, then the action
        "action": action.kind,
        "argument": action.argument[:RECORD_CHARS],
        "observation": obs.text[:RECORD_CHARS] if obs else "",
        "error": action.error or (obs.error if obs else None),
        "tokens": len(g.token_ids),  # policy tokens (loss mask 1)
        "masked_tokens": 0,  # tokens appended after them with loss mask 0 (the observation)
        "finish_reason": g.finish_reason,
        "images": len(obs.images) if obs else 0,
        "image_files": [_image_name(i) for i in obs.images] if obs else [],
    }
    if version is not None:  # asynchronous training: the weights this turn sampled from
        record["version"] = version
    page = _page_of(action, obs, state)
    if page is not None:  # the page file this turn showed (search) or cropped (bbox), its shown size
        record["page"], record["page_size"] = page
    return record


def _page_of(
    action: Action, obs: Observation | None, state: AgentState | None
) -> tuple[str, list[int]] | None:
    """The page a search showed first or a crop cut from (`state.current_image`, a file), and its
    size as shown to the policy, which a `<bbox>`'s coordinates are pixels of; None otherwise."""
    if state is None or obs is None or obs.error or not obs.images or action.kind not in ("search", "bbox"):
        return None
    if not isinstance(state.current_image, (str, os.PathLike)) or state.current_image_size is None:
        return None
    return str(state.current_image), list(state.current_image_size)


def _image_name(image: Any) -> str:
    """What a log line says of an image shown to the policy: its file, or (made in memory, e.g.
    a crop or a resized page) its size."""
    if isinstance(image, (str, os.PathLike)):
        return str(image)
    size = getattr(image, "size", None)
    return f"<{size[0]}x{size[1]} image in memory>" if size else "<image in memory>"


def question(sample: Sample) -> str:
    """The text of the sample's last user message."""
    for message in reversed(sample.messages):
        if message.get("role") == "user":
            content = message.get("content", "")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content)
    return ""


def counts(rollouts: list[Rollout], prefill_tokens: int) -> dict[str, float]:
    total = max(len(rollouts), 1)
    stats = {
        "agent/turns_mean": sum(r.state.turn for r in rollouts) / total,
        "agent/finished_frac": sum(r.trajectory.finish_reason != "length" for r in rollouts) / total,
        "agent/prefill_tokens": float(prefill_tokens),
    }
    for r in rollouts:
        for kind, count in r.state.errors.items():
            stats[f"agent/errors/{kind}"] = stats.get(f"agent/errors/{kind}", 0.0) + count
    return stats
