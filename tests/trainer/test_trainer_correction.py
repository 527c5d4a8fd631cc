"""The engine-trainer importance correction inside the training loop, on a tiny model: on by
default wherever the engine's numbers can differ from the update's (bf16), off where they
cannot (float32 on the built-in engine), its modes switchable, its metrics logged (per turn
for agents)."""

import pytest
from tiny import LOWER_FRACTION, tiny_model_dir, write_run_config

from grouprl.config import load_config
from grouprl.trainer.trainer import Trainer

MISMATCH_KEYS = [
    "rollout/mismatch_mean",
    "rollout/mismatch_max",
    "rollout/mismatch_above_threshold",
    "rollout/kl_k1",
    "rollout/kl_k3",
    "rollout/chi2_token",
    "rollout/chi2_seq",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def make_trainer(tmp_path, model_dir, *overrides) -> Trainer:
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    return Trainer(load_config(config, ["trainer.total_steps=1", "data.val_files=[]", *overrides]))


def responses(trajectories):
    return [tuple(t.response_ids) for t in trajectories]


def test_bf16_records_the_engines_log_probs_and_corrects_by_default(tmp_path, model_dir):
    trainer = make_trainer(tmp_path / "on", model_dir, "actor.dtype=bfloat16")
    # auto resolved: the engine's bf16 numbers can differ, so it records its log-probs
    assert trainer.parts.learn.updater.rollout_is == "token" and trainer.parts.collect.engine.report_log_probs
    metrics, trajectories, _ = trainer.train_step()
    assert all(t.rollout_log_probs is not None and len(t.rollout_log_probs) == len(t.response_ids) for t in trajectories)
    for key in MISMATCH_KEYS + ["rollout/is_mean", "rollout/is_ess", "rollout/is_capped_frac"]:
        assert key in metrics, key
    assert metrics["rollout/mismatch_mean"] > 0 and metrics["rollout/kl_k3"] >= 0
    assert 0 < metrics["rollout/is_mean"] <= 2.0 and 0 < metrics["rollout/is_ess"] <= 1.0
    # the weights reach the loss: capped at 0.5 (ratios are ~1 here), every token's loss halves
    half = make_trainer(tmp_path / "half", model_dir, "actor.dtype=bfloat16", "algorithm.rollout_is_cap=0.5")
    half_metrics, half_trajectories, _ = half.train_step()
    # off stays possible: the same samples, the metrics still logged, a loss without the weights
    off = make_trainer(tmp_path / "off", model_dir, "actor.dtype=bfloat16", "algorithm.rollout_is=off")
    off_metrics, off_trajectories, _ = off.train_step()
    assert responses(off_trajectories) == responses(half_trajectories) == responses(trajectories)
    assert "rollout/mismatch_mean" in off_metrics and "rollout/is_mean" not in off_metrics
    assert half_metrics["rollout/is_capped_frac"] == pytest.approx(1.0, abs=0.02)
    assert half_metrics["actor/grad_norm"] == pytest.approx(0.5 * off_metrics["actor/grad_norm"], rel=1e-3)
    assert off_metrics["actor/grad_norm"] > 1e-4


def test_float32_on_the_built_in_engine_needs_no_correction(tmp_path, model_dir):
    trainer = make_trainer(tmp_path / "fp32", model_dir, "actor.dtype=float32")
    assert trainer.parts.learn.updater.rollout_is == "off" and not trainer.parts.collect.engine.report_log_probs
    metrics, trajectories, _ = trainer.train_step()
    assert all(t.rollout_log_probs is None for t in trajectories)
    assert not any(k.startswith("rollout/") for k in metrics)
    # asked for, the check shows the engine sampled the trainer's own distribution
    checked = make_trainer(tmp_path / "check", model_dir, "actor.dtype=float32", "rollout.check_log_probs=true")
    metrics, _, _ = checked.train_step()
    assert metrics["rollout/mismatch_max"] < 1e-5 and abs(metrics["rollout/kl_k1"]) < 1e-6
    assert "rollout/is_mean" not in metrics


def test_mask_mode_takes_samples_out_and_says_how_many(tmp_path, model_dir):
    trainer = make_trainer(
        tmp_path, model_dir, "actor.dtype=bfloat16", "algorithm.rollout_is_mode=mask",
        "algorithm.rollout_is_cap=1.00005",  # the tiny model's bf16 gap is ~1e-5 a token
    )
    metrics, _, _ = trainer.train_step()
    assert 0 < metrics["rollout/is_masked_frac"] < 1 and 0 < metrics["rollout/is_masked_seq_frac"] <= 1
    assert "rollout/is_capped_frac" not in metrics
    assert metrics["time/old_ref_log_probs"] > 0  # the old log-probs were needed before the update


def test_the_explicit_levels_reach_the_update(tmp_path, model_dir):
    for level in ("sequence", "geometric"):
        trainer = make_trainer(tmp_path / level, model_dir, "actor.dtype=bfloat16", f"algorithm.rollout_is={level}")
        assert trainer.parts.learn.updater.rollout_is == level
        metrics, _, _ = trainer.train_step()
        assert "rollout/is_ess" in metrics


def test_agents_log_the_gap_per_turn(tmp_path, model_dir, index_dir):
    trainer = make_trainer(
        tmp_path, model_dir, "actor.dtype=bfloat16", "agent.enabled=true", f"agent.retriever.index={index_dir}",
        "agent.max_turns=2", "agent.answer_generator=none", "rollout.max_response_length=8",
        "data.max_prompt_length=2048",
    )
    metrics, trajectories, _ = trainer.train_step()
    assert all(f"rollout/{k}/turn_1" in metrics for k in ("mismatch_mean", "kl_k1", "kl_k3"))
    assert not any("is_masked_frac/turn" in k for k in metrics)  # truncation masks nothing
    second = any(t.loss_mask.count(1) < len(t.loss_mask) and len(t.turns) > 1 for t in trajectories)
    assert ("rollout/mismatch_mean/turn_2" in metrics) == second
    assert "rollout/mismatch_mean/turn_3" not in metrics
    masking = make_trainer(
        tmp_path / "mask", model_dir, "actor.dtype=bfloat16", "agent.enabled=true", f"agent.retriever.index={index_dir}",
        "agent.max_turns=2", "agent.answer_generator=none", "rollout.max_response_length=8",
        "data.max_prompt_length=2048", "algorithm.rollout_is_mode=mask",
    )  # fmt: skip
    metrics, _, _ = masking.train_step()
    assert 0 <= metrics["rollout/is_masked_frac/turn_1"] <= 1


def test_gspo_with_token_mean_warns_at_start(tmp_path, model_dir, caplog):
    with caplog.at_level("WARNING", logger="grouprl.trainer.setup"):
        make_trainer(tmp_path / "a", model_dir, "actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean")
    assert "weighs a sequence by its length" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="grouprl.trainer.setup"):
        make_trainer(tmp_path / "b", model_dir, "actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean")
    assert "weighs a sequence by its length" not in caplog.text


def test_sum_norm_divides_by_the_configured_response_length(tmp_path, model_dir, index_dir):
    sum_norm = ["actor.loss_agg_mode=seq-mean-token-sum-norm", "rollout.max_response_length=12"]
    assert make_trainer(tmp_path / "a", model_dir, *sum_norm).parts.learn.updater.norm_length == 12
    assert make_trainer(tmp_path / "b", model_dir, *sum_norm, "actor.loss_scale_factor=100").parts.learn.updater.norm_length == 100
    agent = ["agent.enabled=true", f"agent.retriever.index={index_dir}", "agent.max_turns=3", "data.max_prompt_length=2048"]
    assert make_trainer(tmp_path / "c", model_dir, *sum_norm, *agent).parts.learn.updater.norm_length == 3 * 12
    budget = make_trainer(tmp_path / "d", model_dir, *sum_norm, *agent, "agent.max_response_tokens=64")
    assert budget.parts.learn.updater.norm_length == 64
    assert make_trainer(tmp_path / "e", model_dir).parts.learn.updater.norm_length is None  # other modes: unused
