"""The built-in scenes task: deterministic, disjoint splits of varied requests, each understood
by the scorer as its stored scene, whose canonical description renders a picture scoring 1."""

import statistics

import pytest

from grouprl.data.tasks import TASKS, make_task
from grouprl.data.tasks.scene_language import (
    COLOUR_WORDS,
    COUNT_WORDS,
    SHAPE_WORDS,
    Clause,
    describe,
    parse_request,
)
from grouprl.data.tasks.scenes import (
    EXAMPLE_DESCRIPTION,
    EXAMPLE_REQUEST,
    SYSTEM_PROMPT,
    make_scenes,
    split_of,
)
from grouprl.errors import ConfigError
from grouprl.rewards.models.scenes import SceneRenderer, SceneScorer


def request(sample):
    return sample.messages[-1]["content"]


@pytest.fixture(scope="module")
def train():
    return make_task("scenes", 2000, 0, "train")


@pytest.fixture(scope="module")
def val():
    return make_task("scenes", 300, 0, "val")


def test_registered_and_deterministic():
    assert TASKS["scenes"] is make_scenes
    assert make_scenes(50, 3) == make_scenes(50, 3)
    assert make_scenes(20, 3) == make_scenes(50, 3)[:20]  # a prefix, not a reshuffle
    assert [request(s) for s in make_scenes(20, 3)] != [request(s) for s in make_scenes(20, 4)]


def test_splits_are_disjoint(train, val):
    assert len({request(s) for s in train}) == 2000 and len({request(s) for s in val}) == 300
    assert not {s.ground_truth for s in train} & {s.ground_truth for s in val}  # no scene in both
    assert all(split_of(s.ground_truth) == "train" for s in train)
    assert all(split_of(s.ground_truth) == "val" for s in val)
    for s in train + val:
        assert request(s) != EXAMPLE_REQUEST and s.ground_truth != EXAMPLE_DESCRIPTION


def test_prompt_is_system_example_request(val):
    sample = val[0]
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "user"]
    assert sample.messages[0]["content"] == SYSTEM_PROMPT
    assert sample.messages[1:3] == [
        {"role": "user", "content": EXAMPLE_REQUEST},
        {"role": "assistant", "content": "2 red circles bottom-right; 1 yellow square top-left"},
    ]
    assert request(sample) == sample.extra_info["request"]
    assert sample.uid == "scenes-val-00000" and sample.data_source == "grouprl/scenes"
    assert [m["role"] for m in make_scenes(1, 0, "val", few_shot=False)[0].messages] == ["system", "user"]


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "val"])
def test_every_request_parses_and_its_description_scores_one(split, train, val):
    samples = train if split == "train" else val
    for s in samples:
        clauses = tuple(Clause(**c) for c in s.extra_info["clauses"])
        assert parse_request(request(s)) == clauses
        assert s.ground_truth == describe(clauses)
    images = SceneRenderer()([s.ground_truth for s in samples], list(range(len(samples))))
    assert SceneScorer()(images, [request(s) for s in samples]) == [1.0] * len(samples)


def test_requests_are_varied_and_not_renderable_as_written(train, val):
    text = " ".join(request(s) for s in train)
    for words in [*COLOUR_WORDS.values(), *COUNT_WORDS.values()]:
        assert all(f" {w} " in f" {text} " for w in words), words
    for forms in SHAPE_WORDS.values():
        assert all(f" {w}" in text for form in forms for w in form), forms
    assert {"upper", "lower", "corner", "top", "bottom"} <= set(text.split())
    assert {len(s.extra_info["clauses"]) for s in train} == {1, 2}
    # the requests given to the renderer verbatim: far from the canonical descriptions' 1.0
    images = SceneRenderer()([request(s) for s in val], list(range(len(val))))
    verbatim = SceneScorer()(images, [request(s) for s in val])
    assert statistics.mean(verbatim) < 0.3


def test_options_and_errors():
    assert all(len(s.extra_info["clauses"]) == 1 for s in make_scenes(100, 0, max_clauses=1))
    with pytest.raises(ConfigError, match="split"):
        make_scenes(1, 0, "test")
    with pytest.raises(ConfigError, match="max_clauses"):
        make_scenes(1, 0, max_clauses=3)
    with pytest.raises(ConfigError, match="unknown task"):
        make_task("scene", 1, 0)
