"""The agent loop against a scripted policy: token spans and loss masks written out by hand for
three chat templates, one state per trajectory with n > 1 and B > 1, concurrent tool calls,
every malformed turn corrected and counted, the last-turn notice, unfinished trajectories and
the frozen answer.

`ScriptedEngine` stands in for HFEngine: a row's next turn is `policy(decoded context)`,
tokenized, and cut exactly as HFEngine cuts (at EOS, after a stop string, or at
max_new_tokens). Its sessions rebuild each row's context from what the loop feeds them, so a
wrong feed shows up as a wrong context.
"""

import asyncio
import re
from pathlib import Path

import pytest
import torch
from test_chat import EXPECTED_DELTA, chat_tokenizer

from grouprl.config import AgentConfig, load_config
from grouprl.data.sample import Sample
from grouprl.errors import ConfigError
from grouprl.rewards.composite import CompositeReward
from grouprl.rewards.retrieval import final_answer
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.agent_prompts import LAST_TURN, PROTOCOL, PROTOCOL_SELF_ANSWER, correction
from grouprl.rollout.answer import AnswerResult
from grouprl.rollout.chat import ChatRenderer
from grouprl.rollout.engines import Generation, ReprefillSession, SamplingParams
from grouprl.rollout.engines.base import TurnsAtEachStep
from grouprl.rollout.tools.base import Observation

PARAMS = SamplingParams(max_new_tokens=60, temperature=1.0)


class ScriptedEngine:
    device = torch.device("cpu")

    def __init__(self, tokenizer, policy):
        self.tokenizer, self.policy = tokenizer, policy
        self.prefill_tokens = 0
        self.contexts_seen: list[str] = []

    def _one(self, context: list[int], params: SamplingParams) -> Generation:
        text = self.tokenizer.decode(context)
        self.contexts_seen.append(text)
        planned = self.tokenizer(self.policy(text), add_special_tokens=False)["input_ids"]
        tokens, finish = [], "length"
        for tok in planned[: params.max_new_tokens]:
            tokens.append(tok)
            if tok == self.tokenizer.eos_token_id:
                finish = "eos"
                break
            if any(s in self.tokenizer.decode(tokens) for s in params.stop):
                finish = "stop"
                break
        return Generation(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True), finish)

    def generate(self, prompts, n, params, generator=None):
        return [self._one(p, params) for p in prompts for _ in range(n)]

    def open_session(self, prompts, n, reuse_cache=True):
        return ScriptedSession(self, prompts, n) if reuse_cache else ReprefillSession(self, prompts, n)


class ScriptedSession(TurnsAtEachStep):
    def __init__(self, engine, prompts, n):
        self.engine = engine
        self.contexts = [list(prompts[k // n]) for k in range(len(prompts) * n)]
        self.released: set[int] = set()

    def generate(self, rows, new_tokens, params, generator=None):
        out = []
        for row, ids in zip(rows, new_tokens):
            assert row not in self.released
            self.contexts[row] += ids
            g = self.engine._one(self.contexts[row], params)
            self.contexts[row] += g.token_ids
            out.append(g)
        return out

    def release(self, row):
        self.released.add(row)
        self.forget(row)


class FakeSearch:
    """Results name the calling trajectory, so a result shown to the wrong one is visible."""

    name = "search"

    def __init__(self, delay=0.02, fail_on=None):
        self.delay, self.fail_on = delay, fail_on
        self.calls: list[tuple[str, int, int, str]] = []
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, argument, state):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        self.calls.append((state.sample.uid, state.index, state.turn, argument))
        if argument == self.fail_on:
            raise RuntimeError("index corrupted")
        if argument == "down":
            return Observation("The search service is unavailable.", error="unavailable")
        doc = f"{state.sample.uid}-{state.index}-{state.turn}"
        state.add_hits([{"id": doc, "score": 1.0, "text": argument}])
        return Observation(f"RESULT[{doc}] about {argument}")


class FakeAnswers:
    def __init__(self, fail=False):
        self.requests = []
        self.fail = fail

    async def answer(self, requests):
        self.requests.extend(requests)
        if self.fail:
            return [AnswerResult("", "answer generator returned HTTP 503") for _ in requests]
        return [AnswerResult(f"<answer>A:{r.question}</answer>") for r in requests]


def searcher(context: str) -> str:
    """Search the question, search again about the first result, then complete."""
    results = re.findall(r"RESULT\[([^\]]+)\]", context)
    question = re.search(r"Q=(\w+)", context).group(1)
    if not results:
        return f"<think>look up {question}</think><search>{question}</search> text after the stop"
    if len(results) == 1:
        return f"<search>more on {results[0]}</search>"
    return "<search_complete>true</search_complete>"


def samples(k=2):
    return [Sample(uid=f"u{i}", messages=[{"role": "user", "content": f"Q=q{i}"}]) for i in range(k)]


def make_loop(tokenizer, policy, tools=None, answers=None, **cfg):
    engine = ScriptedEngine(tokenizer, policy)
    tools = {"search": FakeSearch()} if tools is None else tools
    return AgentLoop(engine, tokenizer, tools, AgentConfig(**cfg), answers)


def spans(tokenizer, trajectory):
    """The response as (loss mask, decoded text) runs."""
    runs, start = [], 0
    ids, mask = trajectory.response_ids, trajectory.loss_mask
    for t in range(1, len(ids) + 1):
        if t == len(ids) or mask[t] != mask[start]:
            runs.append((mask[start], tokenizer.decode(ids[start:t])))
            start = t
    return runs


# ------------------------------------------------------------------ the protocol, end to end
@pytest.mark.parametrize("template", ["chatml", "llama3", "chatml_default_system", "chatml_drop_think"])
@pytest.mark.parametrize("reuse", [True, False])
def test_spans_masks_and_states_per_trajectory(template, reuse):
    tokenizer = chat_tokenizer(template)
    answers, search = FakeAnswers(), FakeSearch()
    loop = make_loop(tokenizer, searcher, {"search": search}, answers, reuse_kv_cache=reuse)
    batch, n = samples(2), 3
    prompts = loop.encode_prompts(batch)
    trajectories = loop.run(batch, prompts, n, PARAMS)

    assert [(t.uid, t.index) for t in trajectories] == [(f"u{i}", j) for i in range(2) for j in range(n)]
    obs = lambda text: EXPECTED_DELTA[template].replace("OBS", text)  # noqa: E731
    for t in trajectories:
        q, doc0, doc1 = f"q{t.uid[1]}", f"{t.uid}-{t.index}-0", f"{t.uid}-{t.index}-1"
        assert t.prompt_ids == prompts[int(t.uid[1])]
        assert spans(tokenizer, t) == [
            (1, f"<think>look up {q}</think><search>{q}</search>"),
            (0, obs(f"RESULT[{doc0}] about {q}")),
            (1, f"<search>more on {doc0}</search>"),
            (0, obs(f"RESULT[{doc1}] about more on {doc0}")),
            (1, "<search_complete>true</search_complete>"),
            (0, f"\n<answer>A:Q={q}</answer>"),
        ]
        assert t.finish_reason == "complete" and not t.truncated
        assert t.retrieved == [doc0, doc1]
        assert [r["action"] for r in t.turns] == ["search", "search", "search_complete", "answer"]
        assert [r["tokens"] for r in t.turns][:3] == [len(s) for m, s in spans(tokenizer, t) if m == 1]
        assert t.response_text == (
            f"<think>look up {q}</think><search>{q}</search>"
            f"\n<observation>\nRESULT[{doc0}] about {q}\n</observation>\n"
            f"<search>more on {doc0}</search>"
            f"\n<observation>\nRESULT[{doc1}] about more on {doc0}\n</observation>\n"
            f"<search_complete>true</search_complete>\n<answer>A:Q={q}</answer>"
        )
    # every tool call came from its own state, and the answer saw that trajectory's evidence
    assert sorted(c[:3] for c in search.calls) == sorted(
        (f"u{i}", j, turn) for i in range(2) for j in range(n) for turn in (0, 1)
    )
    assert [(r.question, r.evidence) for r in answers.requests] == [
        (f"Q=q{i}", [f"RESULT[u{i}-{j}-0] about q{i}", f"RESULT[u{i}-{j}-1] about more on u{i}-{j}-0"])
        for i in range(2)
        for j in range(n)
    ]
    assert search.max_in_flight == 2 * n  # a turn's calls ran concurrently
    assert loop.stats["agent/turns_mean"] == 3 and loop.stats["agent/finished_frac"] == 1


@pytest.mark.parametrize("template", ["chatml", "llama3", "chatml_default_system"])
def test_ids_equal_the_template_rendering_of_the_whole_conversation(template):
    """Append-only templates: prompt + response (before the answer) is exactly the template's
    tokenization of the conversation with the policy's turns as assistant messages."""
    tokenizer = chat_tokenizer(template)
    loop = make_loop(tokenizer, searcher, answers=FakeAnswers())
    batch = samples(1)
    (t,) = loop.run(batch, loop.encode_prompts(batch), 1, PARAMS)
    runs = spans(tokenizer, t)
    messages = [{"role": "system", "content": PROTOCOL}, *batch[0].messages]
    for k, (_, text) in enumerate(runs[:-1]):
        if k % 2 == 0:
            messages.append({"role": "assistant", "content": text})
        else:
            messages.append({"role": "user", "content": re.search(r"RESULT\[[^\n<]*", text).group(0)})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    answer_ids = len(tokenizer(runs[-1][1], add_special_tokens=False)["input_ids"])
    ours = t.prompt_ids + t.response_ids[:-answer_ids]
    end_of_turn = {"llama3": "<|eot_id|>"}.get(template, "<|im_end|>\n")
    assert rendered.endswith(end_of_turn)
    assert ours == tokenizer(rendered[: -len(end_of_turn)], add_special_tokens=False)["input_ids"]


def test_protocol_prompt_in_front_of_the_samples_messages():
    tokenizer = chat_tokenizer("chatml")
    loop = make_loop(tokenizer, searcher, answers=FakeAnswers())
    with_system = Sample(
        "s", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q=x"}]
    )
    (plain, combined) = [tokenizer.decode(p) for p in loop.encode_prompts([samples(1)[0], with_system])]
    assert (
        plain
        == f"<|im_start|>system\n{PROTOCOL}<|im_end|>\n<|im_start|>user\nQ=q0<|im_end|>\n<|im_start|>assistant\n"
    )
    assert combined.startswith(f"<|im_start|>system\n{PROTOCOL}\n\nBe brief.<|im_end|>\n")
    override = make_loop(tokenizer, searcher, answers=FakeAnswers(), system_prompt="Custom protocol.")
    assert "Custom protocol." in tokenizer.decode(override.encode_prompts(samples(1))[0])


# ------------------------------------------------------------------ bad turns
def scripted(turns):
    """A policy that plays `turns` in order (by the number of assistant turns so far)."""

    def policy(context):
        return turns[context.count("<|im_start|>assistant") - 1]

    return policy


def test_every_bad_turn_gets_a_correction_and_is_counted():
    tokenizer = chat_tokenizer("chatml")
    eos = tokenizer.eos_token
    turns = [
        f"I am not sure what to do.{eos}",  # no action, turn closed with EOS
        "<search>   </search>",  # empty query
        "<bbox>[1, 2, 3, 4]</bbox>",  # no crop tool configured
        "<answer>guess</answer>",  # the frozen generator answers, not the policy
        "<search>" + "x" * 80,  # unclosed: runs into max_new_tokens
        "<search>boom</search>",  # the tool raises
        "<search>down</search>",  # the tool reports an error
        "</search>",  # closing tag without opening
        "<search_complete>true</search_complete>",
    ]
    search = FakeSearch(fail_on="boom")
    loop = make_loop(tokenizer, scripted(turns), {"search": search}, FakeAnswers(), max_turns=9)
    (t,) = loop.run(samples(1), loop.encode_prompts(samples(1)), 1, PARAMS)

    delta = lambda text: EXPECTED_DELTA["chatml"].replace("OBS", text)  # noqa: E731
    runs = spans(tokenizer, t)
    observations = [text for mask, text in runs if mask == 0][:-1]
    assert observations == [
        delta(correction("no_action"))[len("<|im_end|>") :],  # the policy's EOS is not doubled
        delta(correction("empty_argument", "search")),
        delta(correction("unknown_action", "bbox")),
        delta(correction("answer_not_allowed")),
        delta(correction("unclosed_tag", "search")),
        delta("The <search> action failed."),
        delta("The search service is unavailable."),
        delta(correction("malformed_tag") + "\n\n" + LAST_TURN["complete"]),
    ]
    assert runs[0] == (1, f"I am not sure what to do.{eos}")  # EOS is the policy's own token
    assert runs[8] == (1, "<search>" + "x" * 52)  # cut at max_new_tokens
    assert [r["error"] for r in t.turns] == [
        "no_action",
        "empty_argument",
        "unknown_action",
        "answer_not_allowed",
        "unclosed_tag",
        "RuntimeError",
        "unavailable",
        "malformed_tag",
        None,
        None,
    ]
    assert t.finish_reason == "complete"
    assert {k: v for k, v in loop.stats.items() if k.startswith("agent/errors/")} == {
        f"agent/errors/{kind}": 1.0
        for kind in (
            "no_action",
            "empty_argument",
            "unknown_action",
            "answer_not_allowed",
            "unclosed_tag",
            "search_error",
            "malformed_tag",
        )
    } | {"agent/errors/search_error": 2.0}
    assert [c[3] for c in search.calls] == ["boom", "down"]  # the empty query never reached the tool


def test_unfinished_trajectory_is_truncated_and_still_answered():
    tokenizer = chat_tokenizer("chatml")
    always_search = lambda context: "<search>again</search>"  # noqa: E731
    answers = FakeAnswers()
    loop = make_loop(tokenizer, always_search, answers=answers, max_turns=3)
    (t,) = loop.run(samples(1), loop.encode_prompts(samples(1)), 1, PARAMS)
    runs = spans(tokenizer, t)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1, 0]
    assert LAST_TURN["complete"] not in runs[1][1] and LAST_TURN["complete"] in runs[3][1]
    assert runs[4] == (1, "<search>again</search>")  # no observation after the last turn
    assert runs[5] == (0, "\n<answer>A:Q=q0</answer>")
    assert t.finish_reason == "length" and t.truncated
    assert t.turns[2]["unfinished"] == "max_turns"
    assert len(answers.requests) == 1 and len(answers.requests[0].evidence) == 3

    loop = make_loop(tokenizer, always_search, answers=FakeAnswers(), max_turns=3, on_unfinished="no_answer")
    (t,) = loop.run(samples(1), loop.encode_prompts(samples(1)), 1, PARAMS)
    assert [m for m, _ in spans(tokenizer, t)] == [1, 0, 1, 0, 1] and t.truncated
    assert "<answer>" not in t.response_text


def test_response_token_budget_ends_the_trajectory():
    tokenizer = chat_tokenizer("chatml")
    loop = make_loop(
        tokenizer,
        lambda c: "<search>again</search>",
        answers=FakeAnswers(),
        max_response_tokens=100,
        on_unfinished="no_answer",
    )
    (t,) = loop.run(samples(1), loop.encode_prompts(samples(1)), 1, PARAMS)
    # a turn is 22 policy tokens and an observation 47: 22 + 47 + 22 + 47 would pass 100
    assert [r["tokens"] for r in t.turns] == [22, 22] and t.turns[0]["masked_tokens"] == 47
    assert [m for m, _ in spans(tokenizer, t)] == [1, 0, 1]
    assert t.truncated and t.turns[-1]["unfinished"] == "length" and len(t.response_ids) < 100


def test_long_observations_are_cut_to_max_observation_tokens():
    """The observation as the policy is fed it (turn markers and text) holds at most
    max_observation_tokens: the text is cut at a token and marked."""
    tokenizer = chat_tokenizer("chatml")

    class Verbose:
        async def __call__(self, argument, state):
            return Observation("word " * 100)

    chat = ChatRenderer(tokenizer, "user")
    markers = len(chat.observation_ids(""))  # the turn's end and the next's start
    mark = len(tokenizer(" [...]", add_special_tokens=False)["input_ids"])
    # the least a limit may be: the markers, the longer last-turn note and a token of text
    least = len(chat.observation_ids("\n\n" + max(LAST_TURN.values(), key=len))) + 1
    loop = make_loop(
        tokenizer,
        scripted(["<search>a</search>", "<search_complete>true</search_complete>"]),
        {"search": Verbose()},
        FakeAnswers(),
        max_observation_tokens=least + 12,
    )
    (t,) = loop.run(samples(1), loop.encode_prompts(samples(1)), 1, PARAMS)
    room = least + 12 - markers - mark
    kept = tokenizer.decode(tokenizer("word " * 100, add_special_tokens=False)["input_ids"][:room])
    assert spans(tokenizer, t)[1] == (0, EXPECTED_DELTA["chatml"].replace("OBS", kept + " [...]"))
    assert t.turns[0]["masked_tokens"] == least + 12
    with pytest.raises(ConfigError, match=rf"agent.max_observation_tokens={least - 1} is below the {least} tokens"):
        make_loop(tokenizer, scripted([]), max_observation_tokens=least - 1)


def test_policy_answers_itself_when_there_is_no_answer_generator():
    tokenizer = chat_tokenizer("chatml")
    turns = ["<search>a</search>", "<search_complete>true</search_complete>", "<answer>42</answer>"]
    loop = make_loop(tokenizer, scripted(turns), answer_generator="none")
    (t,) = loop.run(samples(1), loop.encode_prompts(samples(1)), 1, PARAMS)
    runs = spans(tokenizer, t)
    assert runs[2:] == [
        (1, "<search_complete>true</search_complete>"),
        (0, EXPECTED_DELTA["chatml"].replace("OBS", correction("answer_required"))),
        (1, "<answer>42</answer>"),  # the policy's answer is trained
    ]
    assert t.finish_reason == "answer" and "<answer>" in tokenizer.decode(loop.encode_prompts(samples(1))[0])


def test_failed_answer_generator_leaves_a_counted_error_observation():
    tokenizer = chat_tokenizer("chatml")
    loop = make_loop(
        tokenizer, scripted(["<search_complete>true</search_complete>"]), answers=FakeAnswers(fail=True)
    )
    (t,) = loop.run(samples(1), loop.encode_prompts(samples(1)), 1, PARAMS)
    assert spans(tokenizer, t)[-1] == (
        0,
        EXPECTED_DELTA["chatml"].replace("OBS", "answer generator returned HTTP 503"),
    )
    assert t.turns[-1]["error"] == "answer_error" and loop.stats["agent/errors/answer_error"] == 1
    assert t.finish_reason == "complete"


def test_finished_rows_leave_the_batch_and_release_their_cache():
    tokenizer = chat_tokenizer("chatml")
    # sample 0 completes at once; sample 1 searches twice first
    policy = lambda c: searcher(c) if "Q=q1" in c else "<search_complete>true</search_complete>"  # noqa: E731
    loop = make_loop(tokenizer, policy, answers=FakeAnswers())
    sessions = []
    open_session = loop.engine.open_session
    loop.engine.open_session = lambda p, n, reuse_cache=True: sessions.append(open_session(p, n, reuse_cache)) or sessions[-1]
    trajectories = loop.run(samples(2), loop.encode_prompts(samples(2)), 2, PARAMS)
    assert [len(t.turns) for t in trajectories] == [2, 2, 4, 4]
    assert sessions[0].released == {0, 1, 2, 3}
    # contexts generated from: 4 in turn 0, then only sample 1's two rows
    assert len(loop.engine.contexts_seen) == 4 + 2 + 2


# ------------------------------------------------------------------ the policy answers itself
def test_self_answering_agent_is_scored_on_its_own_answer():
    """configs/search_agent.yaml's agent and rewards (answer_generator: none; ndcg, anls, format): the
    policy searches, then answers; the answer tokens are trained and are what anls reads, never
    the answer-like text of an observation (a search hit, the last-turn notice)."""
    cfg = load_config(Path(__file__).parents[2] / "configs" / "search_agent.yaml", [])
    assert cfg.agent.answer_generator == "none"

    hit = "RESULT[{}] d1: quiz key <answer>Lisbon</answer>"

    class Search:
        async def __call__(self, argument, state):
            state.add_hits([{"id": "d1", "score": 1.0, "text": argument}])
            return Observation(hit.format(state.index))

    answers = [
        "<think>d1 says Lisbon</think><answer>Lisbon</answer>",
        "<answer>Oslo</answer>",
        "<answer>Lisbn</answer>",
    ]

    def policy(context):
        shown = re.findall(r"RESULT\[(\d)\]", context)
        if not shown or shown[0] == "3":  # row 3 never answers
            return "<search>capital</search>"
        return answers[int(shown[0])]

    tokenizer = chat_tokenizer("chatml")
    loop = AgentLoop(ScriptedEngine(tokenizer, policy), tokenizer, {"search": Search()}, cfg.agent)
    sample = Sample(
        uid="u0",
        messages=[{"role": "user", "content": "Q=capital"}],
        ground_truth="Lisbon",
        extra_info={"gold_docs": ["d1"]},
    )
    prompts = loop.encode_prompts([sample])
    assert PROTOCOL_SELF_ANSWER in tokenizer.decode(prompts[0]) and loop.answer_generator is None
    trajectories = loop.run([sample], prompts, 4, PARAMS)

    for j, (t, answer) in enumerate(zip(trajectories, answers)):
        observation = EXPECTED_DELTA["chatml"].replace("OBS", hit.format(j))
        assert spans(tokenizer, t) == [(1, "<search>capital</search>"), (0, observation), (1, answer)]
        n = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        assert tokenizer.decode(t.response_ids[-n:]) == answer and t.loss_mask[-n:] == [1] * n  # trained
        assert t.finish_reason == "answer" and [r["action"] for r in t.turns] == ["search", "answer"]
        assert t.response_text.endswith(f"</observation>\n{answer}")
    assert [final_answer(t.response_text) for t in trajectories] == ["Lisbon", "Oslo", "Lisbn", None]
    never = trajectories[3]
    assert never.truncated and [r["action"] for r in never.turns] == ["search"] * 4
    # answer-like text it did not write: three hits and the last-turn notice
    assert (
        never.response_text.count("<answer>Lisbon</answer>") == 3
        and LAST_TURN["answer"] in never.response_text
    )

    composite = CompositeReward.from_config(cfg.reward)
    composite.score(trajectories)
    assert [t.rewards for t in trajectories] == [
        {"ndcg": 1.0, "anls": 1.0, "format": 1.0},  # the gold value
        {"ndcg": 1.0, "anls": 0.0, "format": 1.0},  # a wrong value: edit distance 4 of 6, not below 0.5
        {"ndcg": 1.0, "anls": pytest.approx(1 - 1 / 6), "format": 1.0},  # one letter off: distance 1 of 6
        {"ndcg": 1.0, "anls": 0.0, "format": 0.0},  # no answer of its own: never finished
    ]
    assert [t.reward for t in trajectories] == pytest.approx(
        [1.0, 0.6, 0.4 + 0.4 * (1 - 1 / 6) + 0.2, 0.4]
    )
