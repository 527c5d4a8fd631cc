"""The model kinds a reward-model worker loads, each with one batched call.

Drawers (`draw(prompts, seeds) -> images`): text_to_image (diffusers), scene_renderer.
Scorers (`score(images, texts) -> floats`): clip, scene_scorer; `classify(prompts, responses)`:
sequence_classifier. Everything heavy is imported inside the class that needs it.
"""

from __future__ import annotations

from typing import Any

DRAWERS = ("text_to_image", "scene_renderer")


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


class Clip:
    """Cosine similarity of CLIP/SigLIP image and text embeddings (x scale)."""

    def __init__(self, cfg) -> None:
        from transformers import AutoModel, AutoProcessor

        self.device, self.scale = cfg.device, cfg.scale
        self.model = AutoModel.from_pretrained(cfg.path, dtype=_torch_dtype(cfg.dtype)).to(cfg.device).eval()
        self.processor = AutoProcessor.from_pretrained(cfg.path)
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
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=_torch_dtype(cfg.dtype))
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
        from diffusers import DiffusionPipeline

        self.cfg = cfg
        self.pipe = DiffusionPipeline.from_pretrained(cfg.path, torch_dtype=_torch_dtype(cfg.dtype)).to(cfg.device)
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
    "scene_renderer": SceneRenderer,
    "scene_scorer": SceneScorer,
}


def load(cfg):
    return KINDS[cfg.kind](cfg)
