"""The update's log-probs for VLM policies against transformers' own forward: each row's
prompt + response with all its images (prompt images, and image observations inside the
response) through model(...), full logits, image tokens excluded as the sampler excludes them.

Both update paths (shared prefix: a group's prompt with its images run once; full sequences)
must give those values and the same gradients; the update must see every image (one pixel of
one image moves exactly the rows that contain it); and the update's log-probs must equal the
ones generation sampled with (the training forward sees what generation saw).
"""

import copy

import pytest
import torch

from grouprl.config import ActorConfig
from grouprl.rollout.engines.hf import HFEngine, SamplingParams
from grouprl.trainer.logprobs import ResponseBatch, response_log_probs
from grouprl.trainer.update import PolicyUpdater
from helpers import exact_float64_norms
from vision_helpers import FAMILIES, colours, hf_inputs, tiny_vlm

TEMPERATURE = 0.9
N = 3  # samples per prompt


def reference(model, family, vision, batch: ResponseBatch, temperature=TEMPERATURE):
    """[N, R] log-probs, row by row through model(...) with all the row's images."""
    banned = vision.family.never_sampled()
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float64)
    for i, prompt in enumerate(batch.prompt_ids):
        n = int(batch.response_mask[i].sum())
        response = batch.response_ids[i, :n]
        ids = torch.tensor([list(prompt) + response.tolist()])
        images = batch.prompt_images[i] + batch.response_images[i]
        logits = model(input_ids=ids, **hf_inputs(family, vision, ids, images)).logits[0].double()
        logits = logits / temperature
        logits[:, banned] = float("-inf")
        predicting = logits[len(prompt) - 1 : len(prompt) - 1 + n]
        out[i, :n] = torch.log_softmax(predicting, -1).gather(-1, response[:, None]).squeeze(-1)
    return out


def make_batch(vision, seed=0, pixels=None):
    """2 prompts (1 and 2 images) x N samples of text responses; row 4 is a two-turn response
    with an image observation in the middle. `pixels`: {(which, index): image} replacements."""
    gen = torch.Generator().manual_seed(seed)
    images = {("prompt", 0): colours(1, seed=1)[0], ("prompt", 1): colours(1, seed=2)[0],
              ("prompt", 2): colours(1, seed=3)[0], ("obs", 4): colours(1, seed=4)[0]}
    images.update(pixels or {})
    a_ids, a_images = vision.encode([{"role": "user", "content": "<image> what is it"}], [images["prompt", 0]])
    b_ids, b_images = vision.encode(
        [{"role": "user", "content": "two <image> and <image> now"}], [images["prompt", 1], images["prompt", 2]]
    )
    text = lambda k: torch.randint(3, 90, (k,), generator=gen).tolist()  # noqa: E731 - plain characters
    rows, response_images = [], []
    for r in range(2 * N):
        if r == 4:
            obs_image = vision.prepare_image(images["obs", 4])
            obs = vision.encode_text(" <image> seen ", [obs_image])
            rows.append(text(3) + obs + text(4))
            response_images.append([obs_image])
        else:
            rows.append(text(2 + r % 4))
            response_images.append([])
    width = max(len(x) for x in rows)
    response = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, x in enumerate(rows):
        response[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    return ResponseBatch(
        [a_ids] * N + [b_ids] * N, response, mask,
        prompt_images=[a_images] * N + [b_images] * N, response_images=response_images,
    )


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    model, _, vision = tiny_vlm(request.param, dtype=torch.float64)
    return request.param, exact_float64_norms(model), vision


def test_both_paths_equal_the_models_forward(setup):
    family, model, vision = setup
    batch = make_batch(vision)
    with torch.no_grad():
        want = reference(model, family, vision, batch)
        for shared in (True, False):
            got, _ = response_log_probs(
                model, batch, shared_prefix=shared, temperature=TEMPERATURE, vision=vision.family, chunk_size=5
            )
            assert_equal_where_sampleable(got, want, batch, vision)


def assert_equal_where_sampleable(got, want, batch, vision):
    """Equal on every token the sampler can draw; the observation's image and frame tokens
    (never drawn, loss mask 0) have log-prob -inf in the reference and the float minimum here."""
    banned = torch.tensor(vision.family.never_sampled())
    image = torch.isin(batch.response_ids, banned) & batch.response_mask.bool()
    assert int(image[4].sum()) >= 4 and int(image.sum()) == int(image[4].sum())  # row 4's observation image
    torch.testing.assert_close(got[~image], want[~image], rtol=0, atol=1e-10)
    assert bool((want[image] == float("-inf")).all()) and bool((got[image] < -1e30).all())


def test_shared_prefix_and_full_sequences_give_the_same_gradients(setup):
    family, model, vision = setup
    batch = make_batch(vision, seed=1)
    weights = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for shared in (True, False):
        lp, ent = response_log_probs(
            model, batch, shared_prefix=shared, temperature=TEMPERATURE, with_entropy=True, vision=vision.family
        )
        loss = (lp * weights * batch.response_mask).sum() + 0.1 * (ent * batch.response_mask).sum()
        grads.append(torch.autograd.grad(loss, params, allow_unused=True))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    in_tower = lambda name: "visual" in name or "vision_model" in name  # noqa: E731
    for name, a, b in zip(names, *grads):
        assert (a is None) == (b is None), name
        if a is not None:
            # Qwen's vision attention applies its rotary embedding in float32 even in a float64
            # model: the tower's gradients, summed over a group once or per row, agree to 1e-6
            rtol = 1e-6 if in_tower(name) else 1e-8
            torch.testing.assert_close(a, b, rtol=rtol, atol=max(rtol * float(b.abs().max()), 1e-12), msg=name)
    # the gradient reaches the vision tower through the image features
    assert any(a is not None and a.abs().sum() > 0 for name, a in zip(names, grads[0]) if in_tower(name))


def test_micro_batches_reuse_a_groups_prompt_pass_with_its_images(setup):
    """PolicyUpdater.score_all with 2-row micro-batches: each group's prompt (and its images)
    runs once for several micro-batches; the values stay the model's."""
    family, model, vision = setup
    batch = make_batch(vision, seed=2)
    from grouprl.trainer.update import StepTensors

    tensors = StepTensors(
        prompt_ids=batch.prompt_ids, response_ids=batch.response_ids, response_mask=batch.response_mask,
        loss_mask=batch.response_mask.float(), advantages=torch.zeros(2 * N),
        prompt_images=batch.prompt_images, response_images=batch.response_images,
    )
    for micro in (2, 2 * N):
        updater = PolicyUpdater(
            ActorConfig(micro_batch_size=micro), temperature=TEMPERATURE, pad_token_id=0, vision=vision.family
        )
        with torch.no_grad():
            got = updater.score_all(model, tensors)
            assert_equal_where_sampleable(got.double(), reference(model, family, vision, batch), batch, vision)


def test_the_update_sees_every_image_and_only_its_own(setup):
    """One pixel of the observation image of row 4 moves row 4 alone (after the observation);
    one pixel of prompt 0's image moves the rows of group 0 alone."""
    family, model, vision = setup
    base = make_batch(vision)
    obs = copy.copy(colours(1, seed=4)[0])
    obs.putpixel((0, 0), (255 - obs.getpixel((0, 0))[0], 0, 0))
    prompt = copy.copy(colours(1, seed=1)[0])
    prompt.putpixel((30, 30), (0, 255 - prompt.getpixel((30, 30))[1], 0))
    with torch.no_grad():
        lp = lambda b: response_log_probs(model, b, temperature=TEMPERATURE, vision=vision.family)[0]  # noqa: E731
        before = lp(base)
        moved_obs = (lp(make_batch(vision, pixels={("obs", 4): obs})) - before).abs().amax(-1)
        moved_prompt = (lp(make_batch(vision, pixels={("prompt", 0): prompt})) - before).abs().amax(-1)
    assert moved_obs[4] > 1e-6 and all(moved_obs[r] == 0 for r in range(2 * N) if r != 4)
    assert all(moved_prompt[r] > 1e-6 for r in range(N)) and all(moved_prompt[r] == 0 for r in range(N, 2 * N))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_update_scores_what_generation_sampled(family):
    """Sample with images at temperature 0.9 (the engine reports each token's log-prob), then
    score the same tokens on the update's path: equal to float32 precision."""
    model, tokenizer, vision = tiny_vlm(family)
    a_ids, a_images = vision.encode([{"role": "user", "content": "<image> what"}], colours(1, seed=5))
    b_ids, b_images = vision.encode([{"role": "user", "content": "<image> or <image>?"}], colours(2, seed=6))
    engine = HFEngine(model, tokenizer, vision=vision.family, report_log_probs=True)
    out = engine.generate([a_ids, b_ids], N, SamplingParams(max_new_tokens=8, temperature=TEMPERATURE),
                          torch.Generator().manual_seed(0), images=[a_images, b_images])
    width = max(len(g.token_ids) for g in out)
    response = torch.zeros((len(out), width), dtype=torch.long)
    mask = torch.zeros((len(out), width), dtype=torch.long)
    sampled = torch.zeros((len(out), width))
    for i, g in enumerate(out):
        response[i, : len(g.token_ids)], mask[i, : len(g.token_ids)] = torch.tensor(g.token_ids), 1
        sampled[i, : len(g.token_ids)] = torch.tensor(g.log_probs)
    batch = ResponseBatch([a_ids] * N + [b_ids] * N, response, mask,
                          prompt_images=[a_images] * N + [b_images] * N, response_images=[[]] * (2 * N))
    with torch.no_grad():
        for shared in (True, False):
            got, _ = response_log_probs(model, batch, shared_prefix=shared, temperature=TEMPERATURE,
                                        vision=vision.family)
            torch.testing.assert_close(got[mask.bool()], sampled[mask.bool()], rtol=0, atol=2e-5)


def test_prompts_with_the_same_text_and_other_images_are_two_prompts(setup):
    """Two groups ask the same question of different images: equal token ids, so a prompt
    identity by ids alone would run one group's image for both (the update would score the
    other group blind to its own image)."""
    family, model, vision = setup
    red, blue = colours(2, seed=8)
    ids_a, images_a = vision.encode([{"role": "user", "content": "<image> colour?"}], [red])
    ids_b, images_b = vision.encode([{"role": "user", "content": "<image> colour?"}], [blue])
    assert ids_a == ids_b and images_a[0].key != images_b[0].key
    response = torch.randint(3, 90, (4, 5), generator=torch.Generator().manual_seed(0))
    batch = ResponseBatch([ids_a] * 2 + [ids_b] * 2, response, torch.ones_like(response),
                          prompt_images=[images_a] * 2 + [images_b] * 2, response_images=[[]] * 4)
    with torch.no_grad():
        want = reference(model, family, vision, batch)
        got, _ = response_log_probs(model, batch, temperature=TEMPERATURE, vision=vision.family)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        updater = PolicyUpdater(ActorConfig(micro_batch_size=1), temperature=TEMPERATURE, pad_token_id=0,
                                vision=vision.family)
        from grouprl.trainer.update import StepTensors

        tensors = StepTensors(prompt_ids=batch.prompt_ids, response_ids=response, response_mask=batch.response_mask,
                              loss_mask=batch.response_mask.float(), advantages=torch.zeros(4),
                              prompt_images=batch.prompt_images, response_images=batch.response_images)
        units = updater.plan(tensors, [0, 1, 2, 3])
        assert sorted(len(u.prompts) for u in units) == [1, 1]  # one prefix pass per group, two groups
        torch.testing.assert_close(updater.score_all(model, tensors).double(), want, rtol=0, atol=1e-10)
