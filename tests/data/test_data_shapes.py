"""The built-in shapes task: deterministic, disjoint splits, and every answer true of the image
it was drawn into (checked by looking at the pixels)."""

import io

import numpy as np
import pytest
from PIL import Image

from grouprl.data.tasks import make_task
from grouprl.data.tasks.shapes import COLOURS, KINDS, SIZE, conversations, scenes


def pixels(sample):
    return np.asarray(Image.open(io.BytesIO(sample.images[0])).convert("RGB")).astype(int)


def painted(image, colour):
    return (np.abs(image - np.array(COLOURS[colour])).sum(-1) < 10)


def test_deterministic_and_disjoint():
    a, b = make_task("shapes", 300, 0, "train"), make_task("shapes", 300, 0, "train")
    assert [(s.uid, s.images, s.ground_truth) for s in a] == [(s.uid, s.images, s.ground_truth) for s in b]
    val = make_task("shapes", 100, 0, "val")
    train_scenes = {s.description() for s in scenes(2000, 0, "train")}
    assert not train_scenes & {s.description() for s in scenes(100, 0, "val")}
    assert {s.extra_info["kind"] for s in val} == set(KINDS)
    assert make_task("shapes", 5, 1, "train")[0].images != a[0].images


@pytest.mark.parametrize("sample", make_task("shapes", 120, 3, "train"), ids=lambda s: s.uid)
def test_every_answer_is_true_of_its_image(sample):
    image = pixels(sample)
    assert image.shape == (SIZE, SIZE, 3)
    assert sample.messages[-1]["content"].startswith("<image>")
    colours = [c for c in COLOURS if painted(image, c).sum() > 20]
    assert len(colours) == 1  # one colour of shapes on the grey background
    mask = painted(image, colours[0])
    kind, answer = sample.extra_info["kind"], sample.ground_truth
    if kind == "colour":
        assert answer == colours[0]
    elif kind == "side":
        xs = np.nonzero(mask)[1]
        assert (xs.mean() < SIZE / 2) == (answer == "left") and (xs.max() < SIZE / 2 or xs.min() > SIZE / 2 - 1)
    elif kind == "count":
        from scipy_free_labels import count_blobs

        assert count_blobs(mask) == int(answer)
    else:  # shape: how much of its bounding box the shape fills
        ys, xs = np.nonzero(mask)
        fill = mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
        expected = {"square": (0.95, 1.01), "circle": (0.7, 0.85), "triangle": (0.4, 0.62)}[answer]
        assert expected[0] <= fill <= expected[1], fill


def test_conversations_are_the_scenes_with_their_answers():
    records = conversations(10, 0, "val")
    samples = make_task("shapes", 10, 0, "val")
    for r, s in zip(records, samples):
        assert r["images"] == s.images and r["messages"][:2] == s.messages
        assert r["messages"][2] == {"role": "assistant", "content": f"<answer>{s.ground_truth}</answer>"}
