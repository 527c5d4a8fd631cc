"""The training loop with `rollout.engine=vllm` on a tiny Llama (head size 32, which vLLM's CPU
attention supports): it learns, it resumes exactly (the checkpoint's weights pushed into the
engine), it logs the engine-vs-trainer log-prob mismatch, and the truncated importance weights
enter the loss. Runs in the vLLM environment (`-m vllm`)."""

import json

import pytest
import torch
from tiny import A_FRACTION, LOWER_FRACTION, write_run_config

from grouprl.config import load_config
from grouprl.trainer.trainer import Trainer
from helpers import tiny_model_and_tokenizer

pytestmark = pytest.mark.vllm

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
VLLM = [
    "rollout.engine=vllm",
    "rollout.kv_cache_gb=0.25",
    "rollout.enforce_eager=true",
    "rollout.max_model_len=128",
    "actor.dtype=float32",  # both sides in float32 on any CPU, so their log-probs agree closely
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-vllm") / "model"
    tiny_model_and_tokenizer(folder, init_std=0.02, **TINY)
    return folder


def trainer_for(root, model_dir, *overrides, reward=LOWER_FRACTION):
    return Trainer(load_config(write_run_config(root, model_dir, reward=reward), [*VLLM, *overrides]))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_tiny_model_learns_on_vllm_rollouts(tmp_path, model_dir):
    """Reward = fraction of 'a' characters, as the hf engine's learning test: the rollouts come
    from vLLM, whose weights are pushed after every update."""
    trainer = trainer_for(
        tmp_path,
        model_dir,
        "rollout.n_agent=8",
        "rollout.max_response_length=8",
        "actor.optim.lr=2e-2",
        "actor.policy_loss=gspo",
        "trainer.total_steps=16",
        "trainer.save_final=false",
        "trainer.save_best=false",
        reward=A_FRACTION,
    )
    summary = trainer.fit()
    metrics = [m for m in read_jsonl(tmp_path / "runs" / "run" / "metrics.jsonl") if "reward/mean" in m]
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.15
    assert last - first > 0.3, rewards
    assert summary["final"] > summary["baseline"] + 0.3  # greedy evaluation (on vLLM) improved too
    # the engine samples from the weights the trainer has: the two agree to float precision
    assert all(m["rollout/mismatch_max"] < 1e-3 for m in metrics), [m["rollout/mismatch_max"] for m in metrics]
    assert all(m["time/weight_sync"] > 0 for m in metrics)


def test_a_resumed_run_repeats_the_uninterrupted_one(tmp_path, model_dir):
    settings = ["trainer.save_freq=2", "trainer.save_best=false", "trainer.save_final=false"]
    a = trainer_for(tmp_path / "a", model_dir, *settings, "trainer.total_steps=3")
    a.fit()
    b = trainer_for(tmp_path / "b", model_dir, *settings, "trainer.total_steps=2")
    b.fit()
    resumed = trainer_for(tmp_path / "b", model_dir, *settings, "trainer.total_steps=3")
    assert resumed.step == 2
    resumed.fit()

    def records(root):
        return [
            (r["step"], r["uid"], r["response"], round(r["advantage"], 5))
            for r in read_jsonl(root / "runs" / "run" / "rollouts.jsonl")
        ]

    assert records(tmp_path / "b") == records(tmp_path / "a")
    for (name, p), q in zip(a.model.named_parameters(), resumed.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), name


def test_truncated_importance_weights_enter_the_loss(tmp_path, model_dir, monkeypatch):
    """With rollout_is the update receives the capped weights exp(old - rollout) of the step's
    tokens; on the same weights they are 1 up to float noise."""
    trainer = trainer_for(
        tmp_path, model_dir, "algorithm.rollout_is=token", "algorithm.rollout_is_cap=1.5", "trainer.total_steps=1"
    )
    seen = []
    real = trainer.updater.update

    def spy(model, optimizer, scheduler, tensors, *args):
        seen.append(tensors)
        return real(model, optimizer, scheduler, tensors, *args)

    monkeypatch.setattr(trainer.updater, "update", spy)
    metrics, _ = trainer.train_step()
    tensors = seen[0]
    mask = tensors.loss_mask.bool()
    want = torch.exp(tensors.old_log_probs.float() - tensors.rollout_log_probs).clamp(max=1.5)
    torch.testing.assert_close(tensors.is_weights[mask], want[mask])
    assert (tensors.is_weights[mask] - 1).abs().max() < 1e-3
    assert metrics["rollout/is_mean"] == pytest.approx(float(want[mask].mean()), abs=1e-6)
    assert metrics["rollout/is_capped_frac"] == 0.0
