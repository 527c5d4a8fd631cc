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
    for (name, p), q in zip(a.parts.learn.model.named_parameters(), resumed.parts.learn.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), name


def test_truncated_importance_weights_enter_the_loss(tmp_path, model_dir, monkeypatch):
    """With rollout_is the loss receives the capped weights exp(old - rollout) of the step's
    tokens, old being the update's own on-policy log-probs (no extra scoring pass); on the same
    weights they are 1 up to float noise, and the logged metrics are theirs."""
    import grouprl.trainer.update as update

    trainer = trainer_for(
        tmp_path, model_dir, "algorithm.rollout_is=token", "algorithm.rollout_is_cap=1.5", "trainer.total_steps=1",
        "actor.micro_batch_size=8",
    )
    seen, steps = [], []
    real_loss, real_update = update.policy_loss, trainer.parts.learn.updater.update

    def loss_spy(*args, token_weights=None, **kwargs):
        seen.append(token_weights)
        return real_loss(*args, token_weights=token_weights, **kwargs)

    def update_spy(model, optimizer, scheduler, tensors, *args):
        assert tensors.old_log_probs is None  # one epoch, one mini-batch: no scoring pass before
        done = real_update(model, optimizer, scheduler, tensors, *args)
        steps.append((tensors, done.old_log_probs))  # the log-probs the update took as old
        return done

    monkeypatch.setattr(update, "policy_loss", loss_spy)
    monkeypatch.setattr(trainer.parts.learn.updater, "update", update_spy)
    metrics, _, _ = trainer.train_step()
    tensors, old = steps[0]
    assert len(seen) == 1 and seen[0] is not None  # one micro-batch of the whole step
    mask = tensors.loss_mask.bool()
    want = torch.exp(old - tensors.rollout_log_probs).clamp(max=1.5)
    torch.testing.assert_close(seen[0][mask], want[mask])
    assert (seen[0][mask] - 1).abs().max() < 1e-3
    assert metrics["rollout/is_mean"] == pytest.approx(float(want[mask].mean()), abs=1e-6)
    assert metrics["rollout/is_capped_frac"] == 0.0
    assert metrics["rollout/mismatch_max"] < 1e-3


def test_the_search_agent_trains_on_vllm_turns(tmp_path, index_dir):
    """The agent loop inside the training loop on vLLM: turns against a real in-process index,
    observations with loss mask 0 (and no engine log-probs under them), the engine's log-probs of
    the policy's tokens agreeing with the trainer's, and an update; then fit runs on."""
    model_dir = tmp_path / "model"  # room for the protocol prompt: vLLM holds to the model's positions
    tiny_model_and_tokenizer(model_dir, init_std=0.02, max_position_embeddings=4096, **TINY)
    trainer = trainer_for(
        tmp_path,
        model_dir,
        "agent.enabled=true",
        f"agent.retriever.index={index_dir}",
        "agent.max_turns=2",
        "agent.answer_generator=none",
        "rollout.max_response_length=8",
        "rollout.max_model_len=4096",
        "data.max_prompt_length=2048",
        "data.val_files=[]",
        "trainer.save_final=false",
        "trainer.total_steps=2",
    )
    metrics, trajectories, _ = trainer.train_step()
    assert len(trajectories) == 2 * 4 and "actor/pg_loss" in metrics
    assert any(0 in t.loss_mask for t in trajectories)  # observations came back
    for t in trajectories:
        assert len(t.rollout_log_probs) == len(t.response_ids) == len(t.loss_mask)
        for lp, m in zip(t.rollout_log_probs, t.loss_mask):
            assert (lp < 0) if m else (lp == 0.0)
    assert metrics["rollout/mismatch_max"] < 1e-3
    assert metrics["agent/turns_mean"] >= 1
    trainer.fit()
    records = read_jsonl(tmp_path / "runs" / "run" / "rollouts.jsonl")
    assert {r["step"] for r in records} == {2} and all(r["turns"] for r in records)


def test_one_step_off_policy_on_vllm_is_deterministic_and_pushes_between_batches(tmp_path, model_dir, monkeypatch):
    """rollout.max_staleness=1 with vLLM generating: the generation side pushes each version it
    needs into vLLM between batches (the trainer's own weights serve evaluation), batches follow
    the fixed lag, and two runs are the same run: the second with vLLM in an engine of `grouprl
    engine serve` (rollout.engine_address), a process of its own fed the weights over its
    authenticated connection (the loop an engine process beside the trainer runs too, rollout.engine_process: the
    same requests over a pipe instead of TCP, tested with the built-in engine)."""
    from helpers import ENGINE_KEY, start_engine_service

    address, service = start_engine_service(tmp_path / "service.log", devices="cpu")
    monkeypatch.setenv("GROUPRL_ENGINE_KEY", ENGINE_KEY)
    runs, trainers = [], []  # both kept: an in-process engine's teardown ends the groups every engine uses
    try:
        for name, where in (("a", []), ("b", [f"rollout.engine_address={address}"])):
            trainer = trainer_for(
                tmp_path, model_dir, "rollout.max_staleness=1", "rollout.sleep_level=0", "trainer.total_steps=3",
                "trainer.save_best=false", f"trainer.experiment_name={name}", *where,
            )  # fmt: skip
            assert trainer.parts.ahead.engine is not trainer.parts.collect.engine and type(trainer.parts.collect.engine).__name__ == "HFEngine"
            assert type(trainer.parts.ahead.engine).__name__ == ("EngineProcess" if where else "VLLMEngine")
            trainer.fit()
            runs.append(tmp_path / "runs" / name)
            trainers.append(trainer)
    finally:
        service.terminate()
        service.wait(timeout=60)
    for run in runs:
        steps = [m for m in read_jsonl(run / "metrics.jsonl") if "actor/pg_loss" in m]
        assert [m["rollout/policy_version"] for m in steps] == [0, 0, 1]
        assert [m["time/weight_push"] > 1e-3 for m in steps] == [True, False, True]  # version 0 twice: one push
        assert steps[0]["rollout/mismatch_max"] < 1e-3  # vLLM sampled from the weights the update starts from
    records = [[(r["uid"], r["response"], r["version"]) for r in read_jsonl(run / "rollouts.jsonl")] for run in runs]
    assert records[0] == records[1]
