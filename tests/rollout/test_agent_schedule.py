"""agent.schedule: trajectories on their own (continuous batching) against lock step.

A fake engine whose turns take scripted numbers of decode steps and tools with scripted
latencies show the order of events: a fast trajectory's second turn starts before a slow one's
first turn ends, a group goes to its rewards when its last trajectory ends, the frozen generator
answers each trajectory as it ends. The built-in engine on a tiny float64 model samples the very
tokens in both schedules (each row draws from its own stream; at float64 a row's numbers agree
to far below any gap between two tokens, whatever its batch), and a failing tool, a cancelled
rollout, an engine error or the response budget leave no row in the engine. Weights offered
between turns are taken only where no turn runs, and each turn records its version.
"""

import asyncio
import threading
import time

import pytest
import torch
from test_agent import FakeAnswers
from test_chat import chat_tokenizer
from transformers import AutoModelForCausalLM

from grouprl.config import AgentConfig
from grouprl.data.sample import Sample
from grouprl.errors import UserError
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.engines import Generation, SamplingParams
from grouprl.rollout.engines.hf import HFEngine
from grouprl.rollout.engines.streams import RowStreams
from grouprl.rollout.tools.base import Observation
from helpers import tiny_config

PARAMS = SamplingParams(max_new_tokens=64, temperature=1.0)
STEP_S = 0.004  # a fake decode step


# ------------------------------------------------------------------ a fake engine with clocked turns
class ClockedEngine:
    """Turn t of row r is `turns[r][t]` (its text), one decode step per character; a step sleeps
    STEP_S. Sessions run turns together (`generate`) or one by one (`submit` / `step`); `events`
    records (time, "start"/"end", row, turn)."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, turns: dict[int, list[str]], fail_at_step: int | None = None):
        self.tokenizer, self.turns, self.fail_at_step = tokenizer, turns, fail_at_step
        self.prefill_tokens, self.events, self.sessions = 0, [], []

    def open_session(self, prompts, n, reuse_cache=True):
        self.sessions.append(ClockedSession(self))
        return self.sessions[-1]


class ClockedSession:
    def __init__(self, engine):
        self.engine = engine
        self.queued: list[int] = []
        self.running: dict[int, list] = {}  # row -> [turn, text, steps so far]
        self.taken: dict[int, int] = {}  # turns each row has started
        self.steps = 0

    def held(self) -> set[int]:
        return set(self.queued) | set(self.running)

    def submit(self, row, new_tokens, params, generator=None):
        self.queued.append(row)

    def step(self):
        self.steps += 1
        if self.steps == self.engine.fail_at_step:
            raise RuntimeError("the engine broke")
        time.sleep(STEP_S)
        for row in self.queued:
            turn = self.taken.get(row, 0)
            self.taken[row] = turn + 1
            self.running[row] = [turn, self.engine.turns[row][turn], 0]
            self.engine.events.append((time.perf_counter(), "start", row, turn))
        self.queued = []
        ended = []
        for row, state in list(self.running.items()):
            state[2] += 1
            if state[2] >= len(state[1]):
                del self.running[row]
                self.engine.events.append((time.perf_counter(), "end", row, state[0]))
                ids = self.engine.tokenizer(state[1], add_special_tokens=False)["input_ids"]
                ended.append((row, Generation(ids, state[1], "stop")))
        return ended

    def generate(self, rows, new_tokens, params, generator=None):
        for row in rows:
            self.submit(row, [], params)
        out = {}
        while len(out) < len(rows):
            out.update(dict(self.step()))
        return [out[row] for row in rows]

    def release(self, row):
        self.queued = [r for r in self.queued if r != row]
        self.running.pop(row, None)


class LatentSearch:
    """Answers after latencies[(row, turn)] seconds; records (time, "tool", row, turn)."""

    name = "search"

    def __init__(self, engine, latencies, n):
        self.engine, self.latencies, self.n = engine, latencies, n

    async def __call__(self, argument, state):
        row = int(state.sample.uid[1:]) * self.n + state.index
        await asyncio.sleep(self.latencies.get((row, state.turn), 0.0))
        self.engine.events.append((time.perf_counter(), "tool", row, state.turn))
        return Observation(f"found {argument}")


def clocked_run(schedule, turns, latencies, n=2, answers=None, on_group_done=None, **kwargs):
    tokenizer = chat_tokenizer("chatml")
    engine = ClockedEngine(tokenizer, turns, **kwargs)
    prompts = len(turns) // n
    cfg = AgentConfig(schedule=schedule, max_turns=4, answer_generator="policy")
    loop = AgentLoop(engine, tokenizer, {"search": LatentSearch(engine, latencies, n)}, cfg, answers or FakeAnswers())
    batch = [Sample(uid=f"u{i}", messages=[{"role": "user", "content": f"Q{i}"}]) for i in range(prompts)]
    trajectories = loop.run(batch, loop.encode_prompts(batch), n, PARAMS, on_group_done=on_group_done)
    return engine, trajectories, loop


def when(engine, kind, row, turn):
    return next(t for t, k, r, u in engine.events if (k, r, u) == (kind, row, turn))


SEARCH = "<search>x</search>"
DONE = "<search_complete>true</search_complete>"
# rows 0, 1 (group 0) are quick; row 3 (group 1) writes long turns and waits long for its tool
TURNS = {0: [SEARCH, SEARCH, DONE], 1: [SEARCH, DONE], 2: [SEARCH, DONE], 3: ["." * 60 + SEARCH, DONE]}
LATENCY = {(0, 0): 0.01, (0, 1): 0.01, (1, 0): 0.01, (2, 0): 0.02, (3, 0): 0.3}  # (row, turn): seconds


@pytest.mark.parametrize("schedule", ["trajectory", "turn"])
def test_a_fast_trajectorys_next_turn_does_not_wait_for_a_slow_one(schedule):
    engine, trajectories, _ = clocked_run(schedule, TURNS, LATENCY)
    fast_second, slow_first_end = when(engine, "start", 0, 1), when(engine, "end", 3, 0)
    slow_tool = when(engine, "tool", 3, 0)
    if schedule == "trajectory":  # row 0's second and third turns both run during row 3's first
        assert fast_second < slow_first_end
        assert when(engine, "start", 0, 2) < slow_first_end
    else:  # lock step: every second turn waits for the slowest first turn and its tool call
        assert fast_second > slow_tool > slow_first_end
    assert [len(t.turns) for t in trajectories] == [4, 3, 3, 3]  # the same turns either way, answer included
    assert engine.sessions[0].held() == set()


def test_a_group_goes_to_its_rewards_when_its_last_trajectory_ends():
    handed = []
    engine, trajectories, _ = clocked_run(
        "trajectory", TURNS, LATENCY, on_group_done=lambda i, group: handed.append((time.perf_counter(), i))
    )
    (t0, g0), (t1, g1) = handed
    assert (g0, g1) == (0, 1)
    group0_done = max(when(engine, "end", 0, 2), when(engine, "end", 1, 1))
    assert group0_done <= t0 < when(engine, "end", 3, 1)  # group 1 was still generating
    assert t0 - group0_done < 0.05  # at once (the answer is written first)
    assert t1 >= when(engine, "end", 3, 1)


def test_the_frozen_generator_answers_each_trajectory_as_it_ends():
    answers = FakeAnswers()
    calls = []
    original = answers.answer

    async def recorded(requests):
        calls.append((time.perf_counter(), sorted(r.question for r in requests)))
        return await original(requests)

    answers.answer = recorded
    turns = {0: [DONE], 1: [DONE], 2: [SEARCH, DONE], 3: ["." * 40 + DONE]}
    engine, trajectories, _ = clocked_run("trajectory", turns, {(2, 0): 0.05}, answers=answers)
    # rows 0 and 1 end at the same step: one call; rows 2 and 3 each on their own, as they end
    assert [questions for _, questions in calls] == [["Q0", "Q0"], ["Q1"], ["Q1"]]
    assert calls[0][0] < when(engine, "end", 2, 1) <= calls[1][0] < when(engine, "end", 3, 0) <= calls[2][0]
    assert all(t.turns[-1]["action"] == "answer" for t in trajectories)


def _recording_sessions(monkeypatch) -> list:
    sessions = []
    real_open = ClockedEngine.open_session

    def recording(self, *args, **kwargs):
        sessions.append(real_open(self, *args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(ClockedEngine, "open_session", recording)
    return sessions


def test_an_engine_failure_leaves_no_row_held(monkeypatch):
    sessions = _recording_sessions(monkeypatch)
    with pytest.raises(RuntimeError, match="the engine broke"):
        clocked_run("trajectory", TURNS, LATENCY, fail_at_step=5)
    assert sessions[0].steps == 5 and sessions[0].held() == set()


def test_the_engine_steps_and_groups_are_handed_over_on_the_calling_thread(monkeypatch):
    """The trajectory schedule computes on the caller's thread (a CPU's thread team is the
    computing thread's); the trajectories' event loop, with the tools, runs beside it."""
    threads = {"step": set(), "group": set(), "tool": set()}
    real_step, real_tool = ClockedSession.step, LatentSearch.__call__

    def step(self):
        threads["step"].add(threading.get_ident())
        return real_step(self)

    async def tool(self, argument, state):
        threads["tool"].add(threading.get_ident())
        return await real_tool(self, argument, state)

    monkeypatch.setattr(ClockedSession, "step", step)
    monkeypatch.setattr(LatentSearch, "__call__", tool)
    before = threading.active_count()
    clocked_run("trajectory", TURNS, LATENCY, on_group_done=lambda i, g: threads["group"].add(threading.get_ident()))
    me = threading.get_ident()
    assert threads["step"] == {me} and threads["group"] == {me}
    assert len(threads["tool"]) == 1 and me not in threads["tool"]
    assert threading.active_count() == before  # the loop's thread has ended


def test_an_error_handing_a_group_over_stops_the_rollout_and_leaves_no_row_held(monkeypatch):
    sessions = _recording_sessions(monkeypatch)

    def broken(i, group):
        raise ValueError("scoring broke")

    with pytest.raises(ValueError, match="scoring broke"):
        clocked_run("trajectory", TURNS, LATENCY, on_group_done=broken)
    assert sessions[0].held() == set()


def test_ctrl_c_during_a_step_stops_the_rollout_and_leaves_no_row_held(monkeypatch):
    sessions = _recording_sessions(monkeypatch)
    real_step = ClockedSession.step

    def step(self):
        if self.steps == 4:
            self.steps += 1
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(ClockedSession, "step", step)
    before = threading.active_count()
    with pytest.raises(KeyboardInterrupt):
        clocked_run("trajectory", TURNS, LATENCY)
    assert sessions[0].held() == set() and threading.active_count() == before


# ------------------------------------------------------------------ the built-in engine
QUESTIONS = ["Who wrote it", "Name the river"]


@pytest.fixture(scope="module")
def policy():
    tokenizer = chat_tokenizer("chatml")
    config = tiny_config("llama", vocab_size=len(tokenizer), initializer_range=0.2, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    return model, tokenizer


class Delayed:
    """A search whose answer takes a seeded latency (0-30 ms) per call."""

    name = "search"

    def __init__(self, seed=0, raises_on_call=None, gate=None):
        self.gen = torch.Generator().manual_seed(seed)
        self.calls, self.raises_on_call, self.gate = 0, raises_on_call, gate

    async def __call__(self, argument, state):
        self.calls += 1
        if self.calls == self.raises_on_call:
            raise UserError("the search service is down")
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(float(torch.rand((), generator=self.gen)) * 0.03)
        return Observation(f"page on {argument[:8]}")


def builtin_run(policy, schedule, tool=None, params=None, n=3, model=None, **cfg):
    model_, tokenizer = policy
    engine = HFEngine(model or model_, tokenizer)
    sessions = []
    opened = engine.open_session
    engine.open_session = lambda *a, **k: sessions.append(opened(*a, **k)) or sessions[-1]
    cfg = {"max_turns": 4, "answer_generator": "none", "system_prompt": "Use <search>q</search>.", **cfg}
    loop = AgentLoop(engine, tokenizer, {"search": tool or Delayed()}, AgentConfig(schedule=schedule, **cfg))
    batch = [Sample(uid=f"u{i}", messages=[{"role": "user", "content": q}]) for i, q in enumerate(QUESTIONS)]
    params = params or SamplingParams(max_new_tokens=24, temperature=1.0, stop=["z", "</search>"])
    streams = RowStreams(7, range(len(QUESTIONS) * n))
    return loop, engine, sessions, lambda: loop.run(batch, loop.encode_prompts(batch), n, params, streams)


def holds_nothing(engine, session):
    return (
        engine.running_turns == 0
        and not session.running
        and not session.queued
        and all(p is None for p in session.parked)
    )


def scripted_searches(tokenizer):
    """A tiny random policy never writes an action: its turns are forced to search (twice)."""
    from vision_helpers import ForcedTurns

    return ForcedTurns(tokenizer, ["<search>a</search>", "<search>bb</search>"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_both_schedules_sample_the_same_trajectories(policy, monkeypatch, dtype):
    """Each row draws from its own stream in both schedules, so they part only where a row's
    logits round otherwise in another batch (another row count, another width). At float64 that
    is far below any gap between two tokens; the tiny model's logits are far apart (init std
    0.2), so at float32 too. SmolLM2's are not: benchmarks/same_samples.py counts its partings."""
    scripted_searches(policy[1]).install(monkeypatch)
    model = AutoModelForCausalLM.from_config(policy[0].config, dtype=dtype).eval()
    model.load_state_dict(policy[0].state_dict())
    runs = {}
    for schedule in ("turn", "trajectory"):
        loop, engine, sessions, run = builtin_run(policy, schedule, model=model)
        runs[schedule] = run()
        assert holds_nothing(engine, sessions[0])
    turn, trajectory = runs["turn"], runs["trajectory"]
    assert [t.response_ids for t in trajectory] == [t.response_ids for t in turn]
    assert [t.loss_mask for t in trajectory] == [t.loss_mask for t in turn]
    assert [[r["finish_reason"] for r in t.turns] for t in trajectory] == [[r["finish_reason"] for r in t.turns] for t in turn]
    # not trivial: two forced searches, then sampled turns of several lengths and ends
    assert all(t.turns[0]["action"] == "search" and t.turns[1]["action"] == "search" for t in turn)
    assert {r["finish_reason"] for t in turn for r in t.turns[2:]} == {"eos", "length"}
    assert len({tuple(t.response_ids) for t in turn}) == len(turn)


def test_a_tool_that_stops_the_run_leaves_no_row_in_the_engine(policy, monkeypatch):
    scripted_searches(policy[1]).install(monkeypatch)
    loop, engine, sessions, run = builtin_run(policy, "trajectory", tool=Delayed(raises_on_call=4))
    with pytest.raises(UserError, match="search service is down"):
        run()
    assert holds_nothing(engine, sessions[0])


def test_a_cancelled_rollout_leaves_no_row_in_the_engine(policy, monkeypatch):
    scripted_searches(policy[1]).install(monkeypatch)
    loop, engine, sessions, _ = builtin_run(policy, "trajectory", tool=Delayed(gate=asyncio.Event()))
    batch = [Sample(uid=f"u{i}", messages=[{"role": "user", "content": q}]) for i, q in enumerate(QUESTIONS)]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop=["</search>"])

    async def cancel_once_every_row_searches():
        task = asyncio.create_task(loop.arun(batch, loop.encode_prompts(batch), 3, params, RowStreams(1, range(6))))
        while not sessions or engine.running_turns or sessions[0].queued or any(p is None for p in sessions[0].parked):
            await asyncio.sleep(0.01)  # every row waits at its gated tool, its cache parked
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_once_every_row_searches())
    assert holds_nothing(engine, sessions[0])


def test_the_response_budget_ends_a_trajectory_mid_way_and_frees_its_row(policy, monkeypatch):
    scripted_searches(policy[1]).install(monkeypatch)
    loop, engine, sessions, run = builtin_run(policy, "trajectory", max_response_tokens=60)
    trajectories = run()
    ended = [t for t in trajectories if t.turns[-1].get("unfinished") == "length"]
    assert ended and all(t.truncated for t in ended)
    assert holds_nothing(engine, sessions[0])


def test_offered_weights_wait_for_the_running_turns_and_each_turn_records_its_version(policy, monkeypatch):
    """Version 1 is offered while rows generate (from the first tool call): it is taken at the
    first step where no turn runs (turns queued meanwhile wait), turns after it record version 1
    and sample from the new weights, and a trajectory's version is its first turn's."""
    scripted_searches(policy[1]).install(monkeypatch)
    model = AutoModelForCausalLM.from_config(policy[0].config, dtype=torch.float64).eval()
    model.load_state_dict(policy[0].state_dict())
    newer = {name: p.detach() * 1.5 for name, p in model.named_parameters()}

    class Offering(Delayed):
        async def __call__(self, argument, state):
            if self.calls == 0:
                engine.offer_weights(1, newer)
            return await super().__call__(argument, state)

    loop, engine, sessions, run = builtin_run(policy, "trajectory", tool=Offering(), model=model)
    engine.weights_updated(model, 0)
    taken, real_update = [], engine.weights_updated
    engine.weights_updated = lambda m, version=None: taken.append((version, engine.running_turns)) or real_update(m, version)
    trajectories = run()
    assert taken == [(1, 0)]  # once, with no turn running
    versions = [[r["version"] for r in t.turns] for t in trajectories]
    assert all(v == sorted(v) and v[0] == 0 for v in versions) and any(1 in v for v in versions)
    assert [t.version for t in trajectories] == [0] * len(trajectories)
    assert torch.equal(next(model.parameters()), next(iter(newer.values())))


@pytest.mark.parametrize("schedule", ["turn", "trajectory"])
def test_the_rollout_says_where_its_time_went(policy, monkeypatch, schedule):
    scripted_searches(policy[1]).install(monkeypatch)

    class Slow(Delayed):  # row k's searches take 10 + 20k ms: the rows drift apart
        async def __call__(self, argument, state):
            await asyncio.sleep(0.01 + 0.02 * (3 * int(state.sample.uid[1:]) + state.index))
            return Observation("page")

    loop, engine, sessions, run = builtin_run(policy, schedule, tool=Slow())
    started = time.perf_counter()
    run()
    wall = time.perf_counter() - started
    stats = loop.stats
    assert 0 < stats["time/engine"] < wall and 0.1 <= stats["time/tools"] < wall
    if schedule == "turn":  # one after the other
        assert stats["time/engine"] + stats["time/tools"] <= wall
    else:  # the tools ran while other rows generated
        assert stats["time/engine"] + stats["time/tools"] > wall


def test_the_schedule_is_a_checked_setting():
    from grouprl.config import load_config
    from grouprl.errors import ConfigError

    assert AgentConfig().schedule == "trajectory"
    assert load_config(None, ["agent.schedule=turn"]).agent.schedule == "turn"
    with pytest.raises(ConfigError, match="agent.schedule"):
        load_config(None, ["agent.schedule=batch"])
