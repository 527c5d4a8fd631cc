"""The crop tool on images drawn in the test: exact pixels, display-size mapping, every mistake."""

import asyncio
import doctest

import pytest

from grouprl.data.sample import Sample
from grouprl.rollout.tools import crop as crop_module
from grouprl.rollout.tools.base import AgentState
from grouprl.rollout.tools.crop import CropTool, parse_box, to_original_pixels
from retriever.sample_index import gradient_image


def state_showing(image=None, size=None) -> AgentState:
    state = AgentState(sample=Sample(uid="q", messages=[]), index=0)
    state.current_image, state.current_image_size = image, size
    return state


def pixels(image):
    """Every pixel, row by row."""
    return [image.getpixel((x, y)) for y in range(image.height) for x in range(image.width)]


def crop(argument, state):
    return asyncio.run(CropTool()(argument, state))


@pytest.fixture
def page(tmp_path):
    """A 200 x 100 page whose pixel (x, y) is (x, y, 7), saved as PNG (lossless)."""
    path = tmp_path / "page.png"
    gradient_image((200, 100)).save(path)
    return str(path)


def test_doctests_pass():
    result = doctest.testmod(crop_module)
    assert result.failed == 0 and result.attempted >= 4


def test_crop_has_the_exact_pixels(page):
    state = state_showing(page, (200, 100))
    observation = crop("[10, 20, 30, 45]", state)
    assert observation.error is None
    [image] = observation.images
    assert image.size == (20, 25) and state.crops == [image]
    assert image.getpixel((0, 0)) == (10, 20, 7)
    assert image.getpixel((19, 24)) == (29, 44, 7)
    assert pixels(image) == [(x, y, 7) for y in range(20, 45) for x in range(10, 30)]
    assert observation.text == "Cropped region [10.0, 20.0, 30.0, 45.0] of the current image."


def test_box_on_a_resized_display_maps_to_original_pixels(page):
    state = state_showing(page, (100, 50))  # shown at half size
    [image] = crop("[10, 5, 20, 15]", state).images
    assert image.size == (20, 20)
    assert image.getpixel((0, 0)) == (20, 10, 7) and image.getpixel((19, 19)) == (39, 29, 7)
    # fractional display coordinates: x1/y1 round down, x2/y2 round up on the original
    [image] = crop("[10.3, 5.2, 20.1, 15.1]", state).images  # -> 20.6, 10.4, 40.2, 30.2
    assert image.size == (41 - 20, 31 - 10) and image.getpixel((0, 0)) == (20, 10, 7)
    assert len(state.crops) == 2 and state.current_image == page  # crops refer to the page


def test_box_is_clamped_to_the_image(page):
    state = state_showing(page, (200, 100))
    [image] = crop("[-30, -5, 500, 60]", state).images
    assert image.size == (200, 60) and image.getpixel((199, 59)) == (199, 59, 7)


def test_without_a_display_size_the_image_size_is_used(page):
    [image] = crop("[0, 0, 3, 2]", state_showing(page, None)).images
    assert pixels(image) == [(0, 0, 7), (1, 0, 7), (2, 0, 7), (0, 1, 7), (1, 1, 7), (2, 1, 7)]


def test_a_pil_image_can_be_the_current_image():
    state = state_showing(gradient_image((40, 30)), (40, 30))
    [image] = crop("[5 6 7 8]", state).images
    assert pixels(image) == [(5, 6, 7), (6, 6, 7), (5, 7, 7), (6, 7, 7)]


@pytest.mark.parametrize(
    "argument, kind, text",
    [
        (
            "[10, 20, 30]",
            "bbox_format",
            "Invalid <bbox>: expected four numbers [x1, y1, x2, y2], got 3 value(s).",
        ),
        (
            "[1, 2, 3, 4, 5]",
            "bbox_format",
            "Invalid <bbox>: expected four numbers [x1, y1, x2, y2], got 5 value(s).",
        ),
        ("", "bbox_format", "Invalid <bbox>: expected four numbers [x1, y1, x2, y2], got 0 value(s)."),
        ("[a, b, c, d]", "bbox_format", "Invalid <bbox>: coordinates must be numbers, got '[a, b, c, d]'."),
        ("[1, 2, nan, 4]", "bbox_format", "Invalid <bbox>: coordinates must be finite numbers."),
        (
            "[30, 20, 10, 40]",
            "bbox_empty",
            "Invalid <bbox>: [30.0, 20.0, 10.0, 40.0] is empty or inverted (need x1 < x2, y1 < y2).",
        ),
        (
            "[10, 20, 10, 40]",
            "bbox_empty",
            "Invalid <bbox>: [10.0, 20.0, 10.0, 40.0] is empty or inverted (need x1 < x2, y1 < y2).",
        ),
        (
            "[250, 10, 300, 20]",
            "bbox_empty",
            "<bbox> [250.0, 10.0, 300.0, 20.0] lies outside the image (size 200x100).",
        ),
    ],
)
def test_mistakes_are_counted_error_observations(page, argument, kind, text):
    state = state_showing(page, (200, 100))
    observation = crop(argument, state)
    assert (observation.error, observation.text, observation.images) == (text, text, [])
    assert state.errors == {kind: 1} and state.crops == []


def test_no_image_and_missing_file(tmp_path):
    state = state_showing(None)
    observation = crop("[0, 0, 5, 5]", state)
    assert observation.error == "No image to crop: search first, then crop the page it shows."
    assert state.errors == {"bbox_no_image": 1}

    state = state_showing(str(tmp_path / "gone.png"), (10, 10))
    observation = crop("[0, 0, 5, 5]", state)
    assert observation.error == "The current image gone.png cannot be opened (FileNotFoundError)."
    assert state.errors == {"bbox_image_missing": 1}

    (tmp_path / "bad.png").write_bytes(b"not an image")
    state = state_showing(str(tmp_path / "bad.png"), (10, 10))
    assert (
        crop("[0, 0, 5, 5]", state).error
        == "The current image bad.png cannot be opened (UnidentifiedImageError)."
    )


def test_parse_and_map_helpers():
    assert parse_box(" [1,2 , 3,4] ") == (1.0, 2.0, 3.0, 4.0)
    assert parse_box("1e1, -2, 3.5, 4") == (10.0, -2.0, 3.5, 4.0)
    assert to_original_pixels((0, 0, 100, 50), shown=(100, 50), original=(1000, 500)) == (0, 0, 1000, 500)
    assert to_original_pixels((33, 0, 34, 1), shown=(100, 100), original=(300, 300)) == (99, 0, 102, 3)


def test_a_crop_over_max_pixels_is_scaled_down_aspect_kept(page):
    """data.image_max_pixels reaches the crop tool: a crop with more pixels comes back scaled
    down to them (the whole 200 x 100 page under a quarter of its pixels: 100 x 50)."""
    state = state_showing(page, (200, 100))
    observation = asyncio.run(CropTool(max_pixels=200 * 100 // 4)("[0, 0, 200, 100]", state))
    [image] = observation.images
    assert image.size == (100, 50) and state.crops == [image]
    small = asyncio.run(CropTool(max_pixels=200 * 100 // 4)("[0, 0, 50, 50]", state_showing(page, (200, 100))))
    assert small.images[0].size == (50, 50)  # within the cap: as cropped
