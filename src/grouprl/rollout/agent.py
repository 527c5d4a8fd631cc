"""The multi-turn agent loop: the policy searches (and crops) for up to `max_turns` turns, a
frozen generator answers, and only the policy's own tokens are trained.

A turn of one trajectory: generate until the closing tag of an action -> parse the action -> run
its tool call -> append the observation; the trajectory ends on <search_complete> (or <answer>),
out of turns or of its response budget. How turns are scheduled (`agent.schedule`):
- trajectory (each trajectory on its own): a trajectory's next turn is queued in the engine as
  soon as its observation is ready and joins the running batch at the next decode step
  (`Session.submit` / `step`, driven by agent_turns.TurnDriver); its tool call runs while the
  others generate. No turn waits for another trajectory's generation or tool call.
- turn (lock step): every running trajectory's turn is generated in one call, then every tool
  call of the turn runs concurrently, then the next turn starts (`Session.generate`).
Both append the same tokens and write the same records (`_close_turn`); each row samples from
its own random stream, so they sample the same tokens wherever the engine's numbers for a row
do not depend on its batch (README, "How a turn is scheduled").

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
sessions) and a turn prefills only the observation; without it each turn re-prefills the
conversation. The loop talks to the engine interface only (rollout/engines/base.py); each turn
records the policy version its generation says it sampled from (asynchronous training may hand
the engine newer weights between two turns: a partial rollout).

The frozen generator answers a trajectory as soon as it ends (trajectory schedule: those ending
at the same step in one call) or the trajectories that ended in a turn together (turn schedule);
a remote generator answers on a worker thread while generation goes on. A group whose n
trajectories are all final is handed to `on_group_done` right away, so its rewards can be scored
while the other groups are still searching.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from dataclasses import replace
from typing import Any

import torch

from grouprl.config import AgentConfig
from grouprl.data.prompts import encode_prompt
from grouprl.data.sample import Sample
from grouprl.errors import UserError
from grouprl.rollout.actions import STOP_STRINGS, Action, parse_action
from grouprl.rollout.agent_prompts import LAST_TURN, correction, protocol_prompt, with_protocol
from grouprl.rollout.agent_records import (
    RECORD_CHARS,
    GroupCallback,
    Groups,
    Rollout,
    counts,
    question,
    turn_record,
)
from grouprl.rollout.agent_turns import CallerThread, Clock, TurnDriver
from grouprl.rollout.answer import (
    AnswerGenerator,
    AnswerRequest,
    AnswerResult,
    OpenAIAnswerGenerator,
    build_answer_generator,
)
from grouprl.rollout.chat import ChatRenderer
from grouprl.rollout.engines.base import Generation, RolloutEngine, SamplingParams, Session
from grouprl.rollout.observation_fit import check_limit, clipped_observation, fit_images, fixed_tokens
from grouprl.rollout.tools.base import AgentState, Observation, Tool
from grouprl.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

_Answering = tuple[list[Rollout], concurrent.futures.Future]  # trajectories, their answer call


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
        answer_dtype: torch.dtype = torch.float32,
    ):
        """`vision`: a VLM policy's processor (grouprl.vision VisionProcessor): observation
        images (retrieved pages, crops) are shown to it as images in the next user turn.
        `answer_dtype`: what an `hf:` answer generator built here loads its weights in."""
        self.engine = engine
        self.vision = vision
        self.tokenizer = tokenizer
        self.tools = tools
        self.cfg = cfg
        self.self_answer = cfg.answer_generator == "none"
        if answer_generator is None and not self.self_answer:
            answer_generator = build_answer_generator(cfg, engine, answer_dtype)
        self.answer_generator = None if self.self_answer else answer_generator
        self.chat = ChatRenderer(tokenizer, cfg.observation_role)
        check_limit(tokenizer, cfg)
        self.system_prompt = protocol_prompt("none" if self.self_answer else "frozen", cfg.system_prompt)
        self.stats: dict[str, float] = {}  # the last run's counts and times, as metrics
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
        if self.cfg.schedule != "trajectory":
            return asyncio.run(self.arun(samples, prompts, n, params, generator, on_group_done, images))
        # the engine steps on this thread (the one that computes), the trajectories' loop beside it
        caller = CallerThread()
        posted = None if on_group_done is None else functools.partial(caller.post, on_group_done)
        run = lambda: self.arun(samples, prompts, n, params, generator, posted, images, caller=caller)  # noqa: E731
        return caller.run(run, self.engine.device)

    async def arun(
        self, samples, prompts, n, params, generator=None, on_group_done=None, images=None, caller=None
    ) -> list[Trajectory]:
        """`run` inside a running event loop; `caller`: where the trajectory schedule's engine
        steps (run's thread), else a thread of the engine's own."""
        rollouts = [
            Rollout(
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
        groups = Groups(rollouts, n, on_group_done)
        clock = Clock()
        if self.cfg.schedule == "trajectory":
            await self._by_trajectory(rollouts, session, turn_params, generator, groups, clock, caller)
        else:
            await self._by_turn(rollouts, session, turn_params, generator, groups, clock)
        self.stats = {**counts(rollouts, self.engine.prefill_tokens - prefill_before), **clock.metrics()}
        return [r.trajectory for r in rollouts]

    # ------------------------------------------------------------------ the two schedules
    async def _by_turn(self, rollouts, session: Session, params, generator, groups: Groups, clock: Clock) -> None:
        """Lock step: each turn generates every running trajectory's turn in one call, then runs
        the turn's tool calls concurrently."""
        active = list(range(len(rollouts)))
        new_tokens: list[list[int]] = [[] for _ in rollouts]  # appended since the row's last turn
        new_images: list[list] = [[] for _ in rollouts]  # the images among them (VLM policies)
        answering: list[_Answering] = []  # remote answer calls in flight
        for turn in range(self.cfg.max_turns):
            if not active:
                break
            fed = {"new_images": [new_images[k] for k in active]} if self.vision is not None else {}
            started = time.perf_counter()
            generations = session.generate(active, [new_tokens[k] for k in active], params, generator, **fed)
            clock.engine += time.perf_counter() - started
            answering = self._settle(answering, groups)
            actions = [parse_action(g.text) for g in generations]
            for k, g in zip(active, generations):
                rollouts[k].append(g.token_ids, 1, g.text, g.log_probs)
            # every tool call of the turn at once: searches wait on I/O, not on each other
            observations = await asyncio.gather(
                *(clock.tool(self._act(rollouts[k], a)) for k, a in zip(active, actions))
            )
            still_active, ended = [], []
            for k, g, action, obs in zip(active, generations, actions, observations):
                nxt = self._close_turn(rollouts[k], turn, g, action, obs)
                if nxt is None:
                    session.release(k)
                    ended.append(rollouts[k])
                else:
                    new_tokens[k], new_images[k] = nxt
                    still_active.append(k)
            active = still_active
            answering += await self._answer(ended, groups)
        for batch, future in answering:
            self._write_answers(batch, await asyncio.wrap_future(future), groups)

    async def _by_trajectory(self, rollouts, session: Session, params, generator, groups: Groups, clock: Clock,
                             caller: CallerThread | None) -> None:  # fmt: skip
        """Each trajectory on its own (see the module docstring). A failure anywhere (a tool that
        raises a UserError, the engine) ends every trajectory and releases every row."""
        driver = TurnDriver(session, params, generator, clock, self.vision is not None, self.engine.device, caller)
        answers = _AnswerQueue(self, groups, driver)
        stepping = asyncio.create_task(driver.run())
        trajectories = [asyncio.create_task(self._trajectory(k, r, driver, answers, clock)) for k, r in enumerate(rollouts)]
        try:
            await asyncio.gather(*trajectories)
        finally:
            for task in [*trajectories, stepping]:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.gather(*trajectories, stepping, return_exceptions=True)
            driver.close([k for k, r in enumerate(rollouts) if not r.released])

    async def _trajectory(self, k: int, r: Rollout, driver: TurnDriver, answers: _AnswerQueue, clock: Clock) -> None:
        """Trajectory `k`'s turns, then its answer."""
        new_tokens: list[int] = []
        new_images: list = []
        for turn in range(self.cfg.max_turns):
            g = await driver.generate(k, new_tokens, new_images)
            action = parse_action(g.text)
            r.append(g.token_ids, 1, g.text, g.log_probs)
            obs = await clock.tool(self._act(r, action))
            nxt = self._close_turn(r, turn, g, action, obs)
            if nxt is None:
                break
            new_tokens, new_images = nxt
        driver.release(k)
        r.released = True
        await answers.finish(r)

    # ------------------------------------------------------------------ one turn
    def _close_turn(
        self, r: Rollout, turn: int, g: Generation, action: Action, obs: Observation | None
    ) -> tuple[list[int], list] | None:
        """Record turn `turn` (its generation `g`, action and observation) and decide: None when
        the trajectory has ended (finished, out of turns, or its observation would reach the
        response budget), else the observation's ids and images, appended, for its next turn."""
        r.state.turn += 1
        r.trajectory.turns.append(turn_record(turn, g, action, obs, g.version, r.state))
        if r.trajectory.version is None:
            r.trajectory.version = g.version
        if r.state.finished:
            return None
        if turn == self.cfg.max_turns - 1:
            self._unfinished(r, "max_turns")
            return None
        ids, text, shown = self._observation(
            obs, g, next_is_last=turn + 1 == self.cfg.max_turns - 1, state=r.state, action=action
        )
        budget = self.cfg.max_response_tokens
        if budget and len(r.trajectory.response_ids) + len(ids) >= budget:
            self._unfinished(r, "length")
            return None
        r.append(ids, 0, f"\n<observation>\n{text}\n</observation>\n")
        r.trajectory.response_images.extend(shown)
        r.trajectory.turns[-1]["masked_tokens"] = len(ids)
        if "page" in r.trajectory.turns[-1]:  # a search's page: the size the processor showed it at
            r.trajectory.turns[-1]["page_size"] = list(r.state.current_image_size)
        return ids, shown

    # ------------------------------------------------------------------ one turn
    async def _act(self, r: Rollout, action: Action) -> Observation | None:
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
        except UserError:  # the run cannot go on (the search service is down): it stops, in one line
            raise
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

    def _unfinished(self, r: Rollout, reason: str) -> None:
        """Out of turns or tokens: flagged truncated; the frozen generator may still answer."""
        r.state.finished, r.state.finish_reason = True, reason
        r.trajectory.finish_reason = "length"
        r.needs_answer = not self.self_answer and self.cfg.on_unfinished == "answer"
        r.trajectory.turns[-1]["unfinished"] = reason

    # ------------------------------------------------------------------ the frozen answer
    async def _answer(self, ended: list[Rollout], groups: Groups) -> list[_Answering]:
        """Answer the trajectories that ended this turn in one call; those that need no answer
        are final now. A local generator answers here (it shares the device with the policy);
        a remote one answers on a worker thread while the next turns generate: its call is
        returned, to be written by `_settle`."""
        due = [r for r in ended if r.needs_answer and self.answer_generator is not None]
        groups.final([r for r in ended if not (r.needs_answer and self.answer_generator is not None)])
        if not due:
            return []
        requests = [AnswerRequest(question(r.state.sample), r.evidence) for r in due]
        if isinstance(self.answer_generator, OpenAIAnswerGenerator):
            return [(due, self._remote(requests))]
        self._write_answers(due, await self.answer_generator.answer(requests), groups)
        return []

    async def _answers_of(self, rollouts: list[Rollout], driver: TurnDriver) -> list[AnswerResult]:
        """The frozen generator's answers for `rollouts`: a remote one on a worker thread, a local
        one on the engine's thread (between two steps: it may be the policy's own engine)."""
        requests = [AnswerRequest(question(r.state.sample), r.evidence) for r in rollouts]
        if isinstance(self.answer_generator, OpenAIAnswerGenerator):
            return await asyncio.wrap_future(self._remote(requests))
        return await driver.in_engine(lambda: asyncio.run(self.answer_generator.answer(requests)))

    def _remote(self, requests: list[AnswerRequest]) -> concurrent.futures.Future:
        """A remote generator's call on a worker thread (its own event loop)."""
        if self._answer_pool is None:
            self._answer_pool = concurrent.futures.ThreadPoolExecutor(2, "grouprl-answers")
        return self._answer_pool.submit(asyncio.run, self.answer_generator.answer(requests))

    def _settle(self, answering: list[_Answering], groups: Groups) -> list[_Answering]:
        """Write the remote answers that have arrived; the calls still out."""
        out = []
        for batch, future in answering:
            if future.done():
                self._write_answers(batch, future.result(), groups)
            else:
                out.append((batch, future))
        return out

    def _write_answers(self, rollouts: list[Rollout], results: list[AnswerResult], groups: Groups) -> None:
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


class _AnswerQueue:
    """The trajectory schedule's frozen answers: a trajectory that ends is answered at once, in
    one call with those that end at the same step (a local generator runs one batch instead of
    one per trajectory; a remote one gets them together, on a worker thread). `finish` returns
    when the trajectory is final."""

    def __init__(self, loop: AgentLoop, groups: Groups, driver: TurnDriver):
        self.loop, self.groups, self.driver = loop, groups, driver
        self.due: list[tuple[Rollout, asyncio.Future]] = []
        self.flushing: asyncio.Task | None = None

    async def finish(self, r: Rollout) -> None:
        loop = self.loop
        if not (r.needs_answer and loop.answer_generator is not None):
            self.groups.final([r])
            return
        future = asyncio.get_running_loop().create_future()
        self.due.append((r, future))
        if self.flushing is None:
            self.flushing = asyncio.create_task(self._flush())
        await future

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the trajectories handed their last turn at the same step come first
        due, self.due, self.flushing = self.due, [], None
        rollouts = [r for r, _ in due]
        try:
            results = await self.loop._answers_of(rollouts, self.driver)
            self.loop._write_answers(rollouts, results, self.groups)
        except BaseException as e:  # noqa: BLE001 - each waiting trajectory raises it
            for _, future in due:
                if not future.done():
                    future.set_exception(e)
            return
        for _, future in due:
            if not future.done():
                future.set_result(None)

