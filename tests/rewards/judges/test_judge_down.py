"""A judge that stops answering: the client counts failed calls in a row and, at the limit,
marks itself down and fails later calls without sending them; `rewards_down` turns every rank's
counts into one decision (reward.max_consecutive_failures, reward.max_failed_share)."""

import pytest

from grouprl.config import RewardConfig
from grouprl.data import Sample
from grouprl.errors import ConfigError
from grouprl.rewards.composite import CompositeReward, RewardComponent
from grouprl.rewards.failures import JudgeTally, JudgeUnavailableError, RewardFailingError, rewards_down
from grouprl.rewards.judges import JudgeClient, JudgeComponent, JudgeRequest
from grouprl.rewards.judges.base import JudgeResult
from grouprl.rollout.trajectory import Trajectory
from rewards.judges.fake_server import Reply


def requests(count, prefix="q"):
    return [JudgeRequest(question=f"{prefix}{i}", response="GRADE:3", request_id=f"r{i}") for i in range(count)]


def test_failures_in_a_row_mark_the_judge_down_and_later_calls_are_not_sent(start_server, judge_config, clients):
    down = {"now": True}
    server = start_server(behaviour=lambda call: Reply(kind="status", status=503) if down["now"] else Reply())
    # one request at a time and no retry (a retry's wait lets others in), so that "in a row" is
    # the order of the calls; the two calls still waiting for a slot are never sent
    cfg = judge_config(server, max_retries=0, max_concurrent_requests=1)
    client = JudgeClient(cfg, max_consecutive_failures=3)
    clients.append(client)
    results = client.judge_many(requests(5))
    assert [r.ok for r in results] == [False] * 5
    assert [r.attempts for r in results] == [1, 1, 1, 0, 0]
    assert server.requests == 3
    assert client.consecutive_failures == 3 and "503" in client.last_error
    assert client.down.startswith("3 calls in a row failed") and results[4].error.startswith("judge not called")
    down["now"] = False
    assert not any(r.ok for r in client.judge_many(requests(2, "later")))  # down stays down
    assert server.requests == 3


def test_an_answer_resets_the_count_and_no_limit_never_marks_down(start_server, judge_config, clients):
    answer = iter([False, False, True, False, False])  # ok? per call, in order
    server = start_server(behaviour=lambda call: Reply() if next(answer) else Reply(kind="status", status=500))
    client = JudgeClient(judge_config(server, max_retries=0, max_concurrent_requests=1), max_consecutive_failures=3)
    clients.append(client)
    assert [r.ok for r in client.judge_many(requests(5))] == [False, False, True, False, False]
    assert client.consecutive_failures == 2 and client.down is None
    unlimited = JudgeClient(judge_config(server, max_retries=0))  # the default: 0, never down
    clients.append(unlimited)
    answer = iter([False] * 10)
    assert not any(r.ok for r in unlimited.judge_many(requests(10, "u")))
    assert unlimited.consecutive_failures == 10 and unlimited.down is None


def test_rewards_down_decides_over_every_rank():
    ok = {"test": JudgeTally(calls=8, failures=0)}
    assert rewards_down([ok, ok], 50, 0.5) is None
    half = {"test": JudgeTally(calls=8, failures=4, in_row=4, error="HTTP 500: oops\nmore")}
    assert rewards_down([half], 50, 0.5) is None  # half is not more than half
    # one rank's calls all failed, the other's not: 8 of 16 over the run's two ranks
    assert rewards_down([{"test": JudgeTally(8, 8, 8, "HTTP 500: oops")}, ok], 50, 0.5) is None
    why = rewards_down([{"test": JudgeTally(8, 8, 8, "HTTP 500: oops\nbody")}, half], 50, 0.5)
    assert isinstance(why, JudgeUnavailableError) and str(why) == (
        "judge 'test' failed 12 of 16 calls (more than reward.max_failed_share=0.5; last error: HTTP 500: oops)"
    )
    # in a row: the ranks' own runs add up (30 + 30 >= 50) though neither reached the limit
    streak = [{"test": JudgeTally(calls=4, failures=1, in_row=30, error="timed out after 60s")}] * 2
    assert str(rewards_down(streak, 50, 0.5)) == (
        "judge 'test' failed 60 calls in a row (reward.max_consecutive_failures=50; last error: timed out after 60s)"
    )
    assert rewards_down(streak, 0, 1.0) is None  # both off


def test_the_composite_reports_each_judges_calls_since_the_last_report():
    class Judge:
        name, consecutive_failures, last_error = "vlm", 0, ""

        async def judge(self, request):
            if "bad" in request.response:
                self.consecutive_failures += 1
                self.last_error = "HTTP 503: busy"
                return JudgeResult(error=self.last_error, attempts=1)
            self.consecutive_failures = 0
            return JudgeResult(scores={"correctness": 1.0}, aggregate=1.0, attempts=1)

    judge = Judge()
    reward = CompositeReward([RewardComponent("judge", JudgeComponent(judge))], judges={"vlm": judge})
    assert not reward.drops
    trajectories = [
        Trajectory(
            sample=Sample(uid=f"u{i}", messages=[{"role": "user", "content": "q"}]),
            index=0,
            prompt_ids=[1],
            response_text=text,
        )
        for i, text in enumerate(["good", "bad", "good", "bad", "bad"])
    ]
    reward.score(trajectories)
    report = reward.failure_report()
    assert report == {"vlm": JudgeTally(calls=5, failures=3, in_row=judge.consecutive_failures, error="HTTP 503: busy")}
    assert reward.failure_report()["vlm"].calls == 0  # reset by the report
    dropping = CompositeReward([RewardComponent("judge", JudgeComponent(judge), on_failure="drop_group")])
    assert dropping.drops


@pytest.mark.parametrize(
    "setting,value", [("max_consecutive_failures", -1), ("max_failed_share", 1.5), ("max_failed_share", -0.1)]
)
def test_limits_are_checked(setting, value):
    with pytest.raises(ConfigError, match=f"reward.{setting}"):
        RewardConfig(**{setting: value})


def test_a_reward_component_failing_on_most_calls_is_down_naming_its_first_error():
    """Rule and user functions, reward models: the same limits as judges, over every rank; the
    line names the component and its first error (the one that says what is wrong)."""
    first = "TypeError: acc() missing 1 required positional argument: 'completions'"
    failing = {"component:acc": JudgeTally(calls=4, failures=4, in_row=4, error=first)}
    down = rewards_down([failing, {"component:acc": JudgeTally(calls=4, failures=1, error="ValueError: x")}], 50, 0.5)
    assert isinstance(down, RewardFailingError)
    assert str(down) == f"reward component 'acc' failed 5 of 8 calls (more than reward.max_failed_share=0.5; first error: {first})"
    streak = {"component:acc": JudgeTally(calls=1, failures=1, in_row=50, error=first)}
    assert "failed 50 calls in a row (reward.max_consecutive_failures=50" in str(rewards_down([streak], 50, 1.0))


def make_trajectories(texts):
    return [
        Trajectory(sample=Sample(uid=f"u{i}", messages=[{"role": "user", "content": "q"}]), index=0, prompt_ids=[1], response_text=text)
        for i, text in enumerate(texts)
    ]


def test_the_composite_tallies_every_other_components_calls_and_failures_in_a_row():
    calls = iter([1.0, float("nan"), ValueError("no column"), 0.5, KeyError("solution"), KeyError("solution")])

    def flaky(response):
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return value

    reward = CompositeReward([RewardComponent("flaky", flaky), RewardComponent("fine", lambda response: 1.0)])
    reward.score(make_trajectories(["a", "b", "c"]))
    report = reward.failure_report()
    assert report["component:flaky"] == JudgeTally(calls=3, failures=2, in_row=2, error="ValueError: returned nan")
    assert report["component:fine"] == JudgeTally(calls=3, failures=0, in_row=0)
    reward.score(make_trajectories(["d", "e", "f"]))
    report = reward.failure_report()  # since the last report; in a row: run-long
    assert report["component:flaky"] == JudgeTally(calls=3, failures=2, in_row=2, error="KeyError: 'solution'")
    assert rewards_down([report], 50, 0.5) is not None and rewards_down([report], 50, 0.7) is None
