import inspect

import pytest

from grouprl.errors import ConfigError
from grouprl.rewards import BUILTIN, load_reward_function

REWARD_FILE = """
import asyncio

LIMIT = 3

def length_bonus(response, ground_truth=None, **kwargs):
    return min(len(response), LIMIT) / LIMIT

async def slow_yes(response, **kwargs):
    await asyncio.sleep(0)
    return 1.0
"""


def test_builtin_names_give_the_registered_function():
    for name, function in BUILTIN.items():
        assert load_reward_function(name) is function


def test_function_from_a_relative_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    length_bonus = load_reward_function("my_rewards.py:length_bonus")
    assert length_bonus("ab") == pytest.approx(2 / 3)
    assert length_bonus("abcdef") == 1.0


def test_async_function_from_an_absolute_path(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_FILE)
    slow_yes = load_reward_function(f"{path}:slow_yes")
    assert inspect.iscoroutinefunction(slow_yes)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("nope.py:f", "reward file not found"),
        ("my_rewards.py:missing", "has no function 'missing'"),
        ("my_rewards.py:LIMIT", "'LIMIT' in reward file"),
        ("my_rewards.py", "names a file but no function"),
        ("my_rewards.py:", "names no function"),
        ("broken.py:f", "error importing reward file"),
        ("corectness", "unknown reward 'corectness'"),
    ],
)
def test_errors_are_one_line_config_errors(tmp_path, monkeypatch, spec, fragment):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    (tmp_path / "broken.py").write_text("def f(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=fragment) as caught:
        load_reward_function(spec)
    assert "\n" not in str(caught.value)


def test_unknown_name_lists_every_builtin():
    with pytest.raises(ConfigError) as caught:
        load_reward_function("accuracy")
    assert all(name in str(caught.value) for name in BUILTIN)


def test_not_callable_names_the_type(tmp_path):
    (tmp_path / "r.py").write_text("score = 1.5\n")
    with pytest.raises(ConfigError, match="is a float, not callable"):
        load_reward_function(f"{tmp_path / 'r.py'}:score")


def test_a_recipes_reward_file_and_prompt_beside_it_are_found_from_anywhere(tmp_path, monkeypatch):
    """A recipe that ships its reward file and judge prompt beside its YAML runs from any
    directory; a path that exists from the current directory keeps meaning that one."""
    import pickle

    import yaml

    from grouprl.config import load_config

    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "my_rewards.py").write_text(REWARD_FILE)
    (recipe / "grade.md").write_text("Grade {response}: reply {\"correctness\": 0-5}")
    (recipe / "run.yaml").write_text(yaml.safe_dump({"reward": {
        "components": [{"name": "len", "function": "my_rewards.py:length_bonus"}, {"name": "j", "function": "judge:j"}],
        "judges": [{"name": "j", "base_url": "http://127.0.0.1:9", "model": "m", "prompt_template": "grade.md"}],
        "val_metric": "len",
    }}))  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(recipe / "run.yaml")
    assert cfg.reward.components[0].function == f"{recipe / 'my_rewards.py'}:length_bonus"
    assert cfg.reward.judges[0].prompt_template == str(recipe / "grade.md")
    length_bonus = load_reward_function(cfg.reward.components[0].function)
    assert length_bonus("ab") == pytest.approx(2 / 3)
    assert pickle.loads(pickle.dumps(length_bonus)) is length_bonus  # its module is registered
    (elsewhere / "my_rewards.py").write_text(REWARD_FILE)  # the current directory's comes first
    assert load_config(recipe / "run.yaml").reward.components[0].function == "my_rewards.py:length_bonus"
    # an override is typed at the shell: relative to the current directory
    override = load_config(recipe / "run.yaml", ["reward.components[0].function=other.py:f"])
    assert override.reward.components[0].function == "other.py:f"
