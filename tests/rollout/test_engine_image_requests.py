"""What the vLLM engine sends for a VLM policy, checked without vLLM: each image's expansion in
the trainer's prompt collapsed to the placeholder vLLM's processor expands, and the source image
each processed image keeps for it. (The engine itself: tests/rollout/test_engine_vllm_vision.py,
in the vLLM environment.)"""

from dataclasses import replace

import pytest
import torch

from grouprl.config import RolloutConfig
from grouprl.errors import ModelLoadError
from grouprl.rollout.engines import build_engine
from grouprl.rollout.engines.vllm import collapse_images, placeholder_text
from grouprl.vision.images import IMAGE_PLACEHOLDER, with_placeholders
from vision_helpers import colours, tiny_vlm

CASES = [("qwen2_vl", False), ("qwen2_5_vl", False), ("idefics3", False), ("idefics3", True), ("smolvlm", True)]


@pytest.mark.parametrize(("family", "split"), CASES)
def test_each_images_expansion_becomes_vllms_placeholder(family, split):
    """The collapsed prompt is the trainer's prompt as if each image expanded to the placeholder
    alone (Qwen: `<|vision_start|><|image_pad|><|vision_end|>`; Idefics3/SmolVLM: `<image>`,
    its frames, tile tags and tokens gone), everything else token for token."""
    _, tokenizer, vision = tiny_vlm(family, split=split)
    messages = [{"role": "user", "content": "see <image> and <image>, then <image>"}]
    shown = colours(3, seed=1, size=(70, 42)) if split else colours(3, seed=1)
    ids, images = vision.encode(messages, shown)
    expansions = [tokenizer(im.text, add_special_tokens=False)["input_ids"] for im in images]
    placeholder = tokenizer(placeholder_text(vision.family), add_special_tokens=False)["input_ids"]
    got = collapse_images(ids, expansions, placeholder)

    text = tokenizer.apply_chat_template(with_placeholders(messages), tokenize=False, add_generation_prompt=True)
    want = tokenizer(text.replace(IMAGE_PLACEHOLDER, placeholder_text(vision.family)), add_special_tokens=False)["input_ids"]
    assert got == want
    assert got.count(vision.family.image_token_id) == 3 and len(got) < len(ids)


def test_an_image_whose_tokens_are_missing_is_named():
    _, tokenizer, vision = tiny_vlm("qwen2_vl")
    ids, images = vision.encode([{"role": "user", "content": "<image> and <image>"}], colours(2))
    expansions = [tokenizer(im.text, add_special_tokens=False)["input_ids"] for im in images]
    cut = ids[: ids.index(vision.family.image_token_id) + 1]  # the first image's run cut short
    with pytest.raises(ValueError, match=r"image 0's tokens are not in the prompt \(after position 0\)"):
        collapse_images(cut, expansions, [vision.family.image_token_id])


def test_a_processed_image_keeps_its_source_through_fsdps_cast_and_the_prompt_stubs_do_not():
    """The source is the image the processor read (within the pixel limits). FSDP's mixed
    precision rebuilds the dataclasses among a forward's inputs with their floating tensors cast
    (`dataclasses.replace`): the image keeps its source and key, its pixels become bf16. The
    trainer's pixel-less stubs of the prompts' images leave the source behind; equality ignores it."""
    from torch.distributed.utils import _apply_to_tensors

    from grouprl.config import load_config
    from grouprl.data.sample import Sample
    from grouprl.trainer.setup import PromptEncoder

    _, tokenizer, vision = tiny_vlm("qwen2_vl")
    vision.max_pixels = 56 * 28
    image = colours(1, size=(112, 56))[0]
    prepared = vision.prepare_image(image)
    assert prepared.source.size == prepared.original_size == (56, 28)  # halved to fit
    [cast] = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, [prepared])
    assert cast.source is prepared.source and cast.key == prepared.key and cast.grid == prepared.grid
    pixels = prepared.tensors["pixel_values"]
    assert pixels.dtype == torch.float32 and torch.equal(cast.tensors["pixel_values"], pixels.to(torch.bfloat16))
    assert torch.equal(cast.tensors["image_grid_thw"], prepared.tensors["image_grid_thw"])  # integers stay

    encoder = PromptEncoder(load_config(None, []), tokenizer, vision)
    sample = Sample(uid="s", messages=[{"role": "user", "content": "<image> what?"}], images=[image])
    encoder.encode([sample], "train")
    [stub] = encoder._image_stubs[id(sample)]
    assert stub.source is None and stub.tensors == {} and stub.key == prepared.key
    assert replace(prepared) == prepared


def test_build_engine_gives_a_vlm_policy_to_vllm(tmp_path):
    """No refusal: without vLLM installed (this environment) the engine's import is what fails."""
    model, tokenizer, vision = tiny_vlm("idefics3", tmp_path)
    with pytest.raises(ModelLoadError, match="rollout.engine=vllm needs vLLM"):
        build_engine(RolloutConfig(engine="vllm"), model, tokenizer, model_path=str(tmp_path), vision=vision.family)
