"""Reward functions written for TRL's GRPOTrainer, and TRL-style datasets, used unchanged: a
function with TRL's batch parameters (`completions`, `prompts`, `completion_ids`, dataset
columns as lists, `**kwargs`) is called once per scored batch (a group, when rewards stream)
with what TRL passes, its list taken one value per completion, None meaning "not applicable";
a dataset's `prompt` (text or messages) and `solution` / `answer` / `ground_truth` column map
without renaming."""

import json

import pytest

from grouprl.data import load_samples
from grouprl.data.layout import describe_data_file
from grouprl.rewards import CompositeReward, RewardComponent, load_reward_function
from grouprl.rollout.trajectory import Trajectory

# what a TRL user has (written here; the same signatures as TRL's documented examples)
TRL_REWARDS = '''
import re

CALLS = []

def reward_len(completions, **kwargs):
    """Completions near 20 characters score best."""
    CALLS.append(("len", len(completions)))
    return [-abs(20 - len(c if isinstance(c, str) else c[0]["content"])) for c in completions]

def accuracy_reward(completions, solution, **kwargs):
    """1.0 when the last number of the completion is the solution; None when the solution is not a number."""
    CALLS.append(("accuracy", sorted(kwargs)))
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    rewards = []
    for content, sol in zip(contents, solution):
        if not re.fullmatch(r"-?\\d+", str(sol)):
            rewards.append(None)
            continue
        numbers = re.findall(r"-?\\d+", content)
        rewards.append(float(bool(numbers) and numbers[-1] == str(sol)))
    return rewards
'''


@pytest.fixture
def trl_file(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_REWARDS)
    return path


def write_trl_dataset(path, conversational=False):
    rows = [
        {"prompt": "What is 2+3?", "solution": "5", "level": 1},
        {"prompt": "What is 4+4?", "solution": "8", "level": 2},
        {"prompt": "Name a colour.", "solution": "blue", "level": 3},  # not a number: not applicable
    ]
    if conversational:
        for r in rows:
            r["prompt"] = [{"role": "user", "content": r["prompt"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trajectories_for(samples, responses):
    return [
        Trajectory(sample=s, index=i, prompt_ids=[1], response_text=text, response_ids=list(range(len(text))))
        for s, group in zip(samples, responses)
        for i, text in enumerate(group)
    ]


@pytest.mark.parametrize("conversational", [False, True])
def test_trl_rewards_score_as_written_once_a_group(tmp_path, trl_file, conversational):
    data = write_trl_dataset(tmp_path / "trl.jsonl", conversational)
    samples = load_samples([str(data)])
    assert [s.ground_truth for s in samples] == ["5", "8", "blue"] and samples[0].truth_column == "solution"
    assert samples[0].conversational is conversational
    assert describe_data_file(data) == "verl layout: prompt, solution (as the ground truth)"
    reward_len = load_reward_function(f"{trl_file}:reward_len")
    accuracy = load_reward_function(f"{trl_file}:accuracy_reward")
    composite = CompositeReward([RewardComponent("len", reward_len, weight=0.01), RewardComponent("acc", accuracy)])
    assert composite.components[0].batched and composite.components[1].batched
    responses = [["it is 5", "7"], ["4+4 = 8, so 8", "x" * 20], ["blue", "red"]]
    groups = [trajectories_for([s], [r]) for s, r in zip(samples, responses)]
    metrics = [composite.score(group) for group in groups]  # as streaming scores them: a group at a time
    got = [[(t.rewards["len"], t.rewards["acc"]) for t in group] for group in groups]
    assert got == [
        [(-13.0, 1.0), (-19.0, 0.0)],
        [(-7.0, 1.0), (0.0, 0.0)],
        [(-16.0, 0.0), (-17.0, 0.0)],  # accuracy: None (not applicable), counted as such
    ]
    assert [m["reward/not_applicable/acc"] for m in metrics] == [0.0, 0.0, 2.0]
    assert all(m["reward/errors"] == 0.0 for m in metrics)
    assert groups[0][0].reward == pytest.approx(0.01 * -13 + 1.0)
    calls = reward_len.__globals__["CALLS"] + accuracy.__globals__["CALLS"]
    assert [c for c in calls if c[0] == "len"] == [("len", 2)] * 3  # one call a group
    # what else TRL would pass: the prompts, token ids, and the dataset's other columns
    assert [c for c in calls if c[0] == "accuracy"][0] == (
        "accuracy", ["completion_ids", "data_source", "ground_truth", "level", "log_extra", "log_metric", "prompts", "trainer_state"]
    )
    report = composite.failure_report()
    assert report["component:acc"].failures == 0 and report["component:acc"].calls == 3  # one call a group


def test_a_trl_reward_that_returns_the_wrong_count_fails_every_completion(trl_file):
    def short(completions, **kwargs):
        return [1.0]

    def boom(completions, prompts, **kwargs):
        raise KeyError("solution")

    composite = CompositeReward([RewardComponent("short", short), RewardComponent("boom", boom)])
    sample = load_samples.__globals__["Sample"](uid="u", messages=[{"role": "user", "content": "q"}])
    trajectories = trajectories_for([sample], [["a", "b", "c"]])
    metrics = composite.score(trajectories)
    assert metrics["reward/errors/short"] == 3.0 and metrics["reward/errors/boom"] == 3.0
    report = composite.failure_report()
    assert (report["component:short"].calls, report["component:short"].failures) == (1, 1)  # one call, not 3
    assert report["component:short"].error == (
        "ValueError: returned 1 values for 3 completions (a TRL-style reward returns one value per completion)"
    )
    assert report["component:boom"].error == "KeyError: 'solution'"
