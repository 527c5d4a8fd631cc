"""`AgentLoop.run(on_group_done=...)`: a group is handed over as soon as its n trajectories are
final (answer written), in completion order, once, as the very objects the loop returns; and
rewards scored from those hand-overs equal rewards scored on the whole batch afterwards.

The scripted policy makes groups (and samples inside a group) end at different turns; the
callback records how many turns had been generated when it fired.
"""

import asyncio
import copy
import dataclasses
import json
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_agent import PARAMS, FakeAnswers, FakeSearch, ScriptedEngine, spans
from test_chat import EXPECTED_DELTA, chat_tokenizer

from grouprl.config import AgentConfig
from grouprl.data.sample import Sample
from grouprl.rewards.composite import CompositeReward, RewardComponent
from grouprl.rewards.retrieval import exact_match, ndcg
from grouprl.rewards.streaming import StreamingRewards
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.answer import OpenAIAnswerGenerator

# searches sample j of question q makes before <search_complete>; q1 completes at once. The
# first turn cannot tell the samples apart (same prompt), so a searching question searches in
# turn 0 with every sample, and the search result names the sample (RESULT[u0-2-0]).
SEARCHES = {"q0": [1, 2, 3], "q1": [0, 0, 0], "q2": [1, 1, 2]}
# the turn in which each group's last sample ends: q0 (sample 2) turn 3, q1 turn 0, q2 turn 2
GROUP_END_TURN = {0: 3, 1: 0, 2: 2}


def staggered(context: str) -> str:
    question = re.search(r"Q=(\w+)", context).group(1)
    results = re.findall(r"RESULT\[([^\]]+)\]", context)
    if not results:
        if max(SEARCHES[question]) == 0:
            return "<search_complete>true</search_complete>"
        return f"<search>{question}</search>"
    j = int(results[0].split("-")[1])
    if len(results) < SEARCHES[question][j]:
        return f"<search>more {len(results)}</search>"
    return "<search_complete>true</search_complete>"


def questions(k=3, gold=None):
    return [
        Sample(
            uid=f"u{i}",
            messages=[{"role": "user", "content": f"Q=q{i}"}],
            ground_truth=f"A:Q=q{i}",
            extra_info={"gold_docs": (gold or {}).get(i, [])},
        )
        for i in range(k)
    ]


class CountingEngine(ScriptedEngine):
    """A scripted engine whose sessions count turns (generate calls), optionally slow ones."""

    def __init__(self, tokenizer, policy, turn_seconds=0.0):
        super().__init__(tokenizer, policy)
        self.turns = 0
        self.turn_seconds = turn_seconds
        self.turn_ends: list[float] = []

    def _turn_done(self):
        time.sleep(self.turn_seconds)
        self.turns += 1
        self.turn_ends.append(time.perf_counter())

    def generate(self, prompts, n, params, generator=None):  # a turn without KV reuse
        out = super().generate(prompts, n, params, generator)
        self._turn_done()
        return out

    def open_session(self, prompts, n, reuse_cache=True):
        session = super().open_session(prompts, n, reuse_cache)
        if not reuse_cache:  # its turns go through `generate`, counted there
            return session
        generate = session.generate

        def counted(*args, **kwargs):
            out = generate(*args, **kwargs)
            self._turn_done()
            return out

        session.generate = counted
        return session


def make(answers=None, turn_seconds=0.0, cfg=None, tokenizer=None):
    tokenizer = tokenizer or chat_tokenizer("chatml")
    engine = CountingEngine(tokenizer, staggered, turn_seconds)
    cfg = dataclasses.replace(cfg or AgentConfig(), schedule="turn")  # turns counted as generate calls
    answers = FakeAnswers() if answers is None and cfg.answer_generator != "openai" else answers
    return AgentLoop(engine, tokenizer, {"search": FakeSearch(delay=0.0)}, cfg, answers)


class Recorder:
    """on_group_done: the group index, the turns generated so far, the group and a deep copy."""

    def __init__(self, loop):
        self.loop = loop
        self.calls: list[tuple[int, int, list, list]] = []

    def __call__(self, index, group):
        self.calls.append((index, self.loop.engine.turns, group, copy.deepcopy(group)))


# ------------------------------------------------------------------ the hand-over
@pytest.mark.parametrize("reuse", [True, False])
def test_groups_are_handed_over_in_completion_order_once_as_returned(reuse):
    loop = make(cfg=AgentConfig(max_turns=5, reuse_kv_cache=reuse))
    batch, n = questions(), 3
    recorder = Recorder(loop)
    trajectories = loop.run(batch, loop.encode_prompts(batch), n, PARAMS, on_group_done=recorder)

    # once each, in the order the groups ended, each right after the turn its last sample ended
    assert [(i, turns) for i, turns, _, _ in recorder.calls] == [(1, 1), (2, 3), (0, 4)]
    assert [i for i, *_ in recorder.calls] == sorted(GROUP_END_TURN, key=GROUP_END_TURN.get)
    assert all(turns == GROUP_END_TURN[i] + 1 for i, turns, *_ in recorder.calls)
    assert loop.engine.turns == 4  # group 1 went out while the others had three turns to go
    for i, _, group, snapshot in recorder.calls:
        assert all(a is b for a, b in zip(group, trajectories[i * n : (i + 1) * n]))
        assert len(group) == n and [t.uid for t in group] == [f"u{i}"] * n
        assert snapshot == trajectories[i * n : (i + 1) * n]  # nothing changed after the hand-over
    # the answer was already written when the group went out
    for _, _, _, snapshot in recorder.calls:
        for t in snapshot:
            assert t.response_text.endswith(f"<answer>A:Q=q{t.uid[1]}</answer>")
            assert t.turns[-1]["action"] == "answer" and t.retrieved == [
                f"{t.uid}-{t.index}-{k}" for k in range(SEARCHES[f"q{t.uid[1]}"][t.index])
            ]

    # the same run without a callback returns equal trajectories, answered in the same batches
    plain = make(cfg=AgentConfig(max_turns=5, reuse_kv_cache=reuse))
    assert plain.run(batch, plain.encode_prompts(batch), n, PARAMS) == trajectories
    assert [len(t.turns) for t in trajectories] == [3, 4, 5, 2, 2, 2, 3, 3, 4]


def test_answers_are_one_call_per_turn_for_the_samples_that_ended_in_it():
    answers = FakeAnswers()
    calls = []
    answer = answers.answer

    async def recorded(requests):
        calls.append(sorted(r.question + "/" + str(len(r.evidence)) for r in requests))
        return await answer(requests)

    answers.answer = recorded
    loop = make(answers=answers, cfg=AgentConfig(max_turns=5))
    batch = questions()
    loop.run(batch, loop.encode_prompts(batch), 3, PARAMS)
    assert calls == [
        ["Q=q1/0"] * 3,  # turn 0
        ["Q=q0/1", "Q=q2/1", "Q=q2/1"],  # turn 1
        ["Q=q0/2", "Q=q2/2"],  # turn 2
        ["Q=q0/3"],  # turn 3
    ]


def test_truncated_samples_are_answered_before_their_group_goes_out():
    # max_turns=3: q0's sample 2 (3 searches) runs out of turns in turn 2, with q2's sample 2
    loop = make(cfg=AgentConfig(max_turns=3))
    batch, n = questions(), 3
    recorder = Recorder(loop)
    trajectories = loop.run(batch, loop.encode_prompts(batch), n, PARAMS, on_group_done=recorder)
    assert [(i, turns) for i, turns, _, _ in recorder.calls] == [(1, 1), (0, 3), (2, 3)]
    (_, _, _, q0) = recorder.calls[1]
    assert q0[2].truncated and q0[2].turns[-2]["unfinished"] == "max_turns"
    assert q0[2].response_text.endswith("<answer>A:Q=q0</answer>")
    assert [t for _, _, _, snapshot in sorted(recorder.calls) for t in snapshot] == trajectories

    # with on_unfinished=no_answer the truncated one is final without an answer
    loop = make(cfg=AgentConfig(max_turns=3, on_unfinished="no_answer"))
    recorder = Recorder(loop)
    trajectories = loop.run(batch, loop.encode_prompts(batch), n, PARAMS, on_group_done=recorder)
    assert [(i, turns) for i, turns, _, _ in recorder.calls] == [(1, 1), (0, 3), (2, 3)]
    assert "<answer>" not in trajectories[2].response_text and trajectories[2].truncated


def test_self_answer_groups_go_out_when_the_policy_answers():
    def answering(context):
        move = staggered(context)
        return "<answer>42</answer>" if move.startswith("<search_complete>") else move

    tokenizer = chat_tokenizer("chatml")
    loop = AgentLoop(
        CountingEngine(tokenizer, answering),
        tokenizer,
        {"search": FakeSearch(delay=0.0)},
        AgentConfig(answer_generator="none", max_turns=5),
    )
    recorder = Recorder(loop)
    batch = questions()
    trajectories = loop.run(batch, loop.encode_prompts(batch), 3, PARAMS, on_group_done=recorder)
    assert [(i, turns) for i, turns, _, _ in recorder.calls] == [(1, 1), (2, 3), (0, 4)]
    assert all(t.finish_reason == "answer" for t in trajectories)
    assert [t for _, _, _, snapshot in sorted(recorder.calls) for t in snapshot] == trajectories


# ------------------------------------------------------------------ a remote answer generator
class AnswerHandler(BaseHTTPRequestHandler):
    """An OpenAI-compatible answer server: answers `A:<question>` at once, noting arrival times."""

    arrivals: list[tuple[float, str]] = []

    def do_POST(self):  # noqa: N802 - the http.server interface
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        question = re.search(r"Q=\w+", body["messages"][-1]["content"]).group(0)
        AnswerHandler.arrivals.append((time.perf_counter(), question))
        payload = json.dumps({"choices": [{"message": {"content": f"<answer>A:{question}</answer>"}}]})
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def answer_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), AnswerHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    AnswerHandler.arrivals = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.slow
def test_remote_answers_are_asked_while_the_next_turns_generate(answer_server):
    cfg = AgentConfig(answer_generator="openai", answer_base_url=answer_server, answer_model="m", max_turns=5)
    generator = OpenAIAnswerGenerator(answer_server, "m", timeout_s=10)
    loop = make(answers=generator, turn_seconds=0.4, cfg=cfg)
    batch, n = questions(), 3
    recorder = Recorder(loop)
    trajectories = loop.run(batch, loop.encode_prompts(batch), n, PARAMS, on_group_done=recorder)

    # q1's answers (asked after turn 0) arrived while turn 1 was generating, not after the loop
    q1_arrivals = [at for at, question in AnswerHandler.arrivals if question == "Q=q1"]
    assert len(q1_arrivals) == 3 and max(q1_arrivals) < loop.engine.turn_ends[1]
    # a group goes out once its answers are written: q1's after turn 1, before the loop ends
    order = [i for i, *_ in recorder.calls]
    assert sorted(order) == [0, 1, 2] and order[0] == 1
    assert recorder.calls[0][1] == 2
    for i, _, group, snapshot in recorder.calls:
        assert all(a is b for a, b in zip(group, trajectories[i * n : (i + 1) * n]))
        assert snapshot == trajectories[i * n : (i + 1) * n]
    for t in trajectories:
        assert spans(chat_tokenizer("chatml"), t)[-1] == (0, f"\n<answer>A:Q=q{t.uid[1]}</answer>")
        assert t.turns[-1]["action"] == "answer" and t.turns[-1]["turn"] == len(t.turns) - 1
    assert len(AnswerHandler.arrivals) == 9


def test_remote_answer_failures_are_written_as_error_observations():
    # a closed port: every answer is an error observation, and every group still goes out once
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    cfg = AgentConfig(answer_generator="openai", answer_base_url=url, answer_model="m", max_turns=5)
    loop = make(answers=OpenAIAnswerGenerator(url, "m", timeout_s=2), cfg=cfg)
    recorder = Recorder(loop)
    batch = questions()
    trajectories = loop.run(batch, loop.encode_prompts(batch), 3, PARAMS, on_group_done=recorder)
    assert sorted(i for i, *_ in recorder.calls) == [0, 1, 2]
    for t in trajectories:
        assert t.turns[-1]["error"] == "answer_error"
        assert spans(chat_tokenizer("chatml"), t)[-1][1].startswith(
            EXPECTED_DELTA["chatml"].split("OBS")[0] + "answer generator unreachable"
        )
    assert loop.stats["agent/errors/answer_error"] == 9


# ------------------------------------------------------------------ streaming rewards
JUDGE_LATENCY = 0.15


async def slow_judge(response):
    await asyncio.sleep(JUDGE_LATENCY)
    return (len(response) % 7) / 7


def reward():
    return CompositeReward(
        [
            RewardComponent("judge", slow_judge, weight=0.5),
            RewardComponent("ndcg", ndcg, weight=0.3),
            RewardComponent("em", exact_match, weight=0.2),
        ]
    )


def test_streamed_rewards_equal_whole_batch_rewards_and_hide_behind_generation():
    gold = {0: ["u0-1-1", "u0-2-0"], 1: ["x"], 2: ["u2-0-0", "u2-2-1"]}
    batch, n = questions(gold=gold), 3
    loop = make(turn_seconds=0.1, cfg=AgentConfig(max_turns=5))
    streaming = StreamingRewards(reward())
    try:
        trajectories = loop.run(
            batch, loop.encode_prompts(batch), n, PARAMS, on_group_done=lambda i, g: streaming.submit(g)
        )
        finished = streaming.finish(time.perf_counter())
    finally:
        streaming.close()

    # the same rollout, scored as one batch after the loop
    plain = make(cfg=AgentConfig(max_turns=5))
    expected = plain.run(batch, plain.encode_prompts(batch), n, PARAMS)
    expected_metrics = reward().score(expected)
    assert [t.rewards for t in trajectories] == [t.rewards for t in expected]
    assert [t.reward for t in trajectories] == [t.reward for t in expected]
    assert finished.metrics == {k: pytest.approx(v, abs=1e-12) for k, v in expected_metrics.items()}
    # the scores depend on what is written last: the answer (em) and the retrieved ids (ndcg)
    assert {t.rewards["em"] for t in trajectories} == {1.0}
    idcg = 1 + 1 / math.log2(3)  # two gold docs
    second, first = 1 / math.log2(3) / idcg, 1 / idcg  # the one gold doc retrieved 2nd / 1st
    assert [t.rewards["ndcg"] for t in trajectories] == pytest.approx(
        [0, second, first, 0, 0, 0, first, 0, second], abs=1e-12
    )
    # group 1 was judged during turns 1-2, group 2 partly during turn 3: over one judge wait hidden
    assert finished.hidden_s > JUDGE_LATENCY
