"""The registry is the single source of algorithm names; unknown names fail loudly."""

import pytest
import torch

import grouprl.algorithms as algorithms
from grouprl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate_loss,
    available,
    compute_advantages,
    kl_estimate,
    policy_loss,
    registry,
)


def test_public_api_is_exactly_the_documented_names():
    assert sorted(algorithms.__all__) == sorted(
        [
            "compute_advantages",
            "policy_loss",
            "aggregate_loss",
            "kl_estimate",
            "entropy_from_logits",
            "discounted_returns",
            "ADVANTAGE_ESTIMATORS",
            "POLICY_LOSSES",
            "AGG_MODES",
            "KL_ESTIMATORS",
            "ROLLOUT_CORRECTIONS",
            "ROLLOUT_CORRECTION_MODES",
            "available",
            "rollout_correction",
            "rollout_is_weights",
            "logprob_mismatch",
            "turn_index",
            "turn_mismatch_sums",
            "TURN_SUMS",
        ]
    )
    for name in algorithms.__all__:
        assert hasattr(algorithms, name)


def test_registered_names():
    assert available("advantage_estimator") == ["grpo", "grpo_batch", "rloo"]
    assert available("policy_loss") == ["cispo", "geo_mean", "gmpo", "gspo", "ppo", "sapo", "vanilla"]
    assert available("agg_mode") == [
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
    ]
    assert available("kl_estimator") == [
        "abs", "abs+", "k1", "k1+", "k2", "k3", "k3+", "kl", "kl+", "low_var_kl", "low_var_kl+", "mse",
    ]  # fmt: skip
    assert sorted(ADVANTAGE_ESTIMATORS) == available("advantage_estimator")
    assert sorted(POLICY_LOSSES) == available("policy_loss")
    assert sorted(AGG_MODES) == available("agg_mode")
    assert sorted(KL_ESTIMATORS) == available("kl_estimator")
    assert available("rollout_correction") == ["geometric", "sequence", "token"]
    assert available("rollout_correction_mode") == ["mask", "truncate"]
    # verl's aliases resolve to the same function
    assert KL_ESTIMATORS["kl"] is KL_ESTIMATORS["k1"]
    assert POLICY_LOSSES["vanilla"] is POLICY_LOSSES["ppo"] and POLICY_LOSSES["geo_mean"] is POLICY_LOSSES["gmpo"]
    assert KL_ESTIMATORS["mse"] is KL_ESTIMATORS["k2"]
    assert KL_ESTIMATORS["low_var_kl"] is KL_ESTIMATORS["k3"]
    assert KL_ESTIMATORS["low_var_kl+"] is KL_ESTIMATORS["k3+"]


def test_unknown_advantage_estimator_message_lists_allowed_names():
    with pytest.raises(ValueError) as excinfo:
        compute_advantages("gpro", torch.tensor([1.0, 2.0]), [0, 0])
    assert str(excinfo.value) == "unknown advantage estimator 'gpro'; allowed: grpo, grpo_batch, rloo"


def test_unknown_policy_loss_and_agg_mode():
    lp = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"unknown policy loss 'gpso'; allowed: cispo, geo_mean, gmpo, gspo, ppo, sapo, vanilla$"):
        policy_loss("gpso", lp, lp, torch.zeros(1), mask, clip_low=0.2, clip_high=0.2, agg_mode="token-mean")
    with pytest.raises(
        ValueError, match=r"unknown loss aggregation mode 'token_mean'; allowed: seq-mean-token-mean, "
    ):
        policy_loss("ppo", lp, lp, torch.zeros(1), mask, clip_low=0.2, clip_high=0.2, agg_mode="token_mean")
    with pytest.raises(ValueError, match=r"unknown loss aggregation mode 'sum'"):
        aggregate_loss(lp, mask, "sum")


def test_unknown_kl_estimator_and_kind():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; allowed: abs, abs\+, k1, "):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k2\+'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k2+")
    with pytest.raises(
        ValueError, match=r"unknown algorithm kind 'advantage'; allowed: advantage_estimator, agg_mode"
    ):
        available("advantage")


def test_public_functions_dispatch_through_the_registry_dicts(monkeypatch):
    # A name added to the dict is immediately usable through the public function,
    # so no caller can bypass the registry.
    monkeypatch.setitem(AGG_MODES, "first-token", lambda loss_mat, loss_mask: loss_mat[0, 0])
    assert aggregate_loss(torch.tensor([[7.0, 1.0]]), torch.ones(1, 2), "first-token").item() == 7.0
    assert "first-token" in available("agg_mode")
    monkeypatch.setitem(KL_ESTIMATORS, "zero", lambda lp, ref: torch.zeros_like(lp))
    assert kl_estimate(torch.ones(1, 2), torch.zeros(1, 2), "zero").abs().sum().item() == 0.0
    assert registry.lookup("kl_estimator", "zero") is KL_ESTIMATORS["zero"]
