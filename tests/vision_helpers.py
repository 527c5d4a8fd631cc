"""Tiny vision-language models built in the test (random weights, no hub): one per family.

    model, tokenizer, vision = tiny_vlm("qwen2_vl")            # or qwen2_5_vl, idefics3
    model, tokenizer, vision = tiny_vlm("idefics3", tmp_path)  # also saved there (model,
                                                              # tokenizer, image processor)

The tokenizer is the character tokenizer of `helpers` plus the family's image special tokens;
the image processor is the family's PIL one (no torchvision) with small image sizes, so an image
is a handful of tokens:
- qwen2_vl / qwen2_5_vl: 14-pixel patches merged 2x2, images resized to 28-56 pixels a side:
  a 56x56 image is a 4x4 patch grid, 4 image tokens;
- idefics3: 32-pixel tiles of 8-pixel patches, pixel shuffle 2: 4 image tokens a tile, one tile
  per image (no splitting) unless `split=True` (then a grid of tiles plus a global one);
- smolvlm: the same under SmolVLM's classes (not in FAMILIES: the vLLM tests take it).
A saved Idefics3/SmolVLM folder also has processor_config.json with `image_seq_len` (4), as a
hub folder does. `text_sizes=VLLM_TEXT` gives the language model head size 32 (vLLM's CPU
attention).
`colours` gives distinct, seeded test images.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers import char_tokenizer

QWEN_SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IDEFICS_SPECIALS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "idefics3")
# language-model sizes with head size 32, which vLLM's CPU attention has kernels for
VLLM_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)


def _text_config(vocab_size: int, init_std: float, **extra) -> dict:
    """The language model's config: the defaults below, `extra` over them."""
    defaults = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=init_std,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return {**defaults, **extra}


def tiny_vlm(
    family: str = "qwen2_vl",
    folder: str | Path | None = None,
    *,
    seed: int = 0,
    init_std: float = 0.2,
    vision_init_std: float | None = None,
    dtype: torch.dtype = torch.float32,
    split: bool = False,
    min_pixels: int = 0,
    max_pixels: int = 0,
    chat_template: str | None = None,
    text_sizes: dict | None = None,
):
    """(model, tokenizer, VisionProcessor) of a seeded tiny VLM of `family`, in eval mode.
    `vision_init_std`: the vision tower's init std (default: `init_std`); `chat_template`: the
    tokenizer's (default: the character tokenizer's "role: content" lines); `text_sizes`: the
    language model's sizes in place of the defaults (e.g. `VLLM_TEXT`), the vision output and
    Qwen's rope sections following them."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from grouprl.vision.families import family_for
    from grouprl.vision.processor import VisionProcessor

    vision_std = init_std if vision_init_std is None else vision_init_std
    sizes = dict(text_sizes or {})
    hidden = sizes.get("hidden_size", 32)
    head = hidden // sizes.get("num_attention_heads", 4)
    tokenizer = char_tokenizer() if chat_template is None else char_tokenizer(chat_template)
    specials = IDEFICS_SPECIALS if family in ("idefics3", "smolvlm") else QWEN_SPECIALS
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    vocab = len(tokenizer)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # the sections split the head's rotary half (t, h, w); [2, 1, 1] at the default head size 8
        section = [head // 4, head // 8, head // 8]
        text = _text_config(vocab, init_std, rope_scaling={"type": "mrope", "mrope_section": section}, **sizes)
        tokens = dict(
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
        if family == "qwen2_vl":
            vision = dict(depth=2, embed_dim=16, num_heads=2, hidden_size=hidden, mlp_ratio=2, patch_size=14,
                          spatial_merge_size=2, temporal_patch_size=2, initializer_range=vision_std)
            config = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        else:
            vision = dict(depth=2, hidden_size=16, num_heads=2, out_hidden_size=hidden, intermediate_size=32,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                          fullatt_block_indexes=[1], initializer_range=vision_std)
            config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        image_processor = Qwen2VLImageProcessorPil(
            min_pixels=min_pixels or 28 * 28, max_pixels=max_pixels or 56 * 56, patch_size=14, merge_size=2,
            temporal_patch_size=2,
        )
    elif family in ("idefics3", "smolvlm"):
        if family == "idefics3":
            from transformers import Idefics3Config as Config
            from transformers.models.idefics3.image_processing_pil_idefics3 import (
                Idefics3ImageProcessorPil as ImageProcessor,
            )
        else:  # SmolVLM: Idefics3's layout under its own classes
            from transformers import SmolVLMConfig as Config
            from transformers.models.smolvlm.image_processing_pil_smolvlm import (
                SmolVLMImageProcessorPil as ImageProcessor,
            )

        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      image_size=32, patch_size=8, initializer_range=vision_std)
        config = Config(
            text_config=_text_config(vocab, init_std, model_type="llama", **sizes),
            vision_config=vision,
            scale_factor=2,
            image_token_id=ids["<image>"],
            tie_word_embeddings=True,
        )
        image_processor = ImageProcessor(
            do_image_splitting=split,
            size={"longest_edge": 64 if split else 32},
            max_image_size={"longest_edge": 32},
        )
    else:
        raise ValueError(f"unknown tiny VLM family {family!r}; allowed: {', '.join(FAMILIES)}, smolvlm")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0, do_sample=False)
    model.eval()
    vision_processor = VisionProcessor(
        tokenizer, family_for(model.config, tokenizer, image_processor),
        min_pixels=0, max_pixels=0,
    )
    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        image_processor.save_pretrained(folder)
        if family in ("idefics3", "smolvlm"):
            # the processor's own settings, as a hub folder has them: the <image> tokens per tile
            # (an engine that processes images itself reads them there)
            settings = {"image_seq_len": vision_processor.family.seq_len}
            (Path(folder) / "processor_config.json").write_text(json.dumps(settings))
    return model, tokenizer, vision_processor


def hf_inputs(family: str, vision, ids, images) -> dict:
    """The keyword arguments transformers' own forward takes for `images` (in the order of their
    tokens in `ids`): the reference our embeddings and positions are checked against."""
    if not images:
        return {}
    if family.startswith("qwen"):
        return dict(
            pixel_values=torch.cat([im.tensors["pixel_values"] for im in images]),
            image_grid_thw=torch.cat([im.tensors["image_grid_thw"] for im in images]),
            mm_token_type_ids=(ids == vision.family.image_token_id).int(),
        )
    return dict(
        pixel_values=torch.cat([im.tensors["pixel_values"] for im in images])[None],
        pixel_attention_mask=torch.cat([im.tensors["pixel_attention_mask"] for im in images])[None],
    )


def colours(n: int, seed: int = 0, size: tuple[int, int] = (56, 56)):
    """n PIL images of random blocky colours (distinct per index, same for the same seed)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        small = (torch.rand((4, 4, 3), generator=gen) * 255).to(torch.uint8).numpy()
        out.append(Image.fromarray(small).resize(size, Image.NEAREST))
    return out


class ForcedTurns:
    """Turn k of every trajectory is `scripts[k]` while there is one, then sampled as usual: the
    built-in engine draws the scripted token in place of the sampled one and reports the model's
    log-prob of it, so a tiny random policy takes real actions in the agent loop. In lock step a
    turn is one generate call of a session (every row of it starts together: the position in
    the turn is the decode step); one trajectory at a time, each running turn knows its row's
    turn and how far it is (opening a session starts again at turn 0)."""

    def __init__(self, tokenizer, scripts):
        self.ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in scripts]
        self.turn, self.position = -1, 0

    def install(self, monkeypatch):
        import grouprl.rollout.engines.hf as hf
        from grouprl.rollout.engines.hf_session import RunningSession

        real_open, real_decode, real_sample = hf.HFEngine.open_session, hf.HFEngine._decode, hf.sample_next
        real_draw = RunningSession._draw
        forced = self

        def open_session(engine, *args, **kwargs):
            forced.turn = -1
            return real_open(engine, *args, **kwargs)

        def decode(engine, *args, **kwargs):
            forced.turn, forced.position = forced.turn + 1, 0
            return real_decode(engine, *args, **kwargs)

        def sample_next(logits, params, generator, banned=None):
            drawn = real_sample(logits, params, generator, banned)  # the rows' streams advance as usual
            if 0 <= forced.turn < len(forced.ids):
                script = forced.ids[forced.turn]
                drawn = torch.full_like(drawn, script[min(forced.position, len(script) - 1)])
            forced.position += 1
            return drawn

        def draw(session):
            drawn = real_draw(session)  # the rows' streams advance as usual
            for i, turn in enumerate(session.running):
                if turn.index < len(forced.ids):
                    script = forced.ids[turn.index]
                    drawn[i] = script[min(len(turn.tokens), len(script) - 1)]
            return drawn

        monkeypatch.setattr(RunningSession, "_draw", draw)
        monkeypatch.setattr(hf.HFEngine, "open_session", open_session)
        monkeypatch.setattr(hf.HFEngine, "_decode", decode)
        monkeypatch.setattr(hf, "sample_next", sample_next)
