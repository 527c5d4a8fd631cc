"""The VLM families against transformers' own models: our embeddings + positions + decoder
give the model's forward exactly; our multimodal rope ids equal the model's get_rope_index;
the processor expands placeholders as the model's processors do."""

import pytest
import torch

from grouprl.vision.images import count_placeholders, fit_pixels, with_placeholders
from vision_helpers import FAMILIES, colours, hf_inputs, tiny_vlm


@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_and_positions_reproduce_the_models_forward(family):
    model, tokenizer, vision = tiny_vlm(family)
    messages = [{"role": "user", "content": "look <image> and <image>, then say"}]
    ids, images = vision.encode(messages, colours(2))
    assert len(images) == 2 and all(im.num_tokens == 4 for im in images)
    t = torch.tensor([ids])
    with torch.no_grad():
        want = model(input_ids=t, **hf_inputs(family, vision, t, images)).logits
        embeds = vision.family.embed(model, t, images)
        positions = vision.family.batch_positions(t, torch.ones_like(t), [images])
        hidden = model.get_decoder()(inputs_embeds=embeds, position_ids=positions).last_hidden_state
        got = model.get_output_embeddings()(hidden)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # the image tokens carry the features: another image gives other logits after it
    ids2, images2 = vision.encode(messages, colours(2, seed=1))
    assert ids2 == ids
    with torch.no_grad():
        other = model(input_ids=t, **hf_inputs(family, vision, t, images2)).logits
    first_image = ids.index(vision.family.image_token_id)
    assert torch.equal(other[0, :first_image], want[0, :first_image])
    assert (other[0, -1] - want[0, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_multimodal_rope_ids_equal_the_models_with_left_padding(family):
    model, tokenizer, vision = tiny_vlm(family, max_pixels=84 * 56)
    a_ids, a_images = vision.encode([{"role": "user", "content": "<image> a"}], colours(1, size=(84, 56)))
    b_ids, b_images = vision.encode([{"role": "user", "content": "bb <image> c <image> d"}], colours(2, seed=3))
    assert a_images[0].grid == (1, 4, 6)  # 56 x 84 pixels in 14-pixel patches: 2 x 3 merged
    width = max(len(a_ids), len(b_ids))
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    for r, row in enumerate((a_ids, b_ids)):
        ids[r, width - len(row) :], mask[r, width - len(row) :] = torch.tensor(row), 1
    grids = torch.cat([im.tensors["image_grid_thw"] for im in a_images + b_images])
    want, _ = model.model.get_rope_index(
        input_ids=ids, mm_token_type_ids=(ids == vision.family.image_token_id).int(), image_grid_thw=grids,
        attention_mask=mask,
    )
    got = vision.family.batch_positions(ids, mask, [a_images, b_images])
    real = mask.bool()
    assert torch.equal(got[:, real], want[:, real])
    # an image of 2 x 3 merged patches: text after it continues at start + max(2, 3)
    row = vision.family.row_positions(a_ids, a_images, start=10)
    first = a_ids.index(vision.family.image_token_id)
    assert row[:, first : first + 6].tolist() == [[10 + first] * 6, [10 + first + h for h in (0, 0, 0, 1, 1, 1)],
                                                    [10 + first + w for w in (0, 1, 2, 0, 1, 2)]]
    assert row[:, first + 6].tolist() == [10 + first + 3] * 3


def test_idefics_image_splitting_gives_a_grid_of_tiles_and_a_global_view():
    model, tokenizer, vision = tiny_vlm("idefics3", split=True)
    ids, images = vision.encode([{"role": "user", "content": "<image>?"}], colours(1, size=(64, 40)))
    image = images[0]
    rows, cols = image.extra["rows"], image.extra["cols"]
    assert (rows, cols) == (2, 2)
    tiles = image.tensors["pixel_values"].shape[0]
    assert tiles == rows * cols + 1 and image.num_tokens == tiles * 4
    text = tokenizer.decode(ids)
    assert text.count("<fake_token_around_image>") == tiles + 1 and text.count("<global-img>") == 1
    t = torch.tensor([ids])
    with torch.no_grad():
        want = model(input_ids=t, **hf_inputs("idefics3", vision, t, images)).logits
        embeds = vision.family.embed(model, t, images)
        hidden = model.get_decoder()(inputs_embeds=embeds, position_ids=vision.family.batch_positions(
            t, torch.ones_like(t), [images])).last_hidden_state
    torch.testing.assert_close(model.get_output_embeddings()(hidden), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_never_sampled_holds_the_image_tokens(family):
    _, tokenizer, vision = tiny_vlm(family)
    banned = {tokenizer.convert_ids_to_tokens(t) for t in vision.family.never_sampled()}
    if family == "idefics3":
        assert banned == {"<image>", "<fake_token_around_image>", "<global-img>"}
    else:
        assert banned == {"<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"}


def test_embed_refuses_a_mismatch_of_image_tokens_and_images():
    model, _, vision = tiny_vlm("qwen2_vl")
    ids, images = vision.encode([{"role": "user", "content": "<image> <image>"}], colours(2))
    with pytest.raises(ValueError, match="8 image tokens in the sequence but 1 images of 4 tokens"):
        vision.family.embed(model, torch.tensor([ids]), images[:1])


def test_placeholders_and_pixel_limits():
    from PIL import Image

    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a <image> b"}]},
    ]
    assert count_placeholders(messages) == 2
    assert with_placeholders(messages)[1]["content"] == "<image>a <image> b"
    image = Image.new("RGB", (400, 100))
    assert fit_pixels(image, 0, 10_000).size == (200, 50)
    assert fit_pixels(image, 160_000, 0).size == (800, 200)
    assert fit_pixels(image, 1_000, 100_000) is image
    w, h = fit_pixels(Image.new("RGB", (333, 111)), 0, 5_000).size
    assert w * h <= 5_000 and (w, h) == (122, 40)  # sqrt(5000 / 36963) = 0.3678: 122.5 x 40.8, floored


@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl"])
def test_a_saved_processor_keeps_its_settings_and_says_how_an_image_expands(tmp_path, family):
    """processor_config.json travels with an export (the source folder's keys kept), and an
    Idefics3 folder states its <image> tokens per tile, which an engine that processes images
    itself (vLLM) would otherwise take from the processor's default (169)."""
    import json

    from grouprl.vision.processor import VisionProcessor
    from vision_helpers import tiny_vlm

    model, tokenizer, _ = tiny_vlm(family, tmp_path / "source")
    source = tmp_path / "source" / "processor_config.json"
    before = json.loads(source.read_text()) if source.is_file() else {}
    source.write_text(json.dumps({**before, "custom_setting": 7}))
    vision = VisionProcessor.load(str(tmp_path / "source"), model.config, tokenizer)
    vision.save_pretrained(tmp_path / "export")
    saved = json.loads((tmp_path / "export" / "processor_config.json").read_text())
    want = {"custom_setting": 7, **({"image_seq_len": 4} if family == "idefics3" else {})}
    assert saved == want
    assert vision.family.processor_settings() == ({"image_seq_len": vision.family.seq_len} if family == "idefics3" else {})
