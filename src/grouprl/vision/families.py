"""What differs between VLM families, in one place: how an image becomes model inputs and
placeholder tokens, how image features are computed and placed, and position ids.

Two families, covering the models transformers serves through `AutoModelForImageTextToText`:
- `qwen` (Qwen2-VL, Qwen2.5-VL): an image is `<|vision_start|>` + one `<|image_pad|>` per merged
  patch + `<|vision_end|>`; its inputs are flattened patches with a (t, h, w) grid; positions are
  multimodal rope ids [3, L] (temporal, height, width), text advancing all three alike.
- `idefics` (Idefics3, SmolVLM): an image is tiles of fixed size (a global view, plus a grid of
  crops when the processor splits it), each `<fake_token_around_image>`-framed with a fixed
  number of `<image>` tokens; plain positions [L].

Every model call in grouprl (generation and the update) goes through `embed` (token embeddings
with the image features scattered at the image tokens, in order) and `positions`, so generation
and training see the same inputs by construction.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from grouprl.errors import ModelLoadError


@dataclass
class ImageInput:
    """One image, processed for the model: what travels with a trajectory to the update."""

    text: str  # the placeholder text the image expands to in the prompt (special tokens)
    num_tokens: int  # image-feature tokens it fills (the image token's count in `text`)
    tensors: dict[str, torch.Tensor]  # its processor outputs (family keys), this image alone
    shown_size: tuple[int, int]  # (width, height) as the model sees it: what <bbox> coordinates refer to
    original_size: tuple[int, int]  # (width, height) of the source image
    grid: tuple[int, int, int] | None = None  # qwen: (t, h, w) patches before merging
    extra: dict[str, Any] = field(default_factory=dict)
    key: str = ""  # fingerprint of the pixels: prompts are the same prompt only with the same images
    # the PIL image the processor read (within the pixel limits), for an engine that processes
    # images itself (vLLM); set by `Family.prepare`. A field like the others, so that
    # `dataclasses.replace` works: FSDP's mixed precision rebuilds the dataclasses among a
    # forward's inputs with their tensors cast (bf16 pixels under bf16 compute)
    source: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if not self.key and self.tensors:
            digest = hashlib.sha1()
            for name in sorted(self.tensors):
                digest.update(name.encode())
                digest.update(self.tensors[name].detach().cpu().contiguous().numpy().tobytes())
            self.key = digest.hexdigest()


def unwrap(model):
    """The transformers model under a peft wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class Family:
    name = ""
    position_dims = 1  # 1: positions [L]; 3: multimodal rope [3, L]
    # parameter-name prefixes of the parts (transformers' module layout of the family)
    tower: tuple[str, ...] = ()  # the vision encoder
    connector: tuple[str, ...] = ()  # the projection of its features into the text embedding space
    language: tuple[str, ...] = ()  # the language model, embeddings and head included

    def __init__(self, config, tokenizer, image_processor):
        self.config, self.tokenizer, self.image_processor = config, tokenizer, image_processor
        self.image_token_id = int(config.image_token_id)

    # -- processor side --------------------------------------------------------------
    def prepare(self, image) -> ImageInput:
        raise NotImplementedError

    def never_sampled(self) -> list[int]:
        """Token ids the policy must never emit (image and frame tokens)."""
        raise NotImplementedError

    # -- model side ------------------------------------------------------------------
    def features(self, model, images: list[ImageInput]) -> torch.Tensor:
        """Image features [sum of num_tokens, H], images in order."""
        raise NotImplementedError

    def blank(self) -> ImageInput:
        """The smallest input the tower takes, an even grey (0.5: Idefics3 drops all-zero tiles
        as padding): what a pass that must only touch every weight of the tower runs."""
        raise NotImplementedError

    def processor_settings(self) -> dict[str, Any]:
        """What the model's processor (not its image processor) must know for an image to expand
        as it does here, written to processor_config.json beside the model (an engine that
        processes images itself, vLLM, reads them there)."""
        return {}

    def embed(self, model, ids: torch.Tensor, images: list[ImageInput]) -> torch.Tensor:
        """Token embeddings [B, L, H] of `ids` [B, L] with the features of `images` (in the
        row-major order of their tokens) in place of the image tokens."""
        embeds = unwrap(model).get_input_embeddings()(ids)
        slots = ids == self.image_token_id
        count = int(slots.sum())
        expected = sum(image.num_tokens for image in images)
        if count != expected:
            raise ValueError(f"{count} image tokens in the sequence but {len(images)} images of {expected} tokens")
        if not images:
            return embeds
        feats = self.features(model, images).to(embeds.dtype)
        return embeds.masked_scatter(slots.unsqueeze(-1), feats)

    def row_positions(self, ids: list[int], images: list[ImageInput], start: int = 0) -> torch.Tensor:
        """Positions of one row's tokens when its first token sits at `start`: [L] or [3, L]."""
        return torch.arange(start, start + len(ids))

    def next_position(self, positions: torch.Tensor) -> int:
        """Where the token after a row with these positions goes."""
        return int(positions.max()) + 1 if positions.numel() else 0

    def batch_positions(
        self, ids: torch.Tensor, mask: torch.Tensor, images: list[list[ImageInput]], starts: list[int] | None = None
    ) -> torch.Tensor:
        """Positions of padded rows ids/mask [B, L] (each row's images in `images[b]`):
        [B, L] or [3, B, L]; padding slots get 0."""
        b, length = ids.shape
        shape = (self.position_dims, b, length) if self.position_dims > 1 else (b, length)
        out = torch.zeros(shape, dtype=torch.long)
        for r in range(b):
            real = mask[r].bool().cpu()
            pos = self.row_positions(ids[r][mask[r].bool()].tolist(), images[r], starts[r] if starts else 0)
            if self.position_dims > 1:
                out[:, r, real] = pos
            else:
                out[r, real] = pos
        return out.to(ids.device)


class QwenFamily(Family):
    """Qwen2-VL and Qwen2.5-VL."""

    name = "qwen"
    position_dims = 3
    tower = ("model.visual.",)  # the patch merger (its connector) lives inside the tower
    language = ("model.language_model.", "lm_head.")

    def __init__(self, config, tokenizer, image_processor):
        super().__init__(config, tokenizer, image_processor)
        vision = config.vision_config
        self.merge = int(getattr(vision, "spatial_merge_size", 2))
        self.patch = int(getattr(vision, "patch_size", 14))
        self.special = [
            int(t)
            for t in (
                config.image_token_id,
                getattr(config, "video_token_id", None),
                getattr(config, "vision_start_token_id", None),
                getattr(config, "vision_end_token_id", None),
            )
            if t is not None
        ]
        self.start_text = _token_text(tokenizer, getattr(config, "vision_start_token_id", None), "<|vision_start|>")
        self.end_text = _token_text(tokenizer, getattr(config, "vision_end_token_id", None), "<|vision_end|>")
        self.image_text = _token_text(tokenizer, config.image_token_id, "<|image_pad|>")

    def prepare(self, image) -> ImageInput:
        out = self.image_processor(images=[image], return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        n = grid[0] * grid[1] * grid[2] // self.merge**2
        prepared = ImageInput(
            text=self.start_text + self.image_text * n + self.end_text,
            num_tokens=n,
            tensors={"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]},
            shown_size=(grid[2] * self.patch, grid[1] * self.patch),
            original_size=image.size,
            grid=grid,
        )
        prepared.source = image
        return prepared

    def never_sampled(self) -> list[int]:
        return sorted(set(self.special))

    def features(self, model, images: list[ImageInput]) -> torch.Tensor:
        base = unwrap(model)
        device = next(base.parameters()).device
        pixels = torch.cat([im.tensors["pixel_values"] for im in images]).to(device)
        grids = torch.cat([im.tensors["image_grid_thw"] for im in images]).to(device)
        out = base.get_image_features(pixel_values=pixels, image_grid_thw=grids)
        parts = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.cat(list(parts)) if isinstance(parts, (list, tuple)) else parts

    def blank(self) -> ImageInput:
        """One merged patch: a (1, merge, merge) grid, one image token."""
        vision = self.config.vision_config
        channels, frames = int(getattr(vision, "in_channels", 3)), int(getattr(vision, "temporal_patch_size", 2))
        side = self.merge * self.patch
        return ImageInput(
            text=self.start_text + self.image_text + self.end_text,
            num_tokens=1,
            tensors={
                "pixel_values": torch.full((self.merge**2, channels * frames * self.patch**2), 0.5),
                "image_grid_thw": torch.tensor([[1, self.merge, self.merge]]),
            },
            shown_size=(side, side),
            original_size=(side, side),
            grid=(1, self.merge, self.merge),
        )

    def row_positions(self, ids: list[int], images: list[ImageInput], start: int = 0) -> torch.Tensor:
        """Multimodal rope ids: text advances (t, h, w) together; an image's merged patches take
        (start + t, start + row, start + column), and the text after it continues at
        start + max(rows, columns)."""
        out = torch.empty((3, len(ids)), dtype=torch.long)
        pending = iter(images)
        cur, i = start, 0
        while i < len(ids):
            if ids[i] == self.image_token_id:
                image = next(pending, None)
                if image is None:
                    raise ValueError("more image-token runs than images")
                t, h, w = image.grid[0], image.grid[1] // self.merge, image.grid[2] // self.merge
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                n = t * h * w
                out[:, i : i + n] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
                cur += max(h, w)
                i += n
            else:
                j = i
                while j < len(ids) and ids[j] != self.image_token_id:
                    j += 1
                out[:, i:j] = torch.arange(cur, cur + j - i)
                cur += j - i
                i = j
        return out


class IdeficsFamily(Family):
    """Idefics3 and SmolVLM."""

    name = "idefics"
    tower = ("model.vision_model.",)
    connector = ("model.connector.",)
    language = ("model.text_model.", "lm_head.")

    def __init__(self, config, tokenizer, image_processor):
        super().__init__(config, tokenizer, image_processor)
        vision = config.vision_config
        scale = int(getattr(config, "scale_factor", 1))
        self.seq_len = int((vision.image_size // vision.patch_size) ** 2 // scale**2)
        self.image_text = _token_text(tokenizer, config.image_token_id, "<image>")
        self.frame_text = "<fake_token_around_image>"
        self.global_text = "<global-img>"
        vocab = tokenizer.get_vocab()
        grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
        self.special = [vocab[t] for t in (self.frame_text, self.global_text, *grid) if t in vocab]
        self.special.append(self.image_token_id)

    def prepare(self, image) -> ImageInput:
        out = self.image_processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        pixels = out["pixel_values"][0]  # [tiles, C, H, W]
        mask = out.get("pixel_attention_mask")
        mask = mask[0] if mask is not None else torch.ones((pixels.shape[0], *pixels.shape[-2:]), dtype=torch.long)
        one = self.frame_text + "{tag}" + self.image_text * self.seq_len
        text = ""
        for r in range(rows):
            text += "".join(one.format(tag=f"<row_{r + 1}_col_{c + 1}>") for c in range(cols)) + "\n"
        text += ("\n" if rows else "") + one.format(tag=self.global_text) + self.frame_text
        resized = _shown_size(image.size, self.image_processor)
        prepared = ImageInput(
            text=text,
            num_tokens=pixels.shape[0] * self.seq_len,
            tensors={"pixel_values": pixels, "pixel_attention_mask": mask},
            shown_size=resized,
            original_size=image.size,
            extra={"rows": rows, "cols": cols},
        )
        prepared.source = image
        return prepared

    def never_sampled(self) -> list[int]:
        return sorted(set(self.special))

    def features(self, model, images: list[ImageInput]) -> torch.Tensor:
        base = unwrap(model)
        device = next(base.parameters()).device
        tiles = [im.tensors["pixel_values"] for im in images]
        masks = [im.tensors["pixel_attention_mask"] for im in images]
        height = max(t.shape[-2] for t in tiles)
        width = max(t.shape[-1] for t in tiles)
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1], 0, height - t.shape[-2]))  # noqa: E731
        pixels = torch.cat([pad(t) for t in tiles])[None].to(device)  # [1, tiles, C, H, W]
        mask = torch.cat([pad(m) for m in masks])[None].to(device)
        out = base.get_image_features(pixel_values=pixels, pixel_attention_mask=mask)
        parts = out.pooler_output if hasattr(out, "pooler_output") else out
        feats = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]) if isinstance(parts, (list, tuple)) else parts
        return feats.reshape(-1, feats.shape[-1])

    def processor_settings(self) -> dict[str, Any]:
        """The <image> tokens of one tile (Idefics3Processor's `image_seq_len`; its default, 169,
        is SmolVLM's 512-pixel tiles')."""
        return {"image_seq_len": self.seq_len}

    def blank(self) -> ImageInput:
        """One tile (the global view alone, no frame tokens)."""
        vision = self.config.vision_config
        side = int(vision.image_size)
        return ImageInput(
            text=self.image_text * self.seq_len,
            num_tokens=self.seq_len,
            tensors={
                "pixel_values": torch.full((1, int(getattr(vision, "num_channels", 3)), side, side), 0.5),
                "pixel_attention_mask": torch.ones((1, side, side), dtype=torch.long),
            },
            shown_size=(side, side),
            original_size=(side, side),
            extra={"rows": 0, "cols": 0},
        )


FAMILIES: dict[str, type[Family]] = {
    "qwen2_vl": QwenFamily,
    "qwen2_5_vl": QwenFamily,
    "idefics3": IdeficsFamily,
    "smolvlm": IdeficsFamily,
}


def is_vision_config(config) -> bool:
    """A config of an image-text model (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def family_class(config) -> type[Family]:
    model_type = getattr(config, "model_type", "")
    if model_type not in FAMILIES:
        raise ModelLoadError(
            f"vision-language model type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def family_for(config, tokenizer, image_processor) -> Family:
    return family_class(config)(config, tokenizer, image_processor)


def _token_text(tokenizer, token_id, default: str) -> str:
    if token_id is None:
        return default
    text = tokenizer.convert_ids_to_tokens(int(token_id))
    return text if isinstance(text, str) else default


def _shown_size(size: tuple[int, int], image_processor) -> tuple[int, int]:
    """The (width, height) Idefics3's processor resizes an image to (longest edge as set)."""
    longest = (getattr(image_processor, "size", None) or {}).get("longest_edge")
    if not longest:
        return size
    scale = longest / max(size)
    return (max(1, round(size[0] * scale)), max(1, round(size[1] * scale)))
