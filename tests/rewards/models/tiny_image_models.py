"""Tiny random image models saved with save_pretrained, so the real from_pretrained paths load
them offline: a Stable Diffusion pipeline and a CLIP model with its processor."""

import torch

from helpers import char_tokenizer


def tiny_pipeline_dir(folder):
    """A tiny random Stable Diffusion pipeline (UNet, VAE, CLIP text encoder, character
    tokenizer, DDIM) saved with save_pretrained: DiffusionPipeline.from_pretrained loads it."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = char_tokenizer(None)
    tokenizer.model_max_length = 16
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16, norm_num_groups=4, attention_head_dim=2,
    )  # fmt: skip
    vae = AutoencoderKL(
        block_out_channels=(8,), in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=4, sample_size=16,
    )  # fmt: skip
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=16, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )  # fmt: skip
    StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text, tokenizer=tokenizer, scheduler=DDIMScheduler(),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    ).save_pretrained(folder)  # fmt: skip
    return folder


def tiny_clip_dir(folder):
    """A tiny random CLIP with a processor (CLIP image processor + character tokenizer)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = char_tokenizer(None)
    tokenizer.model_max_length = 32
    text = dict(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=32, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8)
    torch.manual_seed(1)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).save_pretrained(folder)
    size = {"shortest_edge": 16}
    CLIPProcessor(image_processor=CLIPImageProcessor(size=size, crop_size={"height": 16, "width": 16}), tokenizer=tokenizer).save_pretrained(folder)
    return folder
