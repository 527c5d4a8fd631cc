"""The vLLM engine with vision-language policies, in-process on vLLM's CPU build, against the hf
engine (itself checked against transformers' own forward) and the update's log-probs: tiny VLMs
of each family built here, language model head size 32 (vLLM's CPU attention), saved with their
image processor. Images go to vLLM as the source images the trainer's processor read; each
request is checked for the trainer's token counts, ids and pixels.

These tests run in the vLLM environment (`-m vllm`); without vLLM they fail at the import.
"""

import gc

import pytest
import torch

from grouprl.data.sample import Sample
from grouprl.rollout.engines.hf import HFEngine, SamplingParams
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.logprobs import response_log_probs
from grouprl.trainer.update import build_step_tensors
from vision_helpers import VLLM_TEXT, colours, tiny_vlm

pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
# |update - vLLM| per token, both in bf16 (vLLM's bf16 weights, the update's autocast over float32
# weights): bf16's rounding of logits of a few units (measured on these tiny VLMs: mean 0.02-0.03, max 0.13)
BF16_GAP_MEAN, BF16_GAP_MAX = 0.05, 0.3
# Idefics3 and SmolVLM split images into tiles (a grid plus the global view); SmolVLM's processor
# needs num2words in vLLM (for its video prompts; transformers refuses to build it without)
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm"]


class EngineSettings:  # the rollout config's vLLM fields and the training sampling settings
    gpu_memory_utilization = 0.5
    kv_cache_gb = 0.25
    tensor_parallel_size = 1
    sleep_level = 1
    enforce_eager = True
    max_model_len = 1024
    temperature = 1.0
    top_k = 0
    top_p = 1.0


class TruncatingSettings(EngineSettings):  # top-p at temperature 1: vLLM's raw log-probs
    top_p = 0.8


def build(family, folder=None, seed=0, **kwargs):
    split = family in ("idefics3", "smolvlm")
    return tiny_vlm(family, folder, seed=seed, text_sizes=VLLM_TEXT, split=split, **kwargs)


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    """(family, engine, folder) with one engine alive at a time: an in-process engine's shutdown
    tears down the parallel groups every other engine uses."""
    from grouprl.rollout.engines.vllm import VLLMEngine

    family = request.param
    if family == "smolvlm":
        pytest.importorskip("num2words")
    folder = tmp_path_factory.mktemp(family)
    model, tokenizer, vision = build(family, folder)
    engine = VLLMEngine(model, tokenizer, str(folder), EngineSettings, seed=0, max_model_len=1024, vision=vision.family)
    yield family, engine, folder
    del engine
    gc.collect()


def moved(family, seed: int):
    """The tiny VLM with every weight (vision tower, embeddings and head included) moved by
    seeded noise: (model, tokenizer, vision processor)."""
    model, tokenizer, vision = build(family)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model, tokenizer, vision


def encode_all(vision, texts, seed=0):
    """Prompts (ids) and their processed images; images of other sizes and aspect ratios."""
    prompts, images = [], []
    for k, text in enumerate(texts):
        shown = colours(text.count("<image>"), seed=seed + k, size=(40 + 12 * k, 56 - 6 * k))
        ids, ims = vision.encode([{"role": "user", "content": text}], shown)
        prompts.append(ids)
        images.append(ims)
    return prompts, images


TEXTS = ["<image> what?", "see <image> and <image>", "no image here, talk"]


def test_greedy_decoding_with_images_equals_the_hf_engine_before_and_after_a_push(setup):
    """Two prompts with images (one with two, of other sizes) and one without, n = 2; then the
    same prompts after a push that moved the vision tower too: vLLM must not reuse image features
    of the old weights (its encoder cache keeps them by image key)."""
    family, engine, _ = setup
    for seed in (1, 2):
        model, tokenizer, vision = moved(family, seed)
        engine.weights_updated(model)
        prompts, images = encode_all(vision, TEXTS)
        got = engine.generate(prompts, 2, GREEDY, images=images)
        want = HFEngine(model, tokenizer, vision=vision.family).generate(prompts, 2, GREEDY, images=images)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
        assert [g.text for g in got] == [w.text for w in want]


def session_turns(engine, vision, params, generator=None):
    """Turn 1 on two prompts with images (n = 2); turn 2 on rows 0, 1 and 3 with observations:
    row 0 a new image, row 1 text only, row 3 the prompt's own image again.
    -> (observations, observation images, turn 1, turn 2, prompts, prompt images)."""
    prompts, images = encode_all(vision, ["<image> look", "two <image> <image>"], seed=2)
    session = engine.open_session(prompts, 2, images=images)
    first = session.generate([0, 1, 2, 3], [[], [], [], []], params, generator)
    new = vision.prepare_image(colours(1, seed=9, size=(70, 42))[0])
    shown = [[new], [], [images[1][0]]]
    texts = ["\nseen <image> ok\n", "\nnothing here\n", "\nagain <image>\n"]
    observations = [vision.encode_text(t, x) for t, x in zip(texts, shown)]
    second = session.generate([0, 1, 3], observations, params, generator, new_images=shown)
    return observations, shown, first, second, prompts, images


def test_a_session_with_an_image_observation_equals_the_hf_engine(setup):
    """Whole conversations re-fed each turn (ReprefillSession) with an image observation in the
    second turn: the same greedy turns as the hf engine's KV-cache session."""
    family, engine, _ = setup
    model, tokenizer, vision = moved(family, 3)
    engine.weights_updated(model)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    runs = []
    for e in (engine, HFEngine(model, tokenizer, vision=vision.family)):
        _, _, first, second, _, _ = session_turns(e, vision, params)
        runs.append(([g.token_ids for g in first], [g.token_ids for g in second]))
    assert runs[0] == runs[1]


def trajectories_of(turns, n=2):
    """Trajectories of the session's rows 0, 1, 3: turn 1, the observation (mask 0), turn 2."""
    from grouprl.data.sample import Sample
    from grouprl.rollout.trajectory import Trajectory

    observations, shown, first, second, prompts, images = turns
    out = []
    for k, row in enumerate([0, 1, 3]):
        a, b = first[row], second[k]
        out.append(
            Trajectory(
                sample=Sample(uid=f"p{row // n}", messages=[]),
                index=row % n,
                prompt_ids=prompts[row // n],
                response_ids=a.token_ids + observations[k] + b.token_ids,
                loss_mask=[1] * len(a.token_ids) + [0] * len(observations[k]) + [1] * len(b.token_ids),
                rollout_log_probs=a.log_probs + [0.0] * len(observations[k]) + b.log_probs,
                prompt_images=images[row // n],
                response_images=shown[k],
            )
        )
    return out


def test_sampled_log_probs_are_the_updates_with_image_tokens_likely(setup, capsys):
    """Sampling at temperature 0.7 through a two-turn session with an image observation, with
    the image and frame tokens made the model's favourites: vLLM never samples them, and the
    log-prob it reports for every policy token is the update's (which leaves those tokens out
    and renormalises), both in float32."""
    family, engine, _ = setup
    model, tokenizer, vision = moved(family, 4)
    banned = vision.family.never_sampled()
    with torch.no_grad():  # tied head: these rows lead the logits wherever the state allows
        model.get_output_embeddings().weight[banned] *= 6
    engine.weights_updated(model)
    params = SamplingParams(max_new_tokens=8, temperature=0.7)
    turns = session_turns(engine, vision, params, torch.Generator().manual_seed(0))
    trajectories = trajectories_of(turns)
    sampled = [t for tr in trajectories for t, m in zip(tr.response_ids, tr.loss_mask) if m]
    assert len(sampled) > 20 and not set(sampled) & set(banned)
    tensors = build_step_tensors(trajectories, "cpu", mask_truncated=False, pad_token_id=0)
    with torch.no_grad():
        update, _ = response_log_probs(
            model, tensors.rows(list(range(len(trajectories)))), temperature=0.7, vision=vision.family
        )
    policy = tensors.loss_mask.bool()
    gap = (update - tensors.rollout_log_probs)[policy].abs()
    with capsys.disabled():  # the figure benchmarks/RESULTS.md quotes
        print(f"\n{family}: {gap.numel()} policy tokens, |update - vLLM| max {gap.max():.2e}, mean {gap.mean():.2e}")
    assert gap.numel() == len(sampled)
    assert gap.max() < 1e-4, gap.max()


def test_the_engine_refuses_images_processed_otherwise_than_vllm_does(setup):
    """The trainer's processor set apart from the model folder's: other pixel limits (Qwen) or no
    tiling (Idefics3/SmolVLM) give other token counts, another normalisation gives the same
    counts with other pixels; each is one error naming the prompt and the image. The engine
    goes on working after it."""
    from grouprl.rollout.engines.vllm import ImageMismatch

    family, engine, folder = setup
    model, tokenizer, vision = build(family)
    engine.weights_updated(model)
    if family.startswith("qwen"):
        _, _, other = build(family, max_pixels=28 * 28)
    else:
        _, _, other = tiny_vlm(family, text_sizes=VLLM_TEXT, split=False)
    prompts, images = encode_all(other, TEXTS)
    with pytest.raises(ImageMismatch, match=r"prompt 0, image 0 \(40x56\): vLLM expands it to \d+ image tokens, the trainer's processor to \d+") as raised:
        engine.generate(prompts, 1, GREEDY, images=images)
    assert raised.value.prompt == 0

    said = shifted_mean_refused(engine, tokenizer)
    assert said.startswith("prompt 0, image 0: vLLM's processor gives other pixel_values than the trainer's; ")
    mean = tuple(vision.family.image_processor.image_mean)  # the folder's, which vLLM reads
    assert f"image_mean (0.1, 0.2, 0.3) here, {mean!r} in vLLM's" in said, said  # the setting, both ways

    prompts, images = encode_all(vision, TEXTS, seed=5)
    got = engine.generate(prompts, 1, GREEDY, images=images)
    want = HFEngine(model, tokenizer, vision=vision.family).generate(prompts, 1, GREEDY, images=images)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3"])  # the source's and the embedded VLM's
def test_a_bf16_engine_takes_the_trainers_pixels_as_it_computes_with_them(tmp_path, family):
    """vLLM in bf16 (the default dtype where bf16 is native) casts its processor's pixels to bf16:
    they are the trainer's float32 pixels rounded, which the check accepts (it compares in the
    dtype vLLM computes with), and vLLM samples the distribution of the update under bf16
    autocast within bf16's rounding. Pixels that differ beyond rounding are still refused, the
    message naming the dtype and the setting. Started last: it shuts down on its own."""
    from grouprl.rollout.engines.vllm import VLLMEngine

    model, tokenizer, vision = build(family, tmp_path)
    engine = VLLMEngine(
        model, tokenizer, str(tmp_path), EngineSettings, max_model_len=1024, vision=vision.family, dtype=torch.bfloat16
    )
    seen = []
    check = engine.images.check

    def keeping(i, prompt, images, request):
        for image, item in zip(images, request["mm_kwargs"].get("image", [])):
            seen.append((image.tensors["pixel_values"], item["pixel_values"].data))
        return check(i, prompt, images, request)

    engine.images.check = keeping
    prompts, images = encode_all(vision, TEXTS)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    generations = engine.generate(prompts, 2, params, torch.Generator().manual_seed(0), images=images)
    assert len(seen) == 3  # every image processed once
    for ours, theirs in seen:
        assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16
        assert torch.equal(theirs, ours.reshape(theirs.shape).to(torch.bfloat16))
    assert any(not torch.equal(theirs.float(), ours.reshape(theirs.shape)) for ours, theirs in seen)  # rounded
    trajectories = [
        Trajectory(
            sample=Sample(uid=f"p{k // 2}", messages=[]), index=k % 2, prompt_ids=prompts[k // 2],
            response_ids=g.token_ids, loss_mask=[1] * len(g.token_ids), rollout_log_probs=g.log_probs,
            prompt_images=images[k // 2],
        )
        for k, g in enumerate(generations)
    ]  # fmt: skip
    tensors = build_step_tensors(trajectories, "cpu", mask_truncated=False, pad_token_id=0)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        update, _ = response_log_probs(model, tensors.rows(list(range(6))), temperature=1.0, vision=vision.family)
    gap = (update.float() - tensors.rollout_log_probs)[tensors.loss_mask.bool()].abs()
    assert gap.numel() == sum(len(g.token_ids) for g in generations)
    assert gap.mean() < BF16_GAP_MEAN and gap.max() < BF16_GAP_MAX, (gap.mean(), gap.max())

    mean = tuple(vision.family.image_processor.image_mean)
    said = shifted_mean_refused(engine, tokenizer)
    assert said.startswith(
        "prompt 0, image 0: vLLM's processor gives other pixel_values than the trainer's in bfloat16 (vLLM's dtype); "
    )
    assert f"image_mean (0.1, 0.2, 0.3) here, {mean!r} in vLLM's" in said, said


def shifted_mean_refused(engine, tokenizer) -> str:
    """The message of the engine's refusal of images the trainer's processor (the engine's
    family's) normalised with another mean than the model folder's."""
    from grouprl.rollout.engines.vllm import ImageMismatch
    from grouprl.vision.processor import VisionProcessor

    processor = engine.images.family.image_processor
    kept = processor.image_mean
    processor.image_mean = [0.1, 0.2, 0.3]
    try:
        prompts, images = encode_all(VisionProcessor(tokenizer, engine.images.family), TEXTS, seed=5)
        with pytest.raises(ImageMismatch) as raised:
            engine.generate(prompts, 1, GREEDY, images=images)
    finally:
        processor.image_mean = kept
    return str(raised.value)


def test_with_top_p_at_temperature_1_the_log_probs_leave_the_image_tokens_out(tmp_path, monkeypatch):
    """Top-p 0.8 at temperature 1: vLLM's raw log-probs (the whole distribution's) include the
    image tokens' mass, here made sizeable; the engine takes it out with the log-probs vLLM
    reports for those tokens, so they are the update's (the same samples' uncorrected ones are
    not). Started last: it shuts down on its own."""
    from grouprl.data.sample import Sample
    from grouprl.rollout.engines.vllm import VLLMEngine
    from grouprl.rollout.trajectory import Trajectory

    model, tokenizer, vision = build("qwen2_vl", tmp_path)
    with torch.no_grad():
        model.get_output_embeddings().weight[vision.family.never_sampled()] *= 2
    engine = VLLMEngine(model, tokenizer, str(tmp_path), TruncatingSettings, max_model_len=1024, vision=vision.family)
    assert engine.logprobs_mode == "raw_logprobs"
    prompts, images = encode_all(vision, TEXTS[:2])
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.8)
    gaps = []
    for correct in (True, False):
        if not correct:
            monkeypatch.setattr(engine, "_raw_banned", lambda: [])
        generations = engine.generate(prompts, 4, params, torch.Generator().manual_seed(0), images=images)
        trajectories = [
            Trajectory(
                sample=Sample(uid=f"p{k // 4}", messages=[]),
                index=k % 4,
                prompt_ids=prompts[k // 4],
                response_ids=g.token_ids,
                loss_mask=[1] * len(g.token_ids),
                rollout_log_probs=g.log_probs,
                prompt_images=images[k // 4],
            )
            for k, g in enumerate(generations)
        ]
        tensors = build_step_tensors(trajectories, "cpu", mask_truncated=False, pad_token_id=0)
        with torch.no_grad():
            update, _ = response_log_probs(model, tensors.rows(list(range(8))), temperature=1.0, vision=vision.family)
        gaps.append((update - tensors.rollout_log_probs)[tensors.loss_mask.bool()].abs().max())
    assert gaps[0] < 1e-4 < 1e-2 < gaps[1], gaps


def test_a_groups_samples_take_one_copy_of_each_image(tmp_path, monkeypatch, capsys):
    """k prompts with one 448 x 448 image each (256 image tokens), n samples, two turns of a
    session that re-sends every conversation whole: vLLM processes each image once (a group is
    one request; later turns find the image by its key), and the trajectories' prompt images are
    one ImageInput per prompt image, whatever n. Prints the host memory per image: the trainer's
    tensors and source image, vLLM's processed copy, and the RSS growth over the rollout (n = 1
    against n = 8, after a warm-up rollout, freed heap memory handed back before each). Started
    last: it shuts down on its own."""
    import psutil

    from grouprl.cpu.allocator import release_free_memory
    from grouprl.rollout.engines import rollout_phase
    from grouprl.rollout.engines.vllm import VLLMEngine

    model, tokenizer, vision = build("qwen2_vl", tmp_path, max_pixels=448 * 448)
    engine = VLLMEngine(model, tokenizer, str(tmp_path), EngineSettings, max_model_len=1024, vision=vision.family)
    processed = []  # bytes of each image vLLM processed for a request
    check = engine.images.check

    def counting(i, prompt, images, request):
        for item in request["mm_kwargs"].get("image", []):
            if item is not None:
                processed.append(sum(item[name].data.nbytes for name in item))
        return check(i, prompt, images, request)

    monkeypatch.setattr(engine.images, "check", counting)
    k, params = 8, SamplingParams(max_new_tokens=4, temperature=1.0)
    figures = {}
    for run, n in enumerate((1, 1, 8)):  # the first warms up
        processed.clear()
        pages = colours(k, seed=run, size=(448, 448))
        prompts, images = [], []
        for page in pages:
            ids, ims = vision.encode([{"role": "user", "content": "<image> read it"}], [page])
            prompts.append(ids)
            images.append(ims)
        gc.collect()
        release_free_memory()
        before = psutil.Process().memory_info().rss
        with rollout_phase(engine):
            session = engine.open_session(prompts, n, images=images)
            rows = list(range(k * n))
            session.generate(rows, [[] for _ in rows], params, torch.Generator().manual_seed(0))
            more = tokenizer("\nok\n", add_special_tokens=False)["input_ids"]
            session.generate(rows, [more for _ in rows], params, torch.Generator().manual_seed(1))
            grown = psutil.Process().memory_info().rss - before
        assert len(processed) == k  # not k * n, and nothing again on the second turn
        held = {id(x) for row in session.context_images for x in row}
        assert len(held) == k  # the n rows of a group hold its ImageInput, not copies
        trainer = sum(t.nbytes for t in images[0][0].tensors.values()) + 448 * 448 * 3
        figures[n] = (images[0][0].num_tokens, trainer, processed[0], grown / k)
    with capsys.disabled():
        for n, (tokens, trainer, theirs, grown) in figures.items():
            print(
                f"\nn={n}: {tokens} image tokens; per image: trainer {trainer / 2**20:.2f} MiB (tensors + source), "
                f"vLLM's processed copy {theirs / 2**20:.2f} MiB, RSS growth over the rollout {grown / 2**20:.2f} MiB"
            )
    assert figures[1][:3] == figures[8][:3]
