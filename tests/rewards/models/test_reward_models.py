"""Reward models in their worker process: a tiny sequence classifier saved to a folder and
loaded by path (the real from_pretrained path), scores equal to the model run in the test,
batching of concurrent items, one line when a model cannot load, and a worker that dies
giving fallbacks (counted) instead of a hang."""

import logging

import pytest
import torch

from grouprl.config import RewardComponentConfig, RewardConfig, RewardModelConfig
from grouprl.data.sample import Sample
from grouprl.errors import ConfigError, UserError
from grouprl.rewards import CompositeReward
from grouprl.rollout.trajectory import Trajectory
from helpers import char_tokenizer, tiny_config


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path_factory.mktemp("rm")
    tokenizer = char_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def classifier_config(path, **model):
    return RewardConfig(
        models=[RewardModelConfig(name="rm", kind="sequence_classifier", path=str(path), **model)],
        components=[RewardComponentConfig(name="preference", function="model:rm")],
    )


def trajectories(prompt_response_pairs):
    out = []
    for i, (prompt, response) in enumerate(prompt_response_pairs):
        sample = Sample(uid=f"u{i // 2}", messages=[{"role": "user", "content": prompt}])
        out.append(Trajectory(sample=sample, index=i % 2, prompt_ids=[1], response_text=response))
    return out


def reference_scores(path, pairs):
    """The classifier's logit for each (prompt, response), computed here one at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    scores = []
    for prompt, response in pairs:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            scores.append(float(model(**ids).logits[0, 0]))
    return scores


PAIRS = [("hi", "hello there"), ("hi", "go away"), ("2+2?", "4"), ("2+2?", "five"), ("x", "y"), ("x", "")]


def test_a_sequence_classifier_scores_in_its_worker_batched(classifier_dir):
    reward = CompositeReward.from_config(classifier_config(classifier_dir, batch_size=4))
    try:
        batch = trajectories(PAIRS)
        metrics = reward.score(batch)
        # padded batches (left or right) give each item the logit it has alone
        want = reference_scores(classifier_dir, PAIRS)
        assert [t.rewards["preference"] for t in batch] == pytest.approx(want, abs=1e-5)
        assert len({round(w, 4) for w in want}) == len(want)  # distinct: a mix-up would show
        assert metrics["reward/errors"] == 0
        steps = reward.step_metrics()
        assert steps["reward_model/rm/items"] == 6 and steps["reward_model/rm/batches"] == 2  # 4 + 2
        assert steps["reward_model/rm/queue_max"] == 6 and steps["reward_model/rm/busy_s"] > 0
        assert reward.step_metrics()["reward_model/rm/items"] == 0  # counted once
    finally:
        reward.close()


def test_a_model_that_cannot_load_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"reward models \(rm\) failed to load: \w+Error: .*nowhere"):
        CompositeReward.from_config(classifier_config(tmp_path / "nowhere"))


def test_reward_model_references_are_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="uses model 'judge', but reward.models defines rm"):
        RewardConfig(
            models=[RewardModelConfig(name="rm", kind="sequence_classifier", path="x")],
            components=[RewardComponentConfig(name="c", function="model:judge")],
        )
    with pytest.raises(ConfigError, match="needs images_from: the model drawing the images"):
        RewardConfig(models=[RewardModelConfig(name="clip", kind="clip", path="x")])
    with pytest.raises(ConfigError, match="model 'draw' draws images and gives no score"):
        RewardConfig(
            models=[RewardModelConfig(name="draw", kind="scene_renderer")],
            components=[RewardComponentConfig(name="c", function="model:draw")],
        )


def test_a_worker_that_dies_gives_fallbacks_not_a_hang(classifier_dir, caplog):
    config = classifier_config(classifier_dir)
    config.fallback = -1.0
    reward = CompositeReward.from_config(config)
    try:
        reward.models._process.kill()
        reward.models._process.join(timeout=10)
        batch = trajectories(PAIRS[:2])
        with caplog.at_level(logging.WARNING):
            metrics = reward.score(batch)
        assert [t.reward for t in batch] == [-1.0, -1.0]
        assert metrics["reward/errors"] == 2
        assert "the reward-model worker exited" in caplog.text
        later = trajectories(PAIRS[2:4])
        reward.score(later)  # fails at once from now on
        assert [t.reward for t in later] == [-1.0, -1.0]
    finally:
        reward.close()
