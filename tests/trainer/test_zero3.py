"""The update on a sharded policy (ZeRO-3, trainer/lockstep.py) on two ranks (torch.multiprocessing,
gloo, FSDP2): a tiny Qwen2-VL in float64 whose rank 0 holds two groups with images (one
response with an image observation) in two micro-batches, and rank 1 one group of text in one.
Every rank runs two passes (rank 1's second of zero weight; both on the tower's blank image), and the
gradients summed into the shards are one process's on all the rows; with the reductions every
other pass (actor.fsdp_reduce_every=2) too. While a layer runs forward, at most two decoder or
vision layers hold whole weights (the running one), and after the update
none does and each gradient is a shard."""

import copy

import pytest
import torch
from test_sharded_push import on_two_ranks
from test_update import CountingScheduler, GradRecorder, actor_config

from grouprl.trainer.parallel import decoder_layers, full_tensor, shard
from grouprl.trainer.update import PolicyUpdater, StepTensors
from helpers import exact_float64_norms
from vision_helpers import colours, tiny_vlm

pytestmark = pytest.mark.slow

RANK_ROWS = {0: list(range(6)), 1: [6, 7]}  # rank 0: 2 prompts with images x 3 samples; rank 1: text x 2


def step_tensors(vision, rows: list[int]) -> StepTensors:
    """Rows of the 8: prompts A (one image) and B (two) with 3 samples each, row 4's response
    holding an image observation; prompt C (text) with 2."""
    gen = torch.Generator().manual_seed(0)
    images = colours(4, seed=1)
    a = vision.encode([{"role": "user", "content": "<image> what"}], [images[0]])
    b = vision.encode([{"role": "user", "content": "<image> and <image>"}], [images[1], images[2]])
    c = vision.encode([{"role": "user", "content": "no image here"}], [])
    prompts = [a] * 3 + [b] * 3 + [c] * 2
    text = lambda k: torch.randint(3, 90, (k,), generator=gen).tolist()  # noqa: E731
    responses, response_images = [], []
    for r in range(8):
        if r == 4:
            observation = vision.prepare_image(images[3])
            responses.append(text(2) + vision.encode_text(" <image> ", [observation]) + text(3))
            response_images.append([observation])
        else:
            responses.append(text(2 + r % 5))
            response_images.append([])
    advantages = torch.randn(8, generator=gen, dtype=torch.float64)
    width = max(len(responses[r]) for r in range(8))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(responses[r])], mask[i, : len(responses[r])] = torch.tensor(responses[r]), 1
    return StepTensors(
        prompt_ids=[prompts[r][0] for r in rows], response_ids=ids, response_mask=mask, loss_mask=mask.double(),
        advantages=advantages[rows].float(), prompt_images=[prompts[r][1] for r in rows],
        response_images=[response_images[r] for r in rows],
    )  # fmt: skip


def gradients(policy, params, vision, tensors, ranks=None, **settings):
    cfg = actor_config(micro_batch_size=3, **settings)
    updater = PolicyUpdater(cfg, temperature=0.9, pad_token_id=0, vision=vision.family, ranks=ranks)
    optimizer = GradRecorder(params)
    updater.update(policy, optimizer, CountingScheduler(), tensors, len(set(map(tuple, tensors.prompt_ids))), params)
    return optimizer.steps[0]


def whole_layers(layers) -> int:
    """Layers whose weights FSDP holds whole now (it registers the whole tensors in place of the
    shards while they are gathered)."""
    return sum(not hasattr(next(layer.parameters()), "to_local") for layer in layers)


def on_rank(rank: int) -> None:
    from grouprl.trainer.parallel import Ranks

    ranks = Ranks.from_env("cpu")
    model, _, vision = tiny_vlm("qwen2_vl", dtype=torch.float64, seed=2)
    model = exact_float64_norms(model)
    whole_model = copy.deepcopy(model)
    want = gradients(whole_model, list(whole_model.parameters()), vision, step_tensors(vision, list(range(8))))
    layers = decoder_layers(model)
    policy = shard(model)
    tower = sum("Vision" in type(layer).__name__ for layer in layers)
    seen: list[int] = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: seen.append(whole_layers(layers)))
    params = list(model.parameters())
    mine = step_tensors(vision, RANK_ROWS[rank])
    for every in (1, 2):
        seen.clear()
        got = gradients(policy, params, vision, mine, ranks, fsdp_reduce_every=every)
        # 2 passes, each the tower, then the language model twice (prompts, then responses)
        assert len(seen) == 2 * (tower + 2 * (len(layers) - tower)), (len(seen), tower, len(layers))
        assert max(seen) == 1, seen
        assert whole_layers(layers) == 0
        for p, g, w in zip(params, got, want):
            assert hasattr(g, "to_local") and g.to_local().numel() <= (p.numel() + 1) // 2 + p.shape[0]
            torch.testing.assert_close(full_tensor(g), w, rtol=1e-9, atol=1e-11)


def test_sharded_passes_in_step_give_one_process_gradients():
    on_two_ranks(on_rank)
