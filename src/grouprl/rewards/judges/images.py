"""Images for a judge: from bytes, paths, doc ids, PIL images or dataset dicts to encoded bytes
no larger than a pixel budget.

An image whose pixel count fits the budget is sent as its original file bytes (so the cache key
stays the file's content); a larger one is downscaled, aspect ratio kept, and re-encoded
(PNG when it has transparency, JPEG otherwise).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from grouprl.rewards.judges.base import ImagePart

_PASSTHROUGH = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
_EXTENSIONS = ("", ".png", ".jpg", ".jpeg", ".webp")


class JudgeImageError(ValueError):
    """An image that cannot be found or decoded (message: one line)."""


def resolve_doc_image(doc_id: str, base_path: str) -> Path:
    """The image file of a doc id: `<base>/<id>`, else `<base>/<id>.png|.jpg|.jpeg|.webp`."""
    base = Path(base_path).expanduser()
    for extension in _EXTENSIONS:
        candidate = base / f"{doc_id}{extension}"
        if candidate.is_file():
            return candidate
    raise JudgeImageError(f"no image file for doc id {doc_id!r} in {base}")


def encode_image(image: Any, max_pixels: int, base_path: str = "") -> ImagePart:
    """`image` (bytes, path, PIL image, or {"bytes"|"path": ...}) as bytes within `max_pixels`."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, dict):  # the Hugging Face datasets Image feature stores {"bytes", "path"}
        image = image.get("bytes") or image.get("path")
    original: bytes | None = None
    if isinstance(image, (bytes, bytearray)):
        original = bytes(image)
    elif isinstance(image, (str, Path)):
        path = Path(image).expanduser()
        if not path.is_absolute() and base_path:
            path = Path(base_path).expanduser() / path
        try:
            original = path.read_bytes()
        except OSError as e:
            raise JudgeImageError(f"cannot read image {path}: {e.strerror or type(e).__name__}") from None
    elif not isinstance(image, Image.Image):
        raise JudgeImageError(f"unsupported image value of type {type(image).__name__}")

    if original is not None:
        try:
            picture = Image.open(io.BytesIO(original))
            picture.load()
        except (UnidentifiedImageError, OSError) as e:
            raise JudgeImageError(f"cannot decode image ({type(e).__name__})") from None
    else:
        picture = image

    width, height = picture.size
    if original is not None and width * height <= max_pixels and picture.format in _PASSTHROUGH:
        return ImagePart(data=original, mime_type=_PASSTHROUGH[picture.format])
    if width * height > max_pixels:
        factor = math.sqrt(max_pixels / (width * height))
        size = (max(1, int(width * factor)), max(1, int(height * factor)))
        picture = picture.resize(size, Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    if picture.mode in ("RGBA", "LA", "P"):
        picture.save(buffer, format="PNG")
        return ImagePart(data=buffer.getvalue(), mime_type="image/png")
    picture.convert("RGB").save(buffer, format="JPEG", quality=90)
    return ImagePart(data=buffer.getvalue(), mime_type="image/jpeg")
