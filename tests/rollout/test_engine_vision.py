"""The built-in engine with VLM policies: prompts with images are prefilled once per group, the
image tokens are never sampled, and multi-turn sessions take image observations; all checked
against a plain reference loop over transformers' own forward (full sequence, every step)."""

import pytest
import torch

from grouprl.rollout.engines.hf import HFEngine, SamplingParams
from vision_helpers import FAMILIES, colours, hf_inputs, tiny_vlm


@torch.no_grad()
def reference_greedy(model, family, vision, ids, images, steps):
    """Greedy tokens by running the whole sequence through model(...) at every step, image
    tokens excluded from the argmax."""
    banned = vision.family.never_sampled()
    ids, out = list(ids), []
    for _ in range(steps):
        t = torch.tensor([ids])
        logits = model(input_ids=t, **hf_inputs(family, vision, t, images)).logits[0, -1]
        logits[banned] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token == 1:  # EOS
            break
    return out


def encode_all(vision, texts, seed=0):
    prompts, images = [], []
    for k, text in enumerate(texts):
        ids, ims = vision.encode([{"role": "user", "content": text}], colours(text.count("<image>"), seed=seed + k))
        prompts.append(ids)
        images.append(ims)
    return prompts, images


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_images_equals_the_reference(family):
    model, _, vision = tiny_vlm(family)
    # prompts of different lengths and image counts (left padding), one without an image
    prompts, images = encode_all(vision, ["<image> what?", "see <image> and <image>", "no image here, talk"])
    engine = HFEngine(model, vision.tokenizer, vision=vision.family)
    got = engine.generate(prompts, 2, SamplingParams(max_new_tokens=10, temperature=0.0), images=images)
    for i, (p, ims) in enumerate(zip(prompts, images)):
        want = reference_greedy(model, family, vision, p, ims, 10)
        assert got[2 * i].token_ids == want and got[2 * i + 1].token_ids == want


@pytest.mark.parametrize("family", FAMILIES)
def test_one_prefill_per_group_samples_as_one_prefill_per_row(family):
    model, _, vision = tiny_vlm(family)
    prompts, images = encode_all(vision, ["<image> what?", "see <image> then"], seed=4)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    runs = []
    for share in (True, False):
        engine = HFEngine(model, vision.tokenizer, share_prompt_prefill=share, vision=vision.family)
        runs.append(engine.generate(prompts, 3, params, torch.Generator().manual_seed(0), images=images))
    assert [g.token_ids for g in runs[0]] == [g.token_ids for g in runs[1]]
    assert len({tuple(g.token_ids) for g in runs[0][:3]}) > 1  # the group's samples differ


def test_image_tokens_are_never_sampled_even_when_they_are_likely():
    model, tokenizer, vision = tiny_vlm("qwen2_vl")
    banned = vision.family.never_sampled()
    with torch.no_grad():  # make every image token the model's favourite next token
        model.get_output_embeddings().weight[banned] *= 40
    prompts, images = encode_all(vision, ["<image> what?"])
    t = torch.tensor([prompts[0]])
    with torch.no_grad():
        logits = model(input_ids=t, **hf_inputs("qwen2_vl", vision, t, images[0])).logits[0, -1]
    assert int(logits.argmax()) in banned
    engine = HFEngine(model, tokenizer, vision=vision.family)
    out = engine.generate(prompts, 16, SamplingParams(max_new_tokens=12, temperature=1.0),
                          torch.Generator().manual_seed(0), images=images)
    tokens = [t for g in out for t in g.token_ids]
    assert len(tokens) > 50 and not set(tokens) & set(banned)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("reuse", [True, False])
def test_a_session_takes_image_observations(family, reuse):
    """Turn 1 on the prompt (with an image); turn 2 appends an observation holding a new
    image. Each turn's greedy tokens equal the reference over the whole conversation."""
    model, tokenizer, vision = tiny_vlm(family)
    prompts, images = encode_all(vision, ["<image> look", "two <image> <image>"], seed=2)
    engine = HFEngine(model, tokenizer, vision=vision.family)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    session = engine.open_session(prompts, 1, reuse_cache=reuse, images=images)
    first = session.generate([0, 1], [[], []], params)
    obs_images = [vision.prepare_image(im) for im in colours(2, seed=9)]
    observations = [vision.encode_text(f"\nseen {k} <image> ok\n", [obs_images[k]]) for k in range(2)]
    second = session.generate([0, 1], observations, params, new_images=[[obs_images[0]], [obs_images[1]]])
    for r in range(2):
        assert first[r].token_ids == reference_greedy(model, family, vision, prompts[r], images[r], 6)
        context = prompts[r] + first[r].token_ids + observations[r]
        want = reference_greedy(model, family, vision, context, images[r] + [obs_images[r]], 6)
        assert second[r].token_ids == want
