"""Importance correction of engine samples (token / sequence / geometric ratios, truncated or
masked) and the mismatch metrics, by hand."""

import math

import pytest
import torch

from grouprl.algorithms import (
    TURN_SUMS,
    aggregate_loss,
    logprob_mismatch,
    policy_loss,
    rollout_correction,
    rollout_is_weights,
    turn_index,
    turn_mismatch_sums,
)

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


def test_kl_and_chi_square_of_the_two_distributions_on_the_sampled_tokens():
    metrics = logprob_mismatch(OLD, ROLLOUT, MASK, threshold=0.25)
    log_w = [0.2, -0.5, 0.0, 0.3, -3.0]  # old - rollout on the loss's tokens
    # KL(pi_rollout || pi_old) from the rollout's own samples: k1 = mean(rollout - old)
    assert float(metrics["kl_k1"]) == pytest.approx(-sum(log_w) / 5, abs=1e-12)  # = 0.6
    assert float(metrics["kl_k3"]) == pytest.approx(sum(math.exp(x) - 1 - x for x in log_w) / 5, abs=1e-12)
    assert float(metrics["chi2_token"]) == pytest.approx(sum(math.exp(2 * x) for x in log_w) / 5 - 1, abs=1e-12)
    # per sequence: row 0 sums 0.2 - 0.5 = -0.3, row 1 sums 0 + 0.3 - 3 = -2.7
    assert float(metrics["chi2_seq"]) == pytest.approx((math.exp(-0.6) + math.exp(-5.4)) / 2 - 1, abs=1e-12)
    exact = logprob_mismatch(OLD, OLD, MASK, threshold=0.25)  # the same numbers: no gap at all
    for name in ("mean", "max", "kl_k1", "kl_k3", "chi2_token", "chi2_seq"):
        assert float(exact[name]) == pytest.approx(0.0, abs=1e-12)


def test_per_turn_sums_split_the_tokens_by_policy_turn():
    sampled = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)  # row 0: turns 1, -, 2
    kept = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)  # what masking left
    sums = turn_mismatch_sums(OLD, ROLLOUT, sampled, kept, max_turns=3)
    assert TURN_SUMS == ("gap", "kl_k1", "kl_k3", "masked", "tokens")
    # old - rollout: row 0 [0.2, -0.5, 0.0], row 1 [0.0, 0.3, -3.0]; turn 1 = 0.2 | 0.0, 0.3; turn 2 = 0.0
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    want = [
        [0.5, -0.5, k3(0.2) + k3(0.0) + k3(0.3), 1.0, 3.0],  # row 1's second token masked
        [0.0, 0.0, 0.0, 1.0, 1.0],  # row 0's last token masked
        [0.0] * 5,  # no third turn
    ]
    torch.testing.assert_close(sums, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_geometric_weights_are_the_capped_mean_log_ratio_per_sequence():
    weights, metrics = rollout_is_weights("geometric", OLD, ROLLOUT, MASK, cap=2.0)
    # row 0: (0.2 - 0.5) / 2 = -0.15; row 1: (0 + 0.3 - 3.0) / 3 = -0.9
    want = torch.tensor([[math.exp(-0.15)] * 3, [math.exp(-0.9)] * 3], dtype=torch.float64)
    torch.testing.assert_close(weights, want, rtol=0, atol=1e-12)
    up, _ = rollout_is_weights("geometric", ROLLOUT, OLD, MASK, cap=2.0)  # e^0.15 = 1.16, e^0.9 = 2.46 -> 2
    torch.testing.assert_close(up[:, 0], torch.tensor([math.exp(0.15), 2.0], dtype=torch.float64))
    # ESS over the two sequences' weights
    a, b = math.exp(-0.15), math.exp(-0.9)
    assert metrics["ess"] == pytest.approx((a + b) ** 2 / (2 * (a * a + b * b)), abs=1e-12)


def test_token_masking_keeps_the_band_and_weights_what_is_kept_by_its_ratio():
    weights, keep, metrics = rollout_correction("token", "mask", OLD, ROLLOUT, MASK, upper=1.25)
    # band [0.8, 1.25]: e^0.2 = 1.221 in, e^-0.5 = 0.607 out, (padding), e^0 in, e^0.3 = 1.350 out, e^-3 out
    torch.testing.assert_close(keep * MASK, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(weights[0, 0], torch.tensor(math.exp(0.2), dtype=torch.float64))  # not capped
    assert metrics["masked_frac"] == pytest.approx(3 / 5)
    assert metrics["masked_seq_frac"] == pytest.approx(1.0)  # both rows lost a token
    assert metrics["mean"] == pytest.approx((math.exp(0.2) + 1.0) / 2, abs=1e-12)
    w = [math.exp(0.2), 1.0]
    assert metrics["ess"] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)), abs=1e-12)
    _, keep_low, _ = rollout_correction("token", "mask", OLD, ROLLOUT, MASK, upper=1.25, lower=0.5)
    torch.testing.assert_close(keep_low * MASK, torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64))


def test_sequence_masking_takes_whole_sequences_out():
    _, keep, metrics = rollout_correction("sequence", "mask", OLD, ROLLOUT, MASK, upper=2.0)
    # band [0.5, 2]: row 0 e^-0.3 = 0.741 stays, row 1 e^-2.7 = 0.067 leaves whole
    torch.testing.assert_close(keep, torch.tensor([[1.0] * 3, [0.0] * 3], dtype=torch.float64))
    assert metrics["masked_frac"] == pytest.approx(3 / 5)
    assert metrics["masked_seq_frac"] == pytest.approx(1 / 2)
    _, keep, _ = rollout_correction("geometric", "mask", OLD, ROLLOUT, MASK, upper=1.2)  # e^-0.15 = 0.861 in
    torch.testing.assert_close(keep, torch.tensor([[1.0] * 3, [0.0] * 3], dtype=torch.float64))


def test_a_masked_token_leaves_the_denominator_not_only_the_numerator():
    """Rejected tokens leave the mask; a zero weight alone would still count them in token-mean."""
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    weights, keep, _ = rollout_correction("token", "mask", OLD, ROLLOUT, MASK, upper=1.25)
    kept = MASK * keep  # 2 tokens: (0, 0) with w = e^0.2 and (1, 0) with w = 1
    loss, _ = policy_loss(
        "ppo", OLD, OLD, advantages, kept, clip_low=0.2, clip_high=0.2, agg_mode="token-mean",
        token_weights=weights,
    )
    # on-policy ratio 1: per-token loss -A w; mean over the 2 kept tokens, not over the 5 sampled
    assert float(loss) == pytest.approx((-1.0 * math.exp(0.2) + 2.0 * 1.0) / 2, abs=1e-12)
    zeroed, _ = policy_loss(
        "ppo", OLD, OLD, advantages, MASK, clip_low=0.2, clip_high=0.2, agg_mode="token-mean",
        token_weights=weights * keep,
    )
    assert float(zeroed) == pytest.approx((-1.0 * math.exp(0.2) + 2.0 * 1.0) / 5, abs=1e-12)  # the bug: / 5


def test_turns_are_the_runs_of_loss_tokens():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0], [0] * 8])
    want = torch.tensor([[1, 1, 0, 0, 2, 0, 3, 3], [0, 1, 1, 1, 0, 0, 0, 0], [0] * 8])
    torch.testing.assert_close(turn_index(mask), want)
    torch.testing.assert_close(turn_index(mask.float()), want)


def test_sum_norm_divides_by_the_given_constant_not_the_batch_width():
    loss_mat = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]], dtype=torch.float64)
    assert float(aggregate_loss(loss_mat, MASK, "seq-mean-token-sum-norm")) == pytest.approx(15.0 / 3)
    assert float(aggregate_loss(loss_mat, MASK, "seq-mean-token-sum-norm", norm_length=40)) == pytest.approx(15.0 / 40)
    # the same rows padded wider: the constant keeps the loss, the width would not
    wide = torch.nn.functional.pad(loss_mat, (0, 5))
    wide_mask = torch.nn.functional.pad(MASK, (0, 5))
    assert float(aggregate_loss(wide, wide_mask, "seq-mean-token-sum-norm", norm_length=40)) == pytest.approx(15.0 / 40)
    assert float(aggregate_loss(loss_mat, MASK, "token-mean", norm_length=40)) == pytest.approx(15.0 / 5)  # unused


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rollout correction level"):
        rollout_is_weights("arithmetic", OLD, ROLLOUT, MASK, cap=2.0)
    with pytest.raises(ValueError, match="rollout correction mode"):
        rollout_correction("token", "clip", OLD, ROLLOUT, MASK, upper=2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        rollout_is_weights("token", OLD, ROLLOUT, MASK, cap=0.0)
    with pytest.raises(ValueError, match="lower bound must be in"):
        rollout_correction("token", "mask", OLD, ROLLOUT, MASK, upper=2.0, lower=2.5)
    with pytest.raises(ValueError, match="rollout_log_probs shape"):
        rollout_is_weights("token", OLD, ROLLOUT[:, :2], MASK, cap=2.0)
