"""The `<bbox>[x1, y1, x2, y2]</bbox>` tool: crop the page image the policy is looking at.

Coordinates are pixels of the image as shown to the policy (`state.current_image_size`,
(width, height)); they are scaled to the original image, x1/y1 rounded down and x2/y2 up
(the crop never loses a pixel the policy pointed at), and clamped to the image. The crop
(a PIL image, scaled down, aspect kept, to `max_pixels` when larger) is the observation's image and is appended to `state.crops`; the current
image stays the page, so the next box is again relative to the page.

Every mistake is an error observation, counted in `state.errors` by kind: `bbox_format`
(not four numbers), `bbox_empty` (x2 <= x1 or y2 <= y1, or nothing left after clamping),
`bbox_no_image` (nothing shown to crop), `bbox_image_missing` (the file is gone or unreadable).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from grouprl.rollout.tools.base import AgentState, Observation
from grouprl.vision.images import fit_pixels

_SEPARATORS = re.compile(r"[,\s]+")


def parse_box(argument: str) -> tuple[float, float, float, float]:
    """Four numbers from "[x1, y1, x2, y2]" (brackets and commas optional); ValueError otherwise.

    >>> parse_box("[10, 20.5, 30, 40]")
    (10.0, 20.5, 30.0, 40.0)
    >>> parse_box("10 20 30 40")
    (10.0, 20.0, 30.0, 40.0)
    """
    body = argument.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    parts = [p for p in _SEPARATORS.split(body.strip()) if p]
    if len(parts) != 4:
        raise ValueError(f"expected four numbers [x1, y1, x2, y2], got {len(parts)} value(s)")
    try:
        numbers = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"coordinates must be numbers, got {argument.strip()!r}") from None
    if not all(math.isfinite(n) for n in numbers):
        raise ValueError("coordinates must be finite numbers")
    return numbers  # type: ignore[return-value]


def to_original_pixels(
    box: tuple[float, float, float, float], shown: tuple[int, int], original: tuple[int, int]
) -> tuple[int, int, int, int]:
    """Map a box on the shown image to a clamped PIL crop box on the original.

    >>> to_original_pixels((10, 20, 30, 40), shown=(100, 50), original=(200, 100))
    (20, 40, 60, 80)
    >>> to_original_pixels((-5, 0, 500, 7.2), shown=(100, 50), original=(100, 50))
    (0, 0, 100, 8)
    """
    sx, sy = original[0] / shown[0], original[1] / shown[1]
    x1, y1, x2, y2 = box
    left = min(max(math.floor(x1 * sx), 0), original[0])
    top = min(max(math.floor(y1 * sy), 0), original[1])
    right = min(max(math.ceil(x2 * sx), 0), original[0])
    bottom = min(max(math.ceil(y2 * sy), 0), original[1])
    return left, top, right, bottom


class CropTool:
    name = "bbox"

    def __init__(self, max_pixels: int = 0):
        self.max_pixels = max_pixels  # a larger crop is scaled down to this many pixels (0 = never)

    async def __call__(self, argument: str, state: AgentState) -> Observation:
        try:
            box = parse_box(argument)
        except ValueError as e:
            return _error(state, "bbox_format", f"Invalid <bbox>: {e}.")
        if box[2] <= box[0] or box[3] <= box[1]:
            return _error(
                state,
                "bbox_empty",
                f"Invalid <bbox>: {list(box)} is empty or inverted (need x1 < x2, y1 < y2).",
            )
        if state.current_image is None:
            return _error(
                state, "bbox_no_image", "No image to crop: search first, then crop the page it shows."
            )
        try:
            image = _open(state.current_image)
        except OSError as e:
            name = Path(str(state.current_image)).name
            return _error(
                state,
                "bbox_image_missing",
                f"The current image {name} cannot be opened ({type(e).__name__}).",
            )
        shown = state.current_image_size or image.size
        crop_box = to_original_pixels(box, shown, image.size)
        if crop_box[2] <= crop_box[0] or crop_box[3] <= crop_box[1]:
            return _error(
                state,
                "bbox_empty",
                f"<bbox> {list(box)} lies outside the image (size {shown[0]}x{shown[1]}).",
            )
        crop = fit_pixels(image.crop(crop_box), max_pixels=self.max_pixels)
        state.crops.append(crop)
        return Observation(text=f"Cropped region {list(box)} of the current image.", images=[crop])


def _open(image: Any):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    with Image.open(image) as opened:
        opened.load()  # read now: the file may change or vanish later
        return opened.copy() if opened.mode in ("RGB", "RGBA", "L") else opened.convert("RGB")


def _error(state: AgentState, kind: str, text: str) -> Observation:
    state.count_error(kind)
    return Observation(text=text, error=text)
