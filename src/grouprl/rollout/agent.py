"""The multi-turn agent loop: the policy searches (and crops) for up to `max_turns` turns, a
frozen generator answers, and only the policy's own tokens are trained.

One turn, for every trajectory still running, batched:
  generate until the closing tag of an action -> parse the action -> run the turn's tool calls
  concurrently -> append the observation -> trajectories that finished leave the batch.

Group replication happens before the loop: there is one `AgentState` per trajectory (B x n),
nothing is indexed by the B prompts, so a state can never be looked up out of range.

Token layout of one trajectory, loss mask under each piece; ids are appended, never
re-tokenized from text:

  prompt_ids | segment_1 | observation_1 | segment_2 | ... | segment_k | answer
                   1            0              1                 1          0

An observation is the chat template's own rendering of the end of the assistant turn, the
observation message and the next generation prompt (see chat.py). The answer is written by a
frozen generator after <search_complete> (answer.py), or by the policy itself as its last
action when `answer_generator` is none (then it is a policy segment, mask 1).

Trajectory.finish_reason: "complete" (<search_complete>, then the frozen answer), "answer" (the
policy answered itself), or "length" when it never finished (out of turns or of
`max_response_tokens`; `truncated` is then true, the turn record says which, and
`on_unfinished` decides whether the frozen generator still answers).

With `reuse_kv_cache` every trajectory keeps its KV cache between turns (the hf engine's
KVSession) and a turn prefills only the observation; without it each turn re-prefills the
conversation. The loop talks to the engine interface only (rollout/engines/base.py).

Trajectories that end in a turn are answered together at the end of that turn (a remote
generator on a worker thread, its answers written when they have arrived, while later turns
generate). A group whose n trajectories are all final is handed to `on_group_done` right away,
so its rewards can be scored while the other groups are still searching.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from grouprl.config import AgentConfig
from grouprl.data.prompts import encode_prompt
from grouprl.data.sample import Sample
from grouprl.rollout.actions import STOP_STRINGS, Action, parse_action
from grouprl.rollout.agent_prompts import LAST_TURN, correction, protocol_prompt, with_protocol
from grouprl.rollout.answer import (
    AnswerGenerator,
    AnswerRequest,
    AnswerResult,
    OpenAIAnswerGenerator,
    build_answer_generator,
)
from grouprl.rollout.chat import ChatRenderer
from grouprl.rollout.engines.base import Generation, RolloutEngine, SamplingParams
from grouprl.rollout.observation_fit import check_limit, clipped_observation, fit_images, fixed_tokens
from grouprl.rollout.tools.base import AgentState, Observation, Tool
from grouprl.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

RECORD_CHARS = 300  # turn records keep this much of an argument or observation

GroupCallback = Callable[[int, list[Trajectory]], None]


@dataclass
class _Rollout:
    """One trajectory under construction."""

    state: AgentState
    trajectory: Trajectory
    text: list[str] = field(default_factory=list)  # response text pieces, observations marked
    evidence: list[str] = field(default_factory=list)  # successful tool observations, for the answer
    needs_answer: bool = False
    final: bool = False  # nothing will be appended any more (answer written when one was due)

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


class AgentLoop:
    """Runs the agent protocol over a batch of prompts (see the module docstring).

    engine: the policy's rollout engine. tools: action tag -> Tool (e.g. {"search": ..., "bbox": ...}).
    answer_generator: writes <answer> after <search_complete>; None = the one `cfg.answer_generator`
    names (built here). With `answer_generator: none` the policy answers itself.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        tools: dict[str, Tool],
        cfg: AgentConfig,
        answer_generator: AnswerGenerator | None = None,
        vision: Any = None,
    ):
        """`vision`: a VLM policy's processor (grouprl.vision VisionProcessor): observation
        images (retrieved pages, crops) are shown to it as images in the next user turn."""
        self.engine = engine
        self.vision = vision
        self.tokenizer = tokenizer
        self.tools = tools
        self.cfg = cfg
        self.self_answer = cfg.answer_generator == "none"
        if answer_generator is None and not self.self_answer:
            answer_generator = build_answer_generator(cfg, engine)
        self.answer_generator = None if self.self_answer else answer_generator
        self.chat = ChatRenderer(tokenizer, cfg.observation_role)
        check_limit(tokenizer, cfg)
        self.system_prompt = protocol_prompt("none" if self.self_answer else "frozen", cfg.system_prompt)
        self.stats: dict[str, float] = {}  # the last run's counts, as metrics
        # called before each turn's generation: the policy version of the weights the turn
        # samples from (asynchronous training may push newer weights between turns: a partial
        # rollout), or None; recorded in each turn's record
        self.before_turn: Callable[[], int | None] | None = None
        self._answer_pool: concurrent.futures.ThreadPoolExecutor | None = None  # remote answer calls

    def encode_prompts(self, samples: list[Sample]) -> list[list[int]]:
        """Prompt ids with the protocol system prompt in front of each sample's messages."""
        return [encode_prompt(self.tokenizer, with_protocol(s.messages, self.system_prompt)) for s in samples]

    def run(
        self,
        samples: list[Sample],
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        on_group_done: GroupCallback | None = None,
        images: list[list] | None = None,
    ) -> list[Trajectory]:
        """n trajectories per prompt, prompt-major (prompt 0 samples 0..n-1, prompt 1 ...).
        params.max_new_tokens bounds each turn. `on_group_done(i, group)` gets prompt i's n
        trajectories, once, as soon as all of them are final (answer written), on the calling
        thread, while other groups may still be running; they are the objects returned at the
        end and are not changed after the call. `images[i]`: prompt i's processed images."""
        return asyncio.run(self.arun(samples, prompts, n, params, generator, on_group_done, images))

    async def arun(
        self, samples, prompts, n, params, generator=None, on_group_done=None, images=None
    ) -> list[Trajectory]:
        rollouts = [
            _Rollout(
                AgentState(sample=samples[i], index=j),
                Trajectory(
                    sample=samples[i],
                    index=j,
                    prompt_ids=prompts[i],
                    rollout_log_probs=[],
                    prompt_images=list(images[i]) if images else [],
                ),
            )
            for i in range(len(samples))
            for j in range(n)
        ]
        turn_params = replace(params, stop=list(dict.fromkeys([*params.stop, *STOP_STRINGS])))
        with_images = {"images": images} if self.vision is not None else {}
        session = self.engine.open_session(prompts, n, reuse_cache=self.cfg.reuse_kv_cache, **with_images)
        prefill_before = self.engine.prefill_tokens
        active = list(range(len(rollouts)))
        new_tokens: list[list[int]] = [[] for _ in rollouts]  # appended since the row's last turn
        new_images: list[list] = [[] for _ in rollouts]  # the images among them (VLM policies)
        groups = _Groups(rollouts, n, on_group_done)
        answering: list[_Answering] = []  # remote answer calls in flight

        for turn in range(self.cfg.max_turns):
            if not active:
                break
            fed = {"new_images": [new_images[k] for k in active]} if self.vision is not None else {}
            version = self.before_turn() if self.before_turn is not None else None
            generations = session.generate(active, [new_tokens[k] for k in active], turn_params, generator, **fed)
            answering = self._settle(answering, groups)
            actions = [parse_action(g.text) for g in generations]
            for k, g in zip(active, generations):
                rollouts[k].append(g.token_ids, 1, g.text, g.log_probs)
            # every tool call of the turn at once: searches wait on I/O, not on each other
            observations = await asyncio.gather(*(self._act(rollouts[k], a) for k, a in zip(active, actions)))

            still_active, ended = [], []
            for k, g, action, obs in zip(active, generations, actions, observations):
                r = rollouts[k]
                r.state.turn += 1
                r.trajectory.turns.append(_turn_record(turn, g, action, obs, version, r.state))
                if r.trajectory.version is None:
                    r.trajectory.version = version
                if r.state.finished:
                    session.release(k)
                    ended.append(r)
                    continue
                if turn == self.cfg.max_turns - 1:
                    self._unfinished(r, "max_turns")
                    session.release(k)
                    ended.append(r)
                    continue
                ids, text, shown = self._observation(
                    obs, g, next_is_last=turn + 1 == self.cfg.max_turns - 1, state=r.state, action=action
                )
                budget = self.cfg.max_response_tokens
                if budget and len(r.trajectory.response_ids) + len(ids) >= budget:
                    self._unfinished(r, "length")
                    session.release(k)
                    ended.append(r)
                    continue
                r.append(ids, 0, f"\n<observation>\n{text}\n</observation>\n")
                r.trajectory.response_images.extend(shown)
                r.trajectory.turns[-1]["masked_tokens"] = len(ids)
                if "page" in r.trajectory.turns[-1]:  # a search's page: the size the processor showed it at
                    r.trajectory.turns[-1]["page_size"] = list(r.state.current_image_size)
                new_tokens[k], new_images[k] = ids, shown
                still_active.append(k)
            active = still_active
            answering += await self._answer(ended, groups)

        for batch, future in answering:
            self._write_answers(batch, await asyncio.wrap_future(future), groups)
        self.stats = _stats(rollouts, self.engine.prefill_tokens - prefill_before)
        return [r.trajectory for r in rollouts]

    # ------------------------------------------------------------------ one turn
    async def _act(self, r: _Rollout, action: Action) -> Observation | None:
        """Carry out a turn's action: an observation to show next, or None when it ended the trajectory."""
        state = r.state
        if action.multiple:
            state.count_error("multiple_actions")  # the first action is taken
        if not action.valid:
            state.count_error(action.error)
            return Observation(correction(action.error, action.kind or ""), error=action.error)
        if action.kind == "search_complete":
            if self.self_answer:
                return Observation(correction("answer_required"))
            state.finished, state.finish_reason = True, "complete"
            r.trajectory.finish_reason, r.needs_answer = "complete", True
            return None
        if action.kind == "answer":
            if not self.self_answer:
                state.count_error("answer_not_allowed")
                return Observation(correction("answer_not_allowed"), error="answer_not_allowed")
            state.finished, state.finish_reason = True, "answer"
            r.trajectory.finish_reason = "answer"
            return None
        tool = self.tools.get(action.kind)
        if tool is None:
            state.count_error("unknown_action")
            return Observation(correction("unknown_action", action.kind), error="unknown_action")
        try:
            obs = await tool(action.argument, state)
        except Exception as e:  # noqa: BLE001 - one broken call must not end the whole batch
            log.exception("the %s tool raised", action.kind)
            obs = Observation(f"The <{action.kind}> action failed.", error=f"{type(e).__name__}")
        if obs.error:
            state.count_error(f"{action.kind}_error")
        else:
            r.evidence.append(obs.text)
        return obs

    def _observation(
        self, obs: Observation, g: Generation, next_is_last: bool, state: AgentState | None = None, action=None
    ) -> tuple[list[int], str, list]:
        """Token ids (template rendering), text and images (processed, for a VLM policy) of the
        observation that follows a segment, within agent.max_observation_tokens, its images'
        tokens and the template's included (observation_fit.py). A VLM sees the observation's
        images before its text; the page a search shows is what <bbox> coordinates refer to, at
        the size the processor gave it."""
        last = "\n\n" + LAST_TURN["answer" if self.self_answer else "complete"] if next_is_last else ""
        closing = g.token_ids[-1] if g.finish_reason == "eos" and g.token_ids else None
        limit = self.cfg.max_observation_tokens
        shown = [self.vision.prepare_image(image) for image in obs.images] if self.vision is not None else []
        if limit and shown:
            text_share = min(len(self.tokenizer(obs.text, add_special_tokens=False)["input_ids"]), limit // 4)
            budget = limit - fixed_tokens(self.chat, last, closing) - text_share
            fitted = fit_images(self.vision, obs.images, shown, budget)
            if state is not None and len(fitted) < len(shown):
                state.count_error("observation_images_left_out")
            shown = fitted
        if shown and state is not None and action is not None and action.kind == "search":
            state.current_image_size = shown[0].shown_size
        expand = self.vision.encode_text if self.vision is not None else None
        placed, ids = clipped_observation(self.chat, self.tokenizer, obs.text, last, closing, shown, expand, limit)
        return ids, placed, shown

    def _unfinished(self, r: _Rollout, reason: str) -> None:
        """Out of turns or tokens: flagged truncated; the frozen generator may still answer."""
        r.state.finished, r.state.finish_reason = True, reason
        r.trajectory.finish_reason = "length"
        r.needs_answer = not self.self_answer and self.cfg.on_unfinished == "answer"
        r.trajectory.turns[-1]["unfinished"] = reason

    # ------------------------------------------------------------------ the frozen answer
    async def _answer(self, ended: list[_Rollout], groups: _Groups) -> list[_Answering]:
        """Answer the trajectories that ended this turn in one call; those that need no answer
        are final now. A local generator answers here (it shares the device with the policy);
        a remote one answers on a worker thread while the next turns generate: its call is
        returned, to be written by `_settle`."""
        due = [r for r in ended if r.needs_answer and self.answer_generator is not None]
        groups.final([r for r in ended if not (r.needs_answer and self.answer_generator is not None)])
        if not due:
            return []
        requests = [AnswerRequest(_question(r.state.sample), r.evidence) for r in due]
        if isinstance(self.answer_generator, OpenAIAnswerGenerator):
            if self._answer_pool is None:
                self._answer_pool = concurrent.futures.ThreadPoolExecutor(2, "grouprl-answers")
            return [(due, self._answer_pool.submit(asyncio.run, self.answer_generator.answer(requests)))]
        self._write_answers(due, await self.answer_generator.answer(requests), groups)
        return []

    def _settle(self, answering: list[_Answering], groups: _Groups) -> list[_Answering]:
        """Write the remote answers that have arrived; the calls still out."""
        out = []
        for batch, future in answering:
            if future.done():
                self._write_answers(batch, future.result(), groups)
            else:
                out.append((batch, future))
        return out

    def _write_answers(self, rollouts: list[_Rollout], results: list[AnswerResult], groups: _Groups) -> None:
        for r, result in zip(rollouts, results):
            record = {"turn": r.state.turn, "action": "answer", "generator": self.cfg.answer_generator}
            if result.error:
                r.state.count_error("answer_error")
                ids = self.chat.observation_ids(result.error)
                r.append(ids, 0, f"\n<observation>\n{result.error}\n</observation>\n")
                record.update(
                    argument="", observation=result.error, error="answer_error", masked_tokens=len(ids)
                )
            else:
                ids = self.tokenizer("\n" + result.text, add_special_tokens=False)["input_ids"]
                r.append(ids, 0, "\n" + result.text)
                record.update(
                    argument=result.text[:RECORD_CHARS], observation="", error=None, masked_tokens=len(ids)
                )
            record["tokens"] = 0
            r.trajectory.turns.append(record)
        groups.final(rollouts)


_Answering = tuple[list["_Rollout"], concurrent.futures.Future]  # trajectories, their answer call


class _Groups:
    """Marks trajectories final and reports each group once, when its last trajectory is."""

    def __init__(self, rollouts: list[_Rollout], n: int, on_group_done: GroupCallback | None):
        self.rollouts, self.n, self.on_group_done = rollouts, n, on_group_done
        self.group_of = {id(r): k // n for k, r in enumerate(rollouts)}
        self.open = [n] * (len(rollouts) // n) if n else []  # trajectories not yet final, per group

    def final(self, rollouts: list[_Rollout]) -> None:
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


def _turn_record(
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


def _question(sample: Sample) -> str:
    """The text of the sample's last user message."""
    for message in reversed(sample.messages):
        if message.get("role") == "user":
            content = message.get("content", "")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content)
    return ""


def _stats(rollouts: list[_Rollout], prefill_tokens: int) -> dict[str, float]:
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
