"""The one place that turns (messages, images) into model inputs for a VLM policy.

A prompt is rendered with the policy's chat template as text, each `<image>` placeholder is
replaced by the text its image expands to (the family's special tokens, e.g. one
`<|image_pad|>` per merged patch), and the whole string is tokenized once, as the model's own
processor does. The images travel on as `ImageInput`s (their processed pixels, in order), so the
update runs the very tensors generation ran.

Loading takes the tokenizer and the image processor (`AutoImageProcessor`) from the model
folder (a processor's chat template, `chat_template.jinja` / `chat_template.json`, wins over the
tokenizer's), not the `AutoProcessor` class: some families' processor classes need torchvision
for their video half, which a CPU install does not have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grouprl.errors import ModelLoadError
from grouprl.vision.families import Family, ImageInput, family_for
from grouprl.vision.images import IMAGE_PLACEHOLDER, fit_pixels, open_image, with_placeholders

PROCESSOR_CONFIG = "processor_config.json"


class VisionProcessor:
    def __init__(
        self,
        tokenizer: Any,
        family: Family,
        *,
        min_pixels: int = 0,
        max_pixels: int = 0,
        processor_config: dict[str, Any] | None = None,
    ):
        """`processor_config`: the model folder's processor_config.json (the processor's own
        settings, beside the image processor's), written back on save."""
        self.tokenizer, self.family = tokenizer, family
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.processor_config = dict(processor_config or {})

    @classmethod
    def load(cls, path: str, config, tokenizer, *, min_pixels: int = 0, max_pixels: int = 0, trust_remote_code=False):
        """The processor of the VLM at `path` (a folder or hub id); `tokenizer` is the policy's,
        given a chat template from the processor's files when they carry one."""
        from transformers import AutoImageProcessor

        try:
            image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"no image processor for the vision-language model at '{path}': {e}") from None
        template = _processor_chat_template(path)
        if template:
            tokenizer.chat_template = template
        family = family_for(config, tokenizer, image_processor)
        return cls(
            tokenizer, family, min_pixels=min_pixels, max_pixels=max_pixels, processor_config=_processor_config(path)
        )

    def save_pretrained(self, folder: str | Path) -> None:
        """Write the image processor and the processor's settings (the folder's own, with what
        the family needs for images to expand as here: `Family.processor_settings`); the
        tokenizer is saved by whoever saves the model."""
        self.family.image_processor.save_pretrained(folder)
        settings = {**self.processor_config, **self.family.processor_settings()}
        if settings:
            (Path(folder) / PROCESSOR_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")

    def prepare_image(self, image: Any, base_dir: str | Path | None = None, max_pixels: int = 0) -> ImageInput:
        """One image (path, bytes or PIL) within the pixel limits, processed for the model;
        `max_pixels` > 0: a tighter upper limit for this image (an observation's token budget)."""
        top = min(max_pixels, self.max_pixels) if max_pixels and self.max_pixels else max_pixels or self.max_pixels
        low = min(self.min_pixels, top) if top else self.min_pixels
        return self.family.prepare(fit_pixels(open_image(image, base_dir), low, top))

    def encode_text(self, text: str, images: list[ImageInput]) -> list[int]:
        """Token ids of `text` with each `<image>` replaced by the next image's expansion."""
        parts = text.split(IMAGE_PLACEHOLDER)
        if len(parts) - 1 != len(images):
            raise ValueError(f"{len(parts) - 1} {IMAGE_PLACEHOLDER} placeholders for {len(images)} images")
        expanded = parts[0] + "".join(image.text + part for image, part in zip(images, parts[1:]))
        ids = list(self.tokenizer(expanded, add_special_tokens=False)["input_ids"])
        found = sum(1 for t in ids if t == self.family.image_token_id)
        if found != sum(image.num_tokens for image in images):
            raise ModelLoadError(
                f"the tokenizer does not keep the image token {self.family.image_text!r} whole "
                f"({found} found for {sum(image.num_tokens for image in images)}); "
                "it must be one of the tokenizer's special tokens"
            )
        return ids

    def encode(self, messages: list[dict[str, Any]], images: list[Any], base_dir=None) -> tuple[list[int], list[ImageInput]]:
        """Prompt ids (the chat template with the generation prompt) and the processed images."""
        prepared = [self.prepare_image(image, base_dir) for image in images]
        text = self.tokenizer.apply_chat_template(
            with_placeholders(messages), tokenize=False, add_generation_prompt=True
        )
        return self.encode_text(text, prepared), prepared


def _processor_config(path: str) -> dict[str, Any]:
    """A local folder's processor_config.json, or nothing (a hub id: its settings come with
    the processor vLLM loads itself)."""
    file = Path(path) / PROCESSOR_CONFIG
    try:
        found = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _processor_chat_template(path: str) -> str | None:
    folder = Path(path)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None
