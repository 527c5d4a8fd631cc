"""The online curriculum inside the training loop: its metrics, dynamic filtering of groups
whose rewards are all equal, and exact resume of its draws."""

import json

import pytest
from tiny import LOWER_FRACTION, tiny_model_dir, write_run_config

from grouprl.config import load_config
from grouprl.curriculum.online import OnlineCurriculum
from grouprl.errors import ConfigError
from grouprl.trainer.trainer import Trainer

# the reward depends on the prompt only (its answer's parity): every group scores all alike
PER_PROMPT = "float(int(ground_truth) % 2)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def trainer_for(root, model_dir, *overrides, reward=LOWER_FRACTION) -> Trainer:
    config = write_run_config(root, model_dir, reward=reward)
    base = [
        "data.sampler=curriculum",
        "trainer.save_final=false",
        "trainer.save_best=false",
        "data.val_files=[]",
    ]
    return Trainer(load_config(config, base + list(overrides)))


def metrics_of(root):
    return [json.loads(line) for line in (root / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]


def step_uids(root):
    by_step = {}
    for line in (root / "runs" / "run" / "rollouts.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], []).append(record["uid"])
    return by_step


def test_curriculum_sampler_tracks_every_group_and_logs_its_buckets(tmp_path, model_dir):
    trainer = trainer_for(tmp_path, model_dir, "curriculum.rebucket_every=2", "trainer.total_steps=3")
    assert isinstance(trainer.parts.collect.sampler, OnlineCurriculum)
    trainer.fit()
    steps = [m for m in metrics_of(tmp_path) if "reward/mean" in m]
    assert len(steps) == 3
    for m in steps:
        sizes = sum(m[f"curriculum/{pool}"] for pool in ("mastered", "edge", "unsolvable", "unseen"))
        assert sizes == 8  # every training prompt sits in exactly one pool
    assert steps[0]["curriculum/unseen"] == 8 and steps[-1]["curriculum/unseen"] < 8
    visited = {uid for uids in step_uids(tmp_path).values() for uid in uids}
    assert sum(trainer.parts.collect.sampler.stats(uid)["visits"] for uid in visited) == 3 * 2  # one update per group


def test_dynamic_filter_over_samples_and_falls_back_to_flat_groups(tmp_path, model_dir):
    """All groups flat: B=2 prompts, then the whole budget (4 in total) is generated, and two of
    the flat groups fill the batch (two dropped)."""
    trainer = trainer_for(
        tmp_path,
        model_dir,
        "curriculum.dynamic_filter=true",
        "curriculum.max_oversample=2",
        "trainer.total_steps=2",
        reward=PER_PROMPT,
    )
    trainer.fit()
    steps = [m for m in metrics_of(tmp_path) if "reward/mean" in m]
    assert [m["batch/generated_groups"] for m in steps] == [4, 4]
    assert [m["batch/zero_std_dropped"] for m in steps] == [2, 2]
    assert steps[-1]["curriculum/zero_variance_avoided"] == 4
    assert steps[-1]["curriculum/extra_prompts"] == 4
    for uids in step_uids(tmp_path).values():
        assert len(uids) == 2 * 4  # B groups of n are trained and logged


def test_dynamic_filter_draws_nothing_extra_when_groups_have_spread(tmp_path, model_dir):
    trainer = trainer_for(tmp_path, model_dir, "curriculum.dynamic_filter=true", "trainer.total_steps=2")
    trainer.fit()
    steps = [m for m in metrics_of(tmp_path) if "reward/mean" in m]
    for m in steps:
        assert m["batch/generated_groups"] == 2 + m["batch/zero_std_dropped"]


def test_resumed_curriculum_draws_what_an_uninterrupted_run_draws(tmp_path, model_dir):
    settings = ["curriculum.rebucket_every=2", "trainer.save_freq=2"]
    whole = tmp_path / "whole"
    trainer_for(whole, model_dir, "trainer.total_steps=4", *settings).fit()
    resumed = tmp_path / "resumed"
    trainer_for(resumed, model_dir, "trainer.total_steps=2", *settings).fit()  # stops after step 2
    second = trainer_for(resumed, model_dir, "trainer.total_steps=4", *settings)
    assert second.step == 2  # resumed from the step-2 checkpoint
    second.fit()
    assert step_uids(resumed) == step_uids(whole)
    assert (
        second.parts.collect.sampler.state_dict()
        == trainer_for(whole, model_dir, "trainer.total_steps=4", *settings).parts.collect.sampler.state_dict()
    )


def test_dynamic_filter_needs_the_curriculum_sampler(tmp_path, model_dir):
    config = write_run_config(tmp_path, model_dir)
    with pytest.raises(ConfigError, match="curriculum.dynamic_filter. needs data.sampler=curriculum"):
        load_config(config, ["curriculum.dynamic_filter=true"])
