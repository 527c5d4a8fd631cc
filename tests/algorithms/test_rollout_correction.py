"""Truncated importance sampling of engine samples and the mismatch metrics, by hand."""

import math

import pytest
import torch

from grouprl.algorithms import logprob_mismatch, policy_loss, rollout_is_weights

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0]], dtype=torch.float64)
ROLLOUT = torch.tensor([[-1.2, -1.5, -0.5], [-0.3, -0.4, -1.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)


def test_token_weights_are_the_capped_ratio_of_each_token():
    weights, metrics = rollout_is_weights("token", OLD, ROLLOUT, MASK, cap=1.2)
    # exp(old - rollout): e^0.2 = 1.2214 -> 1.2 (capped), e^-0.5, e^0 (masked, unused), e^0, e^0.3 -> 1.2, e^-3
    want = torch.tensor(
        [[1.2, math.exp(-0.5), 1.0], [1.0, 1.2, math.exp(-3.0)]], dtype=torch.float64
    )
    torch.testing.assert_close(weights, want, rtol=0, atol=1e-12)
    in_loss = [1.2, math.exp(-0.5), 1.0, 1.2, math.exp(-3.0)]
    assert metrics["mean"] == pytest.approx(sum(in_loss) / 5, abs=1e-12)
    assert metrics["capped_frac"] == pytest.approx(2 / 5)


def test_sequence_weights_are_the_capped_product_over_the_loss_tokens():
    weights, metrics = rollout_is_weights("sequence", OLD, ROLLOUT, MASK, cap=2.0)
    # row 0: 0.2 - 0.5 (the third token is masked) = -0.3; row 1: 0 + 0.3 - 3.0 = -2.7
    want = torch.tensor([[math.exp(-0.3)] * 3, [math.exp(-2.7)] * 3], dtype=torch.float64)
    torch.testing.assert_close(weights, want, rtol=0, atol=1e-12)
    assert metrics["capped_frac"] == 0.0
    capped, metrics = rollout_is_weights("sequence", ROLLOUT, OLD, MASK, cap=2.0)  # e^0.3, e^2.7 -> 2
    torch.testing.assert_close(capped[1], torch.full((3,), 2.0, dtype=torch.float64))
    assert metrics["capped_frac"] == pytest.approx(3 / 5)


def test_weights_scale_each_tokens_loss_and_are_constants_for_the_gradient():
    log_probs = OLD.clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    weights, _ = rollout_is_weights("token", OLD, ROLLOUT, MASK, cap=1.2)
    loss, _ = policy_loss(
        "ppo", log_probs, OLD, advantages, MASK, clip_low=0.2, clip_high=0.2, agg_mode="token-mean",
        token_weights=weights,
    )
    # on-policy ratio 1: L = sum_t m w (-A r) / sum m, dL/dlp_t = -A w m / sum m
    a = advantages[:, None].expand_as(MASK)
    assert float(loss.detach()) == pytest.approx(float((-a * weights * MASK).sum() / 5), abs=1e-12)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, -a * weights * MASK / 5, rtol=0, atol=1e-12)
    plain, _ = policy_loss("ppo", OLD, OLD, advantages, MASK, clip_low=0.2, clip_high=0.2, agg_mode="token-mean")
    assert float(plain) == pytest.approx(float((-a * MASK).sum() / 5), abs=1e-12)


def test_mismatch_is_measured_over_the_loss_tokens_only():
    metrics = logprob_mismatch(OLD, ROLLOUT, MASK, threshold=0.25)
    # |diff| in the loss: 0.2, 0.5, 0, 0.3, 3.0 (the masked 0.0 is left out)
    assert float(metrics["mean"]) == pytest.approx(4.0 / 5, abs=1e-12)
    assert float(metrics["max"]) == pytest.approx(3.0, abs=1e-12)
    assert float(metrics["above_threshold"]) == pytest.approx(3 / 5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rollout correction level"):
        rollout_is_weights("geometric", OLD, ROLLOUT, MASK, cap=2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        rollout_is_weights("token", OLD, ROLLOUT, MASK, cap=0.0)
    with pytest.raises(ValueError, match="rollout_log_probs shape"):
        rollout_is_weights("token", OLD, ROLLOUT[:, :2], MASK, cap=2.0)
