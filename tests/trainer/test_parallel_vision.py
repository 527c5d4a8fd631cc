"""A trainable vision tower on several ranks (torchrun, gloo on CPU, FSDP2): tiny VLMs whose
tower trains in full or through LoRA give, on 2 ranks, the run of one process: the same
samples, rewards, losses and gradient norms, the same final weights, the tower's included.

The data mixes prompts with and without an image, read in file order so that the mini-batches
(one group per rank) cover every case: an image on rank 0 only, on rank 1 only, on both, on
neither (there the tower gets no gradient on any rank, and is not stepped, as in one process).
Weights stay sharded through the update (ZeRO-3): every pass of every rank runs the tower first,
on a blank image where the pass has none, whenever some rank's rows have an image, and a rank
with fewer passes pads with passes over one pad token; the test of every trainable weight's
zero gradient below covers what such a pass leaves."""

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import LOWER_FRACTION
from vision_task import write_vision_run

from grouprl.config import load_config
from grouprl.trainer.lockstep import PassImages, pad_batch
from grouprl.trainer.logprobs import response_log_probs
from grouprl.trainer.models import load_causal_lm
from grouprl.trainer.parallel import Ranks, decoder_layers
from grouprl.trainer.setup import check_parallel
from grouprl.vision.families import family_class, is_vision_config
from helpers import REORDERED, run_grouprl, train_here
from vision_helpers import colours, tiny_vlm

WITH_IMAGE = (0, 3, 4, 5)  # rows of the 8 training prompts that keep their image
SETTINGS = [
    "data.sampler=sequential",
    "data.train_batch_size=4",
    "actor.mini_batch_size=2",
    "actor.micro_batch_size=3",
    "actor.dtype=float32",
    "rollout.dtype=float32",
    "trainer.total_steps=2",
    "trainer.save_best=false",
    "trainer.val_before_train=false",
    "model.freeze_vision_tower=false",
    # a key bias's gradient is zero but for rounding (softmax ignores what it adds to a row's
    # logits), which Adam's default eps would scale up to a whole step, differently on 1 and 2 ranks
    "actor.optim.eps=1e-6",
]
TOWER = ("visual.", "vision_model.", "connector.")  # in the exported names of the tower and connector
# what FSDP shards one by one: the decoder layers and the tower's
BLOCKS = {
    "qwen2_vl": {"Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"},
    "qwen2_5_vl": {"Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"},
    "idefics3": {"LlamaDecoderLayer", "Idefics3EncoderLayer"},
    "smolvlm": {"LlamaDecoderLayer", "SmolVLMEncoderLayer"},
}


def train(config, ranks: int, *overrides):
    if ranks == 1:  # the numbers of a process of its own on one thread, seconds sooner
        train_here(config, *SETTINGS, *overrides)
    else:
        run_grouprl(ranks, "train", str(config), *SETTINGS, *overrides)


def mixed_run(root, family):
    """The colour task of `family` with the images of rows outside WITH_IMAGE taken out, the
    others blocks of random colours (a solid colour's patches are all alike, so the tower's
    attention would have gradients of rounding alone, as a key bias has)."""
    config = write_vision_run(root, family, vision_init_std=0.2, reward=LOWER_FRACTION)
    data = root / "t.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for i, (row, image) in enumerate(zip(rows, colours(len(rows)))):
        if i in WITH_IMAGE:
            image.save(root / row["images"][0])
        else:
            del row["images"]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return config


def records(run_dir):
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [
        (r["step"], r["uid"], r["prompt"], r["sample"], r["response"], r["reward"], round(r["advantage"], 6))
        for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())
    ]
    return {m["step"]: m for m in metrics if "actor/grad_norm" in m}, rollouts


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen2_vl", ["actor.kl_loss_coef=0.1"]),  # the whole tower trains, beside a sharded KL reference
        ("idefics3", ["model.lora.rank=3", "model.lora.target_vision=true"]),  # adapters in tower, connector
    ],
)
def test_a_trainable_tower_on_two_ranks_equals_one_process(tmp_path, family, overrides):
    config = mixed_run(tmp_path, family)
    for ranks in (1, 2):
        train(config, ranks, *overrides, f"trainer.experiment_name=ranks-{ranks}")
    runs = [tmp_path / "runs" / f"ranks-{r}" for r in (1, 2)]
    (one, one_rollouts), (two, two_rollouts) = map(records, runs)
    assert two_rollouts == one_rollouts and len(one_rollouts) == 2 * 16
    shown = {(r[0], r[1]) for r in one_rollouts if r[2].startswith("<image>")}
    assert shown == {(1, "t0"), (1, "t3"), (2, "t4"), (2, "t5")}  # the cases of the docstring
    assert sorted(one) == sorted(two) == [1, 2]
    for step in (1, 2):
        assert two[step]["dist/world_size"] == 2
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/clipfrac"):
            if key in one[step]:
                assert two[step][key] == pytest.approx(one[step][key], **REORDERED), (step, key)
    w1, w2 = (load_file(str(run / "final" / "model.safetensors")) for run in runs)
    start = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert w1.keys() == w2.keys() == start.keys()
    tower = [n for n in w1 if any(part in n for part in TOWER)]
    assert tower and max(float((w1[n] - start[n]).abs().max()) for n in tower) > 1e-3  # the tower trained
    for name in w1:
        # Adam divides by small second moments: float reordering moves a weight by < 1% of a step (lr 1e-2)
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-4, msg=name)
    # the evaluation (held-out prompts with images, split over the ranks) agrees too
    lines = [(run / "metrics.jsonl").read_text().splitlines() for run in runs]
    evals = [[m["val/accuracy"] for m in map(json.loads, run) if "val/accuracy" in m] for run in lines]
    assert evals[0] and evals[1] == pytest.approx(evals[0])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm"])
@pytest.mark.parametrize("lora", [False, True])
def test_a_padding_pass_gives_every_trainable_weight_a_zero_gradient(tmp_path, family, lora):
    """What keeps the ranks' reductions alike: after a pass of zero weight (the tower on its
    blank image first, then one pad token through the language model, then the tower's
    backward) every trainable weight, the tower's and connector's included, holds a gradient,
    all zeros (the update is unchanged); and FSDP shards the tower layer by layer (Idefics3's
    encoder layers, not only their attention)."""
    _, _, vision = tiny_vlm(family, tmp_path)
    settings = [f"model.path={tmp_path}", "model.freeze_vision_tower=false"]
    if lora:
        settings += ["model.lora.rank=3", "model.lora.target_vision=true"]
    cfg = load_config(None, settings)
    check_parallel(cfg, Ranks(0, 2))  # several ranks take it
    model = load_causal_lm(cfg.model, str(tmp_path), torch.device("cpu"), torch.float32)
    assert is_vision_config(model.config)
    tower = family_class(model.config).tower
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.removeprefix("base_model.model.").startswith(tower) for n in trainable)
    model.train()
    images = PassImages(model, vision.family, None, contextlib.nullcontext())
    assert images.blank and images.leaf.requires_grad
    lp, _ = response_log_probs(model, pad_batch(0, "cpu"), vision=images.family)
    (lp.sum() * 0.0).backward()
    assert images.leaf.grad is not None and not images.leaf.grad.any()  # the blank's features entered the pass
    images.backward()
    for name, p in trainable.items():
        assert p.grad is not None and not p.grad.any(), name
    assert {type(b).__name__ for b in decoder_layers(model)} == BLOCKS[family]
