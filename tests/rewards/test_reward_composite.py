import asyncio
import logging
import math

import pytest

from grouprl.config import RewardComponentConfig, RewardConfig
from grouprl.data.sample import Sample
from grouprl.errors import ConfigError
from grouprl.rewards import CompositeReward, RewardComponent
from grouprl.rollout.trajectory import Trajectory

GOOD = "<think>7 + 5 = 12</think>\n<answer>12</answer>"


def make_trajectories(responses, ground_truth="12"):
    sample = Sample(
        uid="q1",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "What is 7 + 5?"},
        ],
        ground_truth=ground_truth,
        extra_info={"level": 2},
    )
    return [
        Trajectory(sample=sample, index=i, prompt_ids=[1, 2], response_text=r)
        for i, r in enumerate(responses)
    ]


def test_weighted_sum_from_config():
    config = RewardConfig(
        components=[
            RewardComponentConfig(name="correctness", weight=1.0),
            RewardComponentConfig(name="format", function="strict_format", weight=0.5),
            RewardComponentConfig(name="tags", function="xml_count", weight=2.0),
        ]
    )
    trajectories = make_trajectories([GOOD, "<answer>13</answer>", "12"])
    metrics = CompositeReward.from_config(config).score(trajectories)

    # by hand: correctness, strict_format, xml_count per response
    assert trajectories[0].rewards == {"correctness": 1.0, "format": 1.0, "tags": 0.5}
    assert trajectories[1].rewards == {"correctness": 0.0, "format": 0.0, "tags": 0.25}
    assert trajectories[2].rewards == {"correctness": 0.0, "format": 0.0, "tags": 0.0}
    assert [t.reward for t in trajectories] == [1.0 + 0.5 + 1.0, 0.5, 0.0]
    mean = (2.5 + 0.5 + 0.0) / 3
    assert metrics == pytest.approx(
        {
            "reward/correctness": 1 / 3,
            "reward/format": 1 / 3,
            "reward/tags": 0.75 / 3,
            "reward/mean": mean,
            "reward/std": math.sqrt(((2.5 - mean) ** 2 + (0.5 - mean) ** 2 + mean**2) / 3),
            "reward/errors": 0.0,
            "reward/errors/correctness": 0.0,
            "reward/errors/format": 0.0,
            "reward/errors/tags": 0.0,
        }
    )


def test_component_kwargs_reach_the_function():
    config = RewardConfig(
        components=[
            RewardComponentConfig(name="c", function="correctness", kwargs={"allow_last_number": True})
        ]
    )
    trajectories = make_trajectories(["so 7 + 5 = 12"])
    CompositeReward.from_config(config).score(trajectories)
    assert trajectories[0].reward == 1.0


def test_functions_get_the_context_their_signature_names():
    seen = {}

    def only_response(response):
        seen["only_response"] = response
        return 1.0

    def prompt_and_info(response, prompt, extra_info, scale=1.0):
        seen["prompt_and_info"] = (prompt, extra_info, scale)
        return 1.0

    def everything(response, **kwargs):
        seen["everything"] = dict(kwargs)
        return 1.0

    trajectories = make_trajectories([GOOD])
    composite = CompositeReward(
        [
            RewardComponent("a", only_response),
            RewardComponent("b", prompt_and_info, kwargs={"scale": 3.0}),
            RewardComponent("c", everything, kwargs={"k": 1}),
        ]
    )
    composite.score(trajectories)
    assert seen["only_response"] == GOOD
    assert seen["prompt_and_info"] == ("What is 7 + 5?", {"level": 2}, 3.0)  # the LAST user turn
    assert set(seen["everything"]) == {"ground_truth", "prompt", "extra_info", "sample", "trajectory", "k"}
    assert seen["everything"]["trajectory"] is trajectories[0]
    assert seen["everything"]["sample"] is trajectories[0].sample


def test_prompt_is_the_text_of_multimodal_content():
    got = []
    trajectories = make_trajectories([GOOD])
    trajectories[0].sample.messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is shown?"}]}
    ]
    CompositeReward([RewardComponent("p", lambda response, prompt: got.append(prompt) or 0.0)]).score(
        trajectories
    )
    assert got == ["what is shown?"]


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (lambda response: 1 / 0, "ZeroDivisionError: division by zero"),
        (lambda response: float("nan"), "ValueError: returned nan"),
        (lambda response: float("-inf"), "ValueError: returned -inf"),
        (lambda response: None, "TypeError: returned NoneType"),
        (lambda response: "1.0", "TypeError: returned str"),
    ],
)
def test_failing_component_gets_the_fallback_and_is_counted(caplog, bad, fragment):
    composite = CompositeReward(
        [RewardComponent("good", lambda response: 1.0, weight=2.0), RewardComponent("bad", bad, weight=3.0)],
        fallback=-0.5,
    )
    trajectories = make_trajectories([GOOD, GOOD, GOOD])
    with caplog.at_level(logging.WARNING, logger="grouprl.rewards.composite"):
        metrics = composite.score(trajectories)
        metrics_again = composite.score(make_trajectories([GOOD]))

    assert [t.rewards["bad"] for t in trajectories] == [-0.5] * 3
    assert [t.reward for t in trajectories] == [2.0 - 1.5] * 3
    assert metrics["reward/errors"] == 3.0
    assert metrics["reward/errors/bad"] == 3.0
    assert metrics["reward/errors/good"] == 0.0
    assert metrics["reward/bad"] == -0.5
    assert metrics_again["reward/errors"] == 1.0  # counts are per call
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # the first failure only, across calls
    assert "'bad'" in warnings[0] and fragment in warnings[0] and "\n" not in warnings[0]


def test_numpy_and_bool_values_are_numbers():
    import numpy as np

    composite = CompositeReward(
        [
            RewardComponent("np", lambda response: np.float32(0.25)),
            RewardComponent("flag", lambda response: True),
        ]
    )
    trajectories = make_trajectories([GOOD])
    metrics = composite.score(trajectories)
    assert trajectories[0].rewards == {"np": 0.25, "flag": 1.0}
    assert type(trajectories[0].rewards["np"]) is float
    assert metrics["reward/errors"] == 0.0


def make_rendezvous(count):
    """An async reward that finishes only once `count` calls are in flight at the same time:
    run one after another, the first call times out (and is counted as an error)."""
    arrived = []

    async def rendezvous(response, ground_truth=None, **kwargs):
        arrived.append(response)

        async def everyone_here():
            while len(arrived) < count:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(everyone_here(), timeout=5)
        return 0.75

    return rendezvous


def test_async_components_run_concurrently():
    composite = CompositeReward(
        [
            RewardComponent("judge", make_rendezvous(4), weight=2.0),
            RewardComponent("rule", lambda response: 1.0),
        ]
    )
    trajectories = make_trajectories(["a", "b", "c", "d"])
    metrics = composite.score(trajectories)
    assert metrics["reward/errors"] == 0.0
    assert [t.rewards["judge"] for t in trajectories] == [0.75] * 4
    assert [t.reward for t in trajectories] == [2.5] * 4


def test_async_failure_is_counted():
    async def broken(response):
        raise RuntimeError("judge offline")

    trajectories = make_trajectories(["a", "b"])
    metrics = CompositeReward([RewardComponent("judge", broken)], fallback=0.1).score(trajectories)
    assert metrics["reward/errors/judge"] == 2.0
    assert [t.reward for t in trajectories] == [0.1, 0.1]


def test_score_inside_a_running_event_loop_and_ascore():
    composite = CompositeReward([RewardComponent("judge", make_rendezvous(2))])

    async def caller():
        first = make_trajectories(["a", "b"])
        composite.score(first)  # from inside a loop: awaited in a helper thread
        composite.components[0].fn = make_rendezvous(2)
        second = make_trajectories(["c", "d"])
        metrics = await composite.ascore(second)
        return first, second, metrics

    first, second, metrics = asyncio.run(caller())
    assert [t.reward for t in first + second] == [0.75] * 4
    assert metrics["reward/errors"] == 0.0


def test_custom_function_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "custom.py").write_text(
        "async def polite(response, prompt, **kwargs):\n"
        "    return 1.0 if 'please' in response else 0.0\n"
        "def short(response, limit=5):\n"
        "    return float(len(response) <= limit)\n"
    )
    monkeypatch.chdir(tmp_path)
    config = RewardConfig(
        components=[
            RewardComponentConfig(name="polite", function="custom.py:polite", weight=0.5),
            RewardComponentConfig(name="short", function="custom.py:short", kwargs={"limit": 6}),
        ]
    )
    trajectories = make_trajectories(["please", "no", "please do"])
    metrics = CompositeReward.from_config(config).score(trajectories)
    assert [t.reward for t in trajectories] == [1.5, 1.0, 0.5]
    assert metrics["reward/polite"] == pytest.approx(2 / 3)


def test_empty_batch_reports_only_error_counts():
    composite = CompositeReward([RewardComponent("one", lambda response: 1.0)])
    assert composite.score([]) == {"reward/errors": 0.0, "reward/errors/one": 0.0}


def needs_answer(response, answer):
    return 1.0


@pytest.mark.parametrize(
    "components, fragment",
    [
        ([RewardComponent("a", lambda response: 1.0), RewardComponent("a", lambda response: 1.0)], "unique"),
        ([RewardComponent("mean", lambda response: 1.0)], "reserved"),
        ([], "at least one"),
    ],
)
def test_bad_composites_are_config_errors(components, fragment):
    with pytest.raises(ConfigError, match=fragment):
        CompositeReward(components)


@pytest.mark.parametrize(
    "fn, kwargs, fragment",
    [
        (needs_answer, {}, "required argument answer"),
        (lambda response: 1.0, {"limit": 3}, "takes no argument limit"),
        (lambda response, **kw: 1.0, {"response": "x"}, "may not set response"),
    ],
)
def test_uncallable_signatures_fail_before_scoring(fn, kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RewardComponent("c", fn, kwargs=kwargs)


def test_unknown_function_in_config_is_a_config_error():
    config = RewardConfig(components=[RewardComponentConfig(name="accuracy")])
    with pytest.raises(ConfigError, match="unknown reward 'accuracy'"):
        CompositeReward.from_config(config)
