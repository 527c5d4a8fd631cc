import doctest

import pytest

from grouprl.rewards import BUILTIN, retrieval, rules, verl_scorers
from grouprl.rewards.rules import (
    contains_integer,
    correctness,
    extract_answer,
    extract_number,
    soft_format,
    strict_format,
    xml_count,
)

GOOD = "<think>7 + 5 = 12</think>\n<answer>12</answer>"


def test_doctests_pass():
    result = doctest.testmod(rules)
    assert result.failed == 0
    assert result.attempted >= 30  # the examples really ran


def test_builtin_registry_names_every_rule_and_retrieval_metric():
    assert BUILTIN == {
        "correctness": correctness,
        "strict_format": strict_format,
        "soft_format": soft_format,
        "xml_count": xml_count,
        "contains_integer": contains_integer,
        "overlong_penalty": rules.overlong_penalty,
        "gsm8k": rules.gsm8k,
        "boxed": rules.boxed,
        "search_em": rules.search_em,
        "verl_default": verl_scorers.verl_default,
        "math_verl": verl_scorers.math_verl,
        "math_dapo": verl_scorers.math_dapo,
        "geo3k": verl_scorers.geo3k,
        "agent_format": retrieval.agent_format,
        "ndcg": retrieval.ndcg,
        "recall": retrieval.recall,
        "anls": retrieval.anls,
        "exact_match": retrieval.exact_match,
    }


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,234", 1234.0),
        ("-3", -3.0),
        ("4.50", 4.5),
        ("$12", 12.0),
        ("12%", 12.0),
        ("first 3 then 1,000,000.25 dollars", 1_000_000.25),
        ("8-3", 3.0),  # subtraction, not -3
        ("x = -8", -8.0),
        ("12,34", 34.0),  # not a thousands group
        ("", None),
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


def test_extract_answer_takes_the_last_block_stripped():
    assert extract_answer("<answer>\n 3 \n</answer> and <answer>4</answer>") == "4"
    assert extract_answer("<answer>unclosed") is None
    assert extract_answer("<answer></answer>") == ""


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (GOOD, 12, 1.0),
        (GOOD, 12.0, 1.0),
        (GOOD, "12", 1.0),
        (GOOD, "She has 12.\n#### 12", 1.0),
        (GOOD, "13", 0.0),
        ("<answer>0.3</answer>", 0.1 + 0.2, 1.0),
        ("<answer>1,000,000.5</answer>", 1_000_000, 1.0),  # 5e-7 relative: inside 1e-6
        ("<answer>12.0001</answer>", 12, 0.0),  # 8e-6 relative: outside
        ("<answer>0</answer>", "0", 1.0),
        ("<answer>-4</answer>", "4", 0.0),
        ("<answer>Paris </answer>", " paris", 1.0),
        ("<answer>Paris, France</answer>", "paris", 0.0),
        ("<answer>11</answer>", ["10", "11"], 1.0),
        ("<answer>twelve</answer>", "12", 0.0),
        ("7 + 5 = 12", "12", 0.0),  # no tags and no allow_last_number
    ],
)
def test_correctness(response, truth, expected):
    assert correctness(response, truth) == expected


def test_correctness_last_number_is_only_a_fallback_for_missing_tags():
    assert correctness("7 + 5 = 12", "12", allow_last_number=True) == 1.0
    assert correctness("7 + 5 = 13", "12", allow_last_number=True) == 0.0
    # the answer block wins over a later number
    assert correctness("<answer>5</answer> though 12", "12", allow_last_number=True) == 0.0


def test_correctness_without_ground_truth_raises():
    with pytest.raises(ValueError, match="ground truth"):
        correctness(GOOD, None)


@pytest.mark.parametrize(
    "response, expected",
    [
        (GOOD, 1.0),
        ("\n  " + GOOD + "\n\n", 1.0),
        ("<think>a\nb</think>\n<answer>12</answer>", 1.0),
        ("<think></think>\n<answer>12</answer>", 1.0),
        ("<think>a</think><answer>12</answer>", 0.0),  # missing newline
        ("<think>a</think>\n\n<answer>12</answer>", 0.0),  # two newlines
        (GOOD + " done", 0.0),
        ("<think>a</think>\n<answer>  </answer>", 0.0),
        ("<answer>12</answer>", 0.0),
        ("<think>a<answer>1</answer></think>\n<answer>12</answer>", 0.0),
        ("<think>a</think>\n<answer>1</answer><answer>12</answer>", 0.0),
    ],
)
def test_strict_format(response, expected):
    assert strict_format(response) == expected


def test_strict_format_with_optional_think():
    assert strict_format("<answer>12</answer>", require_think=False) == 1.0
    assert strict_format(GOOD, require_think=False) == 1.0
    assert strict_format("<think>a</think> <answer>12</answer>", require_think=False) == 0.0
    assert strict_format("hmm <answer>12</answer>", require_think=False) == 0.0


@pytest.mark.parametrize(
    "response, expected",
    [
        ("anything <answer>12</answer>", 1.0),
        ("<answer></answer>\n", 1.0),
        ("<answer>12</answer> because", 0.0),
        ("</answer><answer>12", 0.0),
        ("<answer>1</answer> <answer>2</answer>", 0.0),
        ("no tags", 0.0),
    ],
)
def test_soft_format(response, expected):
    assert soft_format(response) == expected


def test_soft_format_accepts_only_the_given_end_of_text_token():
    assert soft_format("<answer>1</answer><|im_end|>", eos_token="<|im_end|>") == 1.0
    assert soft_format("<answer>1</answer><|im_end|>") == 0.0
    assert soft_format("<answer>1</answer><|im_end|>x", eos_token="<|im_end|>") == 0.0


@pytest.mark.parametrize(
    "response, expected",
    [
        (GOOD, 0.5),
        ("<think>a</think>", 0.25),
        ("<answer>12</answer>", 0.25),
        ("<think>a</think><think>", 0.125),  # <think> twice: only </think> counts
        ("<answer>1</answer><think>a</think>", 0.25),  # answer tags come before the think tags
        (GOOD + "\n" + "x" * 20 + "  ", 0.48),
        (GOOD + "y" * 500, 0.375),  # the penalty stops at the 0.125 </answer> earned
    ],
)
def test_xml_count(response, expected):
    assert xml_count(response) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<answer>12</answer>", 1.0),
        ("<answer> +7 </answer>", 1.0),
        ("<answer>1,234</answer>", 1.0),
        ("<answer>12.0</answer>", 0.0),
        ("<answer>$12</answer>", 0.0),
        ("<answer>1,23</answer>", 0.0),
        ("12", 0.0),
    ],
)
def test_contains_integer(response, expected):
    assert contains_integer(response) == expected


def test_dapos_overlong_penalty_as_a_component():
    """verl's DAPO reward manager by hand: 20 tokens allowed, the last 8 a buffer, factor 1.0."""
    from grouprl.config import ConfigError
    from grouprl.data import Sample
    from grouprl.rewards import CompositeReward, RewardComponent
    from grouprl.rewards.rules import overlong_penalty
    from grouprl.rollout.trajectory import Trajectory

    shaping = RewardComponent("overlong", overlong_penalty, kwargs={"max_length": 20, "buffer_len": 8})
    composite = CompositeReward([shaping])
    sample = Sample(uid="u", messages=[{"role": "user", "content": "q"}])
    lengths = [5, 12, 13, 16, 20]
    trajectories = [Trajectory(sample=sample, index=i, prompt_ids=[1], response_ids=[7] * n) for i, n in enumerate(lengths)]
    composite.score(trajectories)
    assert [t.rewards["overlong"] for t in trajectories] == [0.0, 0.0, -1 / 8, -0.5, -1.0]
    with pytest.raises(ConfigError, match="required argument buffer_len, max_length"):
        RewardComponent("overlong", overlong_penalty)
