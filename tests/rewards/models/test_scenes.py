"""The Pillow stand-ins for a text-to-image model and CLIP: what the renderer reads, what it
draws, and the scorer's rule worked by hand on pictures whose objects are known."""

import itertools

import numpy as np
import pytest

from grouprl.data.tasks.scene_language import (
    BACKGROUND,
    COLOURS,
    COUNTS,
    REGIONS,
    SHAPES,
    Clause,
    Said,
    describe,
    parse_description,
    parse_request,
)
from grouprl.rewards.models.scenes import NEAR, SceneRenderer, SceneScorer, find_blobs

REQUEST = "a pair of crimson balls in the upper left corner"  # 2 red circles top-left
PAIR = "two red balls in the upper left and a navy box at the bottom right"  # + 1 blue square bottom-right


def score(description, request=REQUEST, seed=0, size=64):
    image = SceneRenderer(size)([description], [seed])[0]
    return SceneScorer()([image], [request])[0]


def pixels(image):
    return np.asarray(image).astype(int)


def test_requests_read_as_their_scenes():
    assert parse_request(REQUEST) == (Clause(2, "red", "circle", "top-left"),)
    assert parse_request(PAIR) == (
        Clause(2, "red", "circle", "top-left"),
        Clause(1, "blue", "square", "bottom-right"),
    )
    assert parse_request("I want, in the lower-right corner, an emerald wedge.") == (
        Clause(1, "green", "triangle", "bottom-right"),
    )
    with pytest.raises(ValueError, match="a purple ball in the upper left"):
        parse_request("a purple ball in the upper left")
    with pytest.raises(ValueError, match="count, colour, shape and place"):
        parse_request("two red balls")
    with pytest.raises(ValueError, match="one place"):
        parse_request("a red ball in the upper left and a blue box at the top left")


def test_description_language():
    two = [Said(2, "red", "circle", "top-left"), Said(1, "blue", "square", "bottom-right")]
    assert parse_description("2 red circles top-left; 1 blue square bottom-right") == two
    assert parse_description("2 Red Circles  TOP LEFT.\n- 1 blue square bottom-right!") == two
    assert parse_description("2 red circles top-left, 1 blue square bottom-right") == two
    assert parse_description("red circles") == [Said(None, "red", "circle", None)]
    assert parse_description("3 top-left; 5 squares") == [Said(None, None, "square", None)]  # 5: no count
    # free-form English: no colour or shape word the renderer knows
    assert parse_description(REQUEST) == []
    assert parse_description("") == []


def test_canonical_description_scores_one():
    assert score("2 red circles top-left") == 1.0
    assert score("2 red circles top-left; 1 blue square bottom-right", PAIR) == 1.0


@pytest.mark.parametrize(
    "description, expected",
    [
        # missed: something in the region (NEAR), not the colour; neither object asked for (precision 0)
        ("2 blue circles top-left", NEAR * 1 / 2),
        # missed: the colour somewhere (NEAR), nothing in the region; precision 0
        ("2 red circles bottom-right", NEAR * 1 / 2),
        # count min/max = 1/2
        ("1 red circle top-left", 1 / 2 + 1 / 8 + 1 / 4),
        ("3 red circles top-left", 1 / 2 + (2 / 3) / 4 + 1 / 4),
        # shape 0
        ("2 red squares top-left", 3 / 4),
        ("2 red triangles top-left", 3 / 4),
        # objects nobody asked for: precision 2/3, 2/5
        ("2 red circles top-left; 1 blue square bottom-right", (1 + 2 / 3) / 2),
        ("2 red circles top-left; 3 green triangles bottom-left", (1 + 2 / 5) / 2),
        # wrong colour, place and shape: nothing near
        ("3 blue squares bottom-right", 0.0),
    ],
)
def test_one_clause_loses_the_worked_fraction(description, expected):
    assert NEAR == 0.1
    assert score(description) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "description, expected",
    [
        ("2 red circles top-left", 0.5),  # the second clause 0 (no blue, nothing bottom-right)
        ("1 blue square bottom-right", 0.5),
        # each clause missed with both near credits (its colour is drawn, its region holds the
        # other group): recall 0.2; no object where it was asked: precision 0
        ("2 red circles bottom-right; 1 blue square top-left", 0.2 / 2),
        ("2 red circles top-left; 1 blue circle bottom-right", (1 + 3 / 4) / 2),
    ],
)
def test_two_clauses_average(description, expected):
    assert score(description, PAIR) == pytest.approx(expected, abs=1e-6)


def test_drawing_everything_everywhere_does_not_pay():
    """The generic answer a policy could learn instead of reading the request: a group of each
    colour in each quadrant scores far below the right description."""
    spray = "; ".join(f"1 {c} circle {r}" for c, r in zip(("red", "blue", "green", "yellow"), ("top-left", "top-right", "bottom-left", "bottom-right")))
    # the red circle in the top-left is a hit (count 1/2): clause 7/8; 1 of 4 objects asked for
    assert score(spray) == pytest.approx(7 / 8 * (1 + 1 / 4) / 2, abs=1e-6)
    assert score(spray) < 0.6 * score("2 red circles top-left")


def test_free_form_request_verbatim_draws_nothing():
    image = SceneRenderer()([REQUEST], [0])[0]
    assert (pixels(image) == BACKGROUND).all()
    assert SceneScorer()([image], [REQUEST]) == [0.0]


def test_unsaid_fields_come_from_the_seed():
    """A clause's unsaid fields are seeded draws: each picture equals the one of a full clause."""
    renderer = SceneRenderer()
    full = [describe([Clause(*c)]) for c in itertools.product(COUNTS, COLOURS, ("circle",), REGIONS)]
    for seed in range(6):
        drawn = pixels(renderer(["red circle"], [seed])[0])
        matches = [d for d in full if np.array_equal(pixels(renderer([d], [seed])[0]), drawn)]
        assert len(matches) == 1 and " red circle" in matches[0]
    assert len({renderer(["red circle"], [s])[0].tobytes() for s in range(12)}) > 1


def test_deterministic_and_seeded():
    renderer = SceneRenderer()
    text = "2 red circles top-left; 3 yellow triangles bottom-right"
    a, b = renderer([text, text], [7, 7])
    assert np.array_equal(pixels(a), pixels(b))
    c = renderer([text], [8])[0]
    assert not np.array_equal(pixels(a), pixels(c))
    request = "two red balls in the upper left and three canary wedges in the lower right"
    assert SceneScorer()([a, c], [request, request]) == [1.0, 1.0]


def test_equal_seeds_differ_only_by_prompt():
    prompts = [
        "2 red circles top-left; 1 blue square bottom-right",
        "2 red circles top-left; 1 green square bottom-right",
    ]
    blue, green = (pixels(image) for image in SceneRenderer()(prompts, [3, 3]))
    assert np.array_equal(blue[:32], green[:32])  # the top half: the same red circles
    square = (blue[32:] != BACKGROUND).any(-1)
    assert square.sum() > 50 and np.array_equal(square, (green[32:] != BACKGROUND).any(-1))  # the same square
    assert (blue[32:][square] == COLOURS["blue"]).all() and (green[32:][square] == COLOURS["green"]).all()


@pytest.mark.parametrize("size", [64, 96])
def test_every_group_is_found_as_drawn(size):
    """Every count, colour, shape and place, several seeds: the scorer sees what was drawn."""
    renderer = SceneRenderer(size)
    for (n, colour, shape, region), seed in itertools.product(
        itertools.product(COUNTS, COLOURS, SHAPES, REGIONS), range(3)
    ):
        blobs = find_blobs(renderer.draw([Said(n, colour, shape, region)], seed))
        found = [(b.colour, b.region, b.shape) for b in blobs]
        assert found == [(colour, region, shape)] * n, (n, shape, seed)


def test_four_groups_at_once_score_one():
    clauses = [Clause(3, "red", "triangle", "top-left"), Clause(2, "green", "square", "top-right"),
               Clause(3, "blue", "circle", "bottom-left"), Clause(2, "yellow", "triangle", "bottom-right")]  # fmt: skip
    request = ("three red triangles in the top left and two green boxes in the top right and "
               "three blue dots in the bottom left and two yellow wedges in the bottom right")  # fmt: skip
    assert parse_request(request) == tuple(clauses)
    assert all(score(describe(clauses), request, seed) == 1.0 for seed in range(5))


def test_mismatched_batches_and_bad_requests_raise():
    image = SceneRenderer()(["1 red circle top-left"], [0])[0]
    with pytest.raises(ValueError, match="1 images but 2 requests"):
        SceneScorer()([image], [REQUEST, REQUEST])
    with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
        SceneRenderer()(["a", "b"], [0])
    with pytest.raises(ValueError, match="draw me something nice"):
        SceneScorer()([image], ["draw me something nice"])
    with pytest.raises(ValueError, match="at least 48"):
        SceneRenderer(32)
