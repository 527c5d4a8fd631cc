import ast
import operator
import re

import pytest

from grouprl.data.tasks import TASKS, make_task
from grouprl.data.tasks.arithmetic import EXAMPLE_ANSWER, EXAMPLE_QUESTION, make_arithmetic
from grouprl.errors import ConfigError
from grouprl.rewards.rules import correctness, strict_format

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression):
    """Integer arithmetic of + - * from the syntax tree: an answer key independent of the generator."""

    def walk(node):
        if isinstance(node, ast.BinOp):
            return OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant) and type(node.value) is int
        return node.value

    return walk(ast.parse(expression, mode="eval").body)


def question(sample):
    return sample.messages[-1]["content"]


def test_same_arguments_same_samples():
    assert make_arithmetic(50, seed=3) == make_arithmetic(50, seed=3)
    assert make_arithmetic(20, seed=3) == make_arithmetic(50, seed=3)[:20]  # a prefix, not a reshuffle
    assert [question(s) for s in make_arithmetic(20, seed=3)] != [
        question(s) for s in make_arithmetic(20, seed=4)
    ]


@pytest.mark.parametrize("train_seed, val_seed", [(0, 0), (0, 1)])
def test_train_and_val_share_no_question(train_seed, val_seed):
    train = {question(s) for s in make_arithmetic(3000, train_seed, "train")}
    val = {question(s) for s in make_arithmetic(300, val_seed, "val")}
    assert len(train) == 3000 and len(val) == 300  # no repeats inside a split
    assert not train & val
    assert EXAMPLE_QUESTION not in train | val


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_answers_match_the_stored_expression_and_the_question(difficulty):
    for sample in make_arithmetic(300, 5, difficulty=difficulty):
        expression = sample.extra_info["expression"]
        assert sample.ground_truth == str(evaluate(expression))
        # the expression uses the question's numbers, in the question's order
        assert re.findall(r"\d+", question(sample)) == re.findall(r"\d+", expression)
        assert int(sample.ground_truth) >= 0


def test_difficulty_one_is_small_single_step():
    samples = make_arithmetic(500, 0)
    assert all(0 <= int(s.ground_truth) <= 100 for s in samples)
    assert {s.extra_info["kind"] for s in samples} == {"add", "subtract", "multiply"}
    assert len({re.match(r"\w+", question(s)).group() for s in samples}) >= 10  # names and shapes vary


def test_higher_difficulty_adds_two_step_problems():
    kinds = {s.extra_info["kind"] for s in make_arithmetic(300, 0, difficulty=2)}
    assert {"add_subtract", "multiply_add"} <= kinds
    assert max(int(s.ground_truth) for s in make_arithmetic(300, 0, difficulty=3)) > 1000


def test_sample_fields():
    sample = make_arithmetic(43, 0)[42]
    assert sample.uid == "arith-train-00042"
    assert sample.data_source == "grouprl/arithmetic"
    assert sample.extra_info["index"] == 42 and sample.extra_info["split"] == "train"
    assert make_arithmetic(1, 0, "val")[0].uid == "arith-val-00000"


def test_prompt_has_system_then_one_worked_example_then_the_question():
    sample = make_arithmetic(1, 0)[0]
    roles = [m["role"] for m in sample.messages]
    assert roles == ["system", "user", "assistant", "user"]
    system = sample.messages[0]["content"]
    assert "<think></think>" in system and "<answer></answer>" in system
    assert sample.messages[1]["content"] == EXAMPLE_QUESTION
    assert sample.messages[2]["content"] == EXAMPLE_ANSWER == "<think>7 + 5 = 12</think>\n<answer>12</answer>"
    # the example is itself a perfect answer for the rewards the task is trained with
    assert strict_format(EXAMPLE_ANSWER) == 1.0 and correctness(EXAMPLE_ANSWER, "12") == 1.0
    # short prompts for a 135M model: ~110 tokens in ChatML, about 4 characters per token
    assert sum(len(m["content"]) for m in sample.messages) < 350


def test_without_few_shot_only_system_and_question():
    with_example = make_arithmetic(5, 0)
    without = make_arithmetic(5, 0, few_shot=False)
    assert [[m["role"] for m in s.messages] for s in without] == [["system", "user"]] * 5
    assert [question(s) for s in without] == [question(s) for s in with_example]


def test_zero_problems():
    assert make_arithmetic(0, 0) == []


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"split": "test"}, "split must be one of train, val"),
        ({"difficulty": 4}, "difficulty must be 1, 2 or 3"),
        ({"n": -1}, "n >= 0"),
    ],
)
def test_bad_arguments(kwargs, fragment):
    arguments = {"n": 3, "seed": 0, **kwargs}
    with pytest.raises(ConfigError, match=fragment):
        make_arithmetic(**arguments)


def test_task_registry():
    assert TASKS["arithmetic"] is make_arithmetic
    assert make_task("arithmetic", 4, 1, "val", few_shot=False) == make_arithmetic(
        4, 1, "val", few_shot=False
    )
    with pytest.raises(ConfigError, match="unknown task 'gsm8k': built-in tasks are arithmetic"):
        make_task("gsm8k", 4, 1)
