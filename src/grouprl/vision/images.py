"""Images as datasets store them (a path relative to the data file, raw bytes, the
`{"bytes", "path"}` dict that datasets/parquet writers use, or a PIL image) -> RGB PIL images,
and the pixel-count limits users set for VLMs (`data.image_min_pixels` / `image_max_pixels`)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a prompt's text (verl's convention); one per image, in order."""


class ImageError(ValueError):
    """An image that cannot be read; the message says why (the caller names the row)."""


def open_image(value: Any, base_dir: str | Path | None = None):
    """An RGB PIL image from a path (relative paths resolve against `base_dir`), bytes, a
    `{"bytes": ..., "path": ...}` dict, or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        if value.get("bytes"):
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        else:
            raise ImageError("an image entry with neither 'bytes' nor 'path'")
    try:
        if isinstance(value, (bytes, bytearray, memoryview)):
            with Image.open(io.BytesIO(bytes(value))) as image:
                return image.convert("RGB")
        if isinstance(value, (str, Path)):
            path = Path(value).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = Path(base_dir) / path
            if not path.is_file():
                raise ImageError(f"image file not found: {path}")
            with Image.open(path) as image:
                return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ImageError(f"unreadable image ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    raise ImageError(f"an image must be a path, bytes or a {{bytes, path}} dict, got {type(value).__name__}")


def resolve(value: Any, base_dir: str | Path) -> Any:
    """A relative image path (also inside a {bytes, path} dict without bytes) made absolute
    against `base_dir`; bytes and absolute paths unchanged."""
    if isinstance(value, dict) and not value.get("bytes") and value.get("path"):
        return {**value, "path": resolve(value["path"], base_dir)}
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else Path(base_dir) / path)
    return value


def check_image(value: Any) -> None:
    """Raise ImageError unless `value` names or holds a readable image (verified, not decoded)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
        if value is None:
            raise ImageError("an image entry with neither 'bytes' nor 'path'")
    try:
        if isinstance(value, (bytes, bytearray, memoryview)):
            with Image.open(io.BytesIO(bytes(value))) as image:
                image.verify()
            return
        if isinstance(value, (str, Path)):
            if not Path(value).is_file():
                raise ImageError(f"image file not found: {value}")
            with Image.open(value) as image:
                image.verify()
            return
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ImageError(f"unreadable image ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    raise ImageError(f"an image must be a path, bytes or a {{bytes, path}} dict, got {type(value).__name__}")


def fit_pixels(image, min_pixels: int = 0, max_pixels: int = 0):
    """`image` scaled (aspect kept) so that width x height lies within [min_pixels, max_pixels]
    (0 = no bound); unchanged when it already does."""
    width, height = image.size
    pixels = width * height
    if max_pixels and pixels > max_pixels:
        scale = math.sqrt(max_pixels / pixels)
    elif min_pixels and pixels < min_pixels:
        scale = math.sqrt(min_pixels / pixels)
    else:
        return image
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    if max_pixels and size[0] * size[1] > max_pixels:  # rounding may overshoot by a row
        size = (max(1, size[0] - 1), max(1, size[1] - 1))
    return image.resize(size)


def count_placeholders(messages: list[dict[str, Any]]) -> int:
    """`<image>` placeholders over all messages (content text, or image parts of a content list)."""
    total = 0
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    total += 1
                elif isinstance(part, dict):
                    total += str(part.get("text", "")).count(IMAGE_PLACEHOLDER)
        else:
            total += str(content).count(IMAGE_PLACEHOLDER)
    return total


def with_placeholders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose content is text with `<image>` placeholders (content lists of text and
    image parts, as chat-template users write them, flattened)."""
    out = []
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, list):
            content = "".join(
                IMAGE_PLACEHOLDER if part.get("type") == "image" else str(part.get("text", ""))
                for part in content
                if isinstance(part, dict)
            )
        out.append({**message, "content": content})
    return out
