"""The model kinds a reward-model worker loads, each with one batched call.

Drawers (`draw(prompts, seeds) -> images`, an exception in place of a prompt it could not draw):
text_to_image (diffusers), http_image (a service), scene_renderer.
Scorers (`score(images, texts) -> floats`): clip, scene_scorer; `classify(prompts, responses)`:
sequence_classifier. Everything heavy is imported inside the class that needs it.
"""

from __future__ import annotations

import os
from typing import Any

from grouprl.errors import ModelLoadError, missing_local_path

DRAWERS = ("text_to_image", "http_image", "scene_renderer")


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _source(cfg) -> str:
    """The folder or hub id from_pretrained reads: `path` with "~" expanded; a local path that
    does not exist is one line (transformers would call it a malformed repo id)."""
    missing = missing_local_path(cfg.path)
    if missing is not None:
        raise ModelLoadError(f"reward model {cfg.name!r}: path '{cfg.path}' does not exist ({missing})")
    return os.path.expanduser(cfg.path)


def _needs_diffusers(cfg) -> ModelLoadError:
    return ModelLoadError(f"reward model {cfg.name!r} (text_to_image) needs diffusers: pip install 'grouprl[image]'")


class Clip:
    """Cosine similarity of CLIP/SigLIP image and text embeddings (x scale)."""

    def __init__(self, cfg) -> None:
        from transformers import AutoModel, AutoProcessor

        self.device, self.scale = cfg.device, cfg.scale
        path = _source(cfg)
        self.model = AutoModel.from_pretrained(path, dtype=_torch_dtype(cfg.dtype)).to(cfg.device).eval()
        self.processor = AutoProcessor.from_pretrained(path)
        # SigLIP was trained on texts padded to max_length; CLIP pads to the longest
        self.padding = "max_length" if "siglip" in self.model.config.model_type else True

    def score(self, images: list[Any], texts: list[str]) -> list[float]:
        import torch

        inputs = self.processor(
            text=texts, images=images, return_tensors="pt", padding=self.padding, truncation=True
        ).to(self.device)
        with torch.no_grad():
            image = _embedding(self.model.get_image_features(pixel_values=inputs["pixel_values"].to(self.model.dtype)))
            text_inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
            text = _embedding(self.model.get_text_features(**text_inputs))
        image = torch.nn.functional.normalize(image.float(), dim=-1)
        text = torch.nn.functional.normalize(text.float(), dim=-1)
        return ((image * text).sum(-1) * self.scale).tolist()


def _embedding(output):
    """get_*_features returns a tensor, or (newer transformers) an output with pooler_output."""
    return output if hasattr(output, "shape") else output.pooler_output


class SequenceClassifier:
    """A trained reward model: one logit of AutoModelForSequenceClassification over the
    conversation (prompt as the user turn, response as the assistant's), chat-templated when
    the tokenizer has a template."""

    def __init__(self, cfg) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device, self.label, self.max_length = cfg.device, cfg.label, cfg.max_length
        path = _source(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # pad on the right (positions as when scored alone, whatever the model's position
        # scheme); cut long texts from the left, so the response being scored is what is kept
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=_torch_dtype(cfg.dtype))
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(cfg.device).eval()

    def text(self, prompt: str, response: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt + response

    def classify(self, prompts: list[str], responses: list[str]) -> list[float]:
        import torch

        texts = [self.text(p, r) for p, r in zip(prompts, responses)]
        inputs = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length,
            add_special_tokens=not getattr(self.tokenizer, "chat_template", None),
        ).to(self.device)  # fmt: skip
        with torch.no_grad():
            logits = self.model(**inputs).logits
        return logits[:, self.label].float().tolist()


class TextToImage:
    """A diffusers pipeline from a local folder (or hub id): one image per prompt, each from its
    own seeded generator, so equal seeds give images that differ only by prompt."""

    def __init__(self, cfg) -> None:
        try:
            from diffusers import DiffusionPipeline
        except ImportError:
            raise _needs_diffusers(cfg) from None
        self.cfg = cfg
        self.pipe = DiffusionPipeline.from_pretrained(_source(cfg), torch_dtype=_torch_dtype(cfg.dtype)).to(cfg.device)
        self.pipe.set_progress_bar_config(disable=True)

    def draw(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        import torch

        c = self.cfg
        generators = [torch.Generator(device=c.device).manual_seed(s) for s in seeds]
        out = self.pipe(
            prompt=prompts, num_inference_steps=c.steps, guidance_scale=c.guidance_scale,
            height=c.height, width=c.width, generator=generators,
        )  # fmt: skip
        return list(out.images)


class HttpImage:
    """An image-generation service with the OpenAI images API shape: POST
    <base_url>/images/generations {model, prompt, n: 1, size, response_format: b64_json, seed}.
    A batch's requests run concurrently (batch_size at a time); 408/429/5xx and connection
    errors are retried (Retry-After honoured, else exponential backoff with jitter). The key is
    read from the environment here and never appears in an error."""

    def __init__(self, cfg) -> None:
        import os

        import httpx

        self.cfg = cfg
        key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        if cfg.api_key_env and not key:
            raise RuntimeError(f"environment variable {cfg.api_key_env} (reward model {cfg.name}'s key) is not set")
        self._key = key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=cfg.base_url.rstrip("/"), headers=headers, timeout=cfg.timeout_s)

    def draw(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        from concurrent.futures import ThreadPoolExecutor

        def one(prompt, seed):  # a failed request is that prompt's result, not the batch's
            try:
                return self.one(prompt, seed)
            except Exception as e:  # noqa: BLE001
                return e

        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), self.cfg.batch_size))) as pool:
            return list(pool.map(one, prompts, seeds))

    def one(self, prompt: str, seed: int) -> Any:
        import base64
        import io
        import time

        import httpx
        from PIL import Image

        from grouprl.rewards.judges.openai_compat import RETRYABLE_STATUS, backoff_delay, parse_retry_after

        c = self.cfg
        body = {
            "model": c.path, "prompt": prompt, "n": 1, "size": f"{c.width}x{c.height}",
            "response_format": "b64_json", "seed": seed,
        }  # fmt: skip
        for attempt in range(c.max_retries + 1):
            wait = None
            try:
                reply = self.http.post("/images/generations", json=body)
            except httpx.HTTPError as e:
                problem = f"image service unreachable ({type(e).__name__})"
            else:
                if reply.status_code == 200:
                    data = reply.json()["data"][0]
                    return Image.open(io.BytesIO(base64.b64decode(data["b64_json"]))).convert("RGB")
                problem = f"image service returned HTTP {reply.status_code}: {self._scrub(reply.text)[:160]}"
                if reply.status_code not in RETRYABLE_STATUS:
                    raise RuntimeError(problem)
                wait = parse_retry_after(reply.headers.get("Retry-After"))
            if attempt == c.max_retries:
                raise RuntimeError(f"{problem} (after {attempt + 1} attempts)")
            time.sleep(backoff_delay(attempt, wait, base_s=0.5, max_s=30.0))
        raise AssertionError("unreachable")

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text


class SceneRenderer:
    """The built-in Pillow renderer (stands in for a diffusion model in the offline demo)."""

    def __init__(self, cfg) -> None:
        from grouprl.rewards.models.scenes import SceneRenderer as Renderer

        self.render = Renderer(size=cfg.height)

    def draw(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        return self.render(prompts, seeds)


class SceneScorer:
    """The built-in pixel-analysis scorer (stands in for CLIP in the offline demo)."""

    def __init__(self, cfg) -> None:
        from grouprl.rewards.models.scenes import SceneScorer as Scorer

        self.scorer = Scorer()

    def score(self, images: list[Any], texts: list[str]) -> list[float]:
        return self.scorer(images, texts)


KINDS = {
    "clip": Clip,
    "sequence_classifier": SequenceClassifier,
    "text_to_image": TextToImage,
    "http_image": HttpImage,
    "scene_renderer": SceneRenderer,
    "scene_scorer": SceneScorer,
}


def check(cfg) -> None:
    """What a model needs that can be checked without loading it (a local path that exists,
    diffusers for text_to_image): a ModelLoadError before the worker starts."""
    import importlib.util

    if cfg.kind in ("clip", "sequence_classifier", "text_to_image"):
        _source(cfg)
    if cfg.kind == "text_to_image" and importlib.util.find_spec("diffusers") is None:
        raise _needs_diffusers(cfg)


def load(cfg):
    return KINDS[cfg.kind](cfg)
