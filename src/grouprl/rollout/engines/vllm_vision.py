"""A vision-language policy's requests on the vLLM engine (`vision=` the family).

A prompt or a conversation with images goes to vLLM as token ids, each image's expansion
collapsed to the placeholder vLLM's processor expands (`<|image_pad|>` between Qwen's vision
markers, Idefics3/SmolVLM's `<image>`), plus the source images (`ImageInput.source`, the very
image the trainer's processor read) keyed by their pixel fingerprints (`ImageInput.key`). vLLM
processes them with the same image processor class and settings (its on-device normalisation is
off, so the processor normalises as the trainer's does) and runs its own vision tower on the
result. Every request is checked before it is queued: each image's token count in vLLM's
expansion equals the trainer's, the expanded prompt equals the trainer's ids, and vLLM's pixel
tensors equal the trainer's in the dtype vLLM computes with (vLLM casts a processor's floating
outputs to its model's dtype: bf16 pixels for a bf16 engine, the trainer's float32 pixels
rounded as its own bf16 compute rounds them); `ImageMismatch` otherwise, naming the prompt, the
image, the dtype and the processor settings that differ.
A prompt's n samples are one request, so its images are processed once; later turns of a session
send the same images under the same keys, which vLLM's processor cache (emptied after each
rollout) and prefix cache find. Image and frame tokens are never sampled (`bad_words`), so vLLM's
log-probs are the update's, renormalised over the others. A weight push also drops vLLM's encoder
cache (image features of the old vision tower).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from grouprl.errors import ConfigError, ModelLoadError

# vLLM reports at most this many chosen tokens' log-probs a step (its MAX_LOGPROB_TOKEN_IDS)
MAX_REPORTED = 128
_MOST_MASS = 1 - 1e-12  # the never-sampled tokens' mass, below 1 so the correction stays finite

# where each family's processor settings live, for the token-count error
_SETTINGS_HINT = {
    "idefics": " (Idefics3/SmolVLM: `image_seq_len` in processor_config.json, the tokens per tile)",
    "qwen": " (Qwen: `min_pixels` / `max_pixels` in preprocessor_config.json)",
}


class ImageMismatch(ModelLoadError):
    """vLLM's processing of a prompt's images differs from the trainer's (token count, expanded
    ids or pixels); `prompt` is the prompt's index in the `generate` call."""

    def __init__(self, prompt: int, message: str):
        super().__init__(message)
        self.prompt = prompt


def placeholder_text(family) -> str:
    """The text vLLM's processor expands one image from: Qwen's `<|image_pad|>` inside its vision
    markers (vLLM writes the run of pads), Idefics3/SmolVLM's `<image>` (vLLM writes the frames,
    tile tags and image tokens)."""
    if family.name == "qwen":
        return family.start_text + family.image_text + family.end_text
    if family.name == "idefics":
        return family.image_text
    raise ConfigError(f"rollout.engine=vllm has no image placeholder for the {family.name!r} VLM family")


def collapse_images(ids: list[int], expansions: list[list[int]], placeholder: list[int]) -> list[int]:
    """`ids` with each image's expansion (`expansions[j]`, the token ids of image j's text, in
    order) replaced by `placeholder`. ValueError where an image's tokens are not found in order."""
    out: list[int] = []
    at = 0
    for j, expansion in enumerate(expansions):
        start = _find(ids, expansion, at)
        if start < 0:
            raise ValueError(f"image {j}'s tokens are not in the prompt (after position {at})")
        out.extend(ids[at:start])
        out.extend(placeholder)
        at = start + len(expansion)
    out.extend(ids[at:])
    return out


def _find(ids: list[int], part: list[int], start: int) -> int:
    """The first index >= start where `part` occurs in `ids`, or -1."""
    first, size = part[0], len(part)
    try:
        k = ids.index(first, start)
        while ids[k : k + size] != part:
            k = ids.index(first, k + 1)
        return k
    except ValueError:
        return -1


class ImageRequests:
    """What the engine adds to its requests for a VLM policy of `family` (see the module
    docstring): the requests with their images, checked; the sampling arguments that keep image
    and frame tokens from being sampled; the log-probs renormalised over the other tokens."""

    def __init__(self, tokenizer: Any, family):
        self.tokenizer, self.family = tokenizer, family
        self.placeholder = list(tokenizer(placeholder_text(family), add_special_tokens=False)["input_ids"])
        self.expansions: dict[str, list[int]] = {}  # an image's text -> its token ids
        self.never_sampled = family.never_sampled()
        self.bad_words = self._banned_words(self.never_sampled)
        self.allowed: list[int] | None = None  # the other tokens, where bad_words cannot say it
        self.their_processor = None  # -> vLLM's image processor, for a mismatch's message

    # ------------------------------------------------------------------ requests
    def inputs(self, llm, prompts: list[list[int]], images: list[list] | None) -> list:
        """vLLM's input of every prompt: its ids, or for a prompt with images the request vLLM's
        processor has expanded, checked against the trainer's (`check`)."""
        inputs: list = [{"prompt_token_ids": list(p)} for p in prompts]
        with_images = [i for i in range(len(prompts)) if images is not None and images[i]]
        if not with_images:
            return inputs
        requests = [self.request(i, prompts[i], images[i]) for i in with_images]
        self.their_processor = lambda: their_image_processor(llm)
        rendered = llm.llm_engine.renderer.render_cmpl(requests)
        try:
            for i, request in zip(with_images, rendered):
                self.check(i, prompts[i], images[i], request)
                inputs[i] = request
        except ImageMismatch:
            llm.reset_mm_cache()  # nothing of these requests is queued: forget their images
            raise
        return inputs

    def request(self, i: int, prompt: list[int], images: list) -> dict:
        """Prompt i's request before vLLM's processor: its ids with each image collapsed to the
        placeholder, the source images and their keys."""
        for j, image in enumerate(images):
            if getattr(image, "source", None) is None:
                raise ValueError(
                    f"image {j} of prompt {i} carries no source image for vLLM "
                    "(images are prepared with VisionProcessor.prepare_image)"
                )
        try:
            ids = collapse_images(list(prompt), [self._expansion(image) for image in images], self.placeholder)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        return {
            "prompt_token_ids": ids,
            "multi_modal_data": {"image": [image.source for image in images]},
            # the pixel fingerprint: vLLM's processor and prefix caches know a repeated image by it
            "multi_modal_uuids": {"image": [image.key for image in images]},
        }

    def _expansion(self, image) -> list[int]:
        if image.text not in self.expansions:
            self.expansions[image.text] = list(self.tokenizer(image.text, add_special_tokens=False)["input_ids"])
        return self.expansions[image.text]

    def check(self, i: int, prompt: list[int], images: list, request: Mapping) -> None:
        """vLLM's expansion of prompt i holds as many tokens for each image as the trainer's, in
        the same places (the expanded ids equal the trainer's), and its pixel tensors are the
        trainer's (checked where vLLM processed the image for this request; a cached one was
        checked when first processed)."""
        places = request["mm_placeholders"].get("image", [])
        for j, (image, place) in enumerate(zip(images, places)):
            count = place.length if place.is_embed is None else int(place.is_embed.sum())
            if count != image.num_tokens:
                raise ImageMismatch(
                    i,
                    f"prompt {i}, image {j} ({image.original_size[0]}x{image.original_size[1]}): vLLM expands it to "
                    f"{count} image tokens, the trainer's processor to {image.num_tokens}; both must read the "
                    f"model folder's processor settings{_SETTINGS_HINT.get(self.family.name, '')}; "
                    + self.differences(),
                )
        got = list(request["prompt_token_ids"])
        if len(places) != len(images) or got != list(prompt):
            at = next((k for k, (a, b) in enumerate(zip(got, prompt)) if a != b), min(len(got), len(prompt)))
            raise ImageMismatch(
                i,
                f"prompt {i}: vLLM's expansion of its {len(images)} images differs from the trainer's "
                f"({len(places)} placed, {len(got)} ids for {len(prompt)}, first difference at token {at})",
            )
        items = request["mm_kwargs"].get("image", [])
        for j, (image, item) in enumerate(zip(images, items)):
            if item is None:
                continue
            for name, tensor in image.tensors.items():
                theirs = item[name].data if name in item else None
                if theirs is None or same_values(tensor, theirs):
                    continue
                dtype = str(theirs.dtype).removeprefix("torch.")
                said = f" in {dtype} (vLLM's dtype)" if theirs.dtype != tensor.dtype else ""
                raise ImageMismatch(
                    i,
                    f"prompt {i}, image {j}: vLLM's processor gives other {name} than the trainer's{said}; "
                    + self.differences(),
                )

    def differences(self) -> str:
        """What tells the trainer's image processor from vLLM's (read from the model folder): the
        settings that differ, or their classes where the settings agree."""
        theirs = self.their_processor() if self.their_processor is not None else None
        ours = self.family.image_processor
        if theirs is None:
            return f"the trainer's image processor ({type(ours).__name__}) differs from the model folder's, which vLLM reads"
        a, b = _settings(ours), _settings(theirs)
        keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if keys:
            shown = ", ".join(f"{k} {a.get(k, '(unset)')!r} here, {b.get(k, '(unset)')!r} in vLLM's" for k in keys[:4])
            return f"the image processors' settings differ ({shown}; vLLM reads the model folder's preprocessor_config.json)"
        if type(ours).__name__ != type(theirs).__name__:
            return f"the image processors differ in class ({type(ours).__name__} here, {type(theirs).__name__} in vLLM's)"
        return f"the image processors agree in class ({type(ours).__name__}) and settings: the images were processed elsewhere"

    def forget(self, llm) -> None:
        """A rollout has ended: its processed images (a host copy of each) go."""
        llm.reset_mm_cache()
        self.expansions.clear()

    # ------------------------------------------------------------------ sampling
    def raw_banned(self, logprobs_mode: str) -> list[int]:
        """The never-sampled tokens whose log-probs each step reports, where vLLM's log-probs are
        its raw ones (taken before any token is masked): their mass is taken out afterwards. vLLM
        reports at most 128 chosen tokens; a family with more stays uncorrected (none has)."""
        if logprobs_mode != "raw_logprobs":
            return []
        return self.never_sampled if 0 < len(self.never_sampled) <= MAX_REPORTED else []

    def _banned_words(self, banned: list[int]) -> list[str] | None:
        """The never-sampled tokens as vLLM's `bad_words` (each one token, banned everywhere), or
        None where one of them does not encode to itself alone (then `allowed_token_ids`)."""
        words = [self.tokenizer.convert_ids_to_tokens(t) for t in banned]
        for word, token in zip(words, banned):
            if not isinstance(word, str) or self.tokenizer.encode(word, add_special_tokens=False) != [token]:
                return None
        return words

    def never(self, llm) -> dict:
        """Sampling arguments that keep a VLM's image and frame tokens from being sampled; vLLM
        masks them before its processed log-probs, as the update excludes them."""
        if not self.never_sampled:
            return {}
        if self.bad_words is not None:
            return {"bad_words": self.bad_words}
        if self.allowed is None:
            banned = set(self.never_sampled)
            vocab = llm.llm_engine.model_config.get_vocab_size()
            self.allowed = [t for t in range(vocab) if t not in banned]
        return {"allowed_token_ids": self.allowed}


def same_values(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether vLLM's tensor holds the trainer's values as vLLM computes with them: vLLM casts a
    processor's floating outputs to its model's dtype (bf16 pixels for a bf16 engine), which is
    also what the trainer's bf16 compute does with its float32 pixels at the tower's first product."""
    if theirs.numel() != ours.numel():
        return False
    ours = ours.reshape(theirs.shape)
    if theirs.dtype != ours.dtype and theirs.is_floating_point() and ours.is_floating_point():
        ours = ours.to(theirs.dtype)
    return ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def their_image_processor(llm):
    """vLLM's Hugging Face image processor (vLLM internals: None where they moved)."""
    try:
        return llm.llm_engine.renderer.get_mm_processor().info.get_hf_processor().image_processor
    except Exception:  # noqa: BLE001 - only a message's detail depends on it
        return None


def _settings(processor) -> dict:
    """An image processor's settings, comparable: enums as their values, sequences as tuples."""
    out = {}
    for key, value in processor.to_dict().items():
        if key.startswith("_") or key in ("image_processor_type", "processor_class"):
            continue
        value = getattr(value, "value", value)
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def renormalised(log_probs: list[float], steps: list, banned: list[int]) -> list[float]:
    """Each sampled token's raw log-prob renormalised over the tokens that can be sampled (the
    `banned` tokens' mass, reported at every step of `steps`, taken out), as the update does."""
    return [
        lp - math.log1p(-min(sum(math.exp(step[b].logprob) for b in banned if b in step), _MOST_MASS))
        for lp, step in zip(log_probs, steps)
    ]
