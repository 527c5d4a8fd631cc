"""PPO and GSPO losses: hand-worked values, clip fractions, dual clip, gradients."""

import math

import pytest
import torch

from grouprl.algorithms import policy_loss

F64 = torch.float64
CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def _lp_pair(ratios: list[list[float]]):
    """old_log_probs and log_probs (requires grad) with exp(lp - old) = the given ratios."""
    old = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=F64)
    lp = (old + torch.log(torch.tensor(ratios, dtype=F64))).requires_grad_(True)
    return lp, old


# --------------------------------------------------------------------------------------- PPO
# One row, six tokens: (advantage, ratio) and what each token must do (clip 0.8 .. 1.28, c = 3):
#   t0  A=+1 r=1.5   -> L1=-1.5, L2=-1.28, max = -1.28      clipped (L2 > L1), grad 0
#   t1  A=+1 r=0.5   -> L1=-0.5, L2=-0.8,  max = -0.5       unclipped, grad -A r = -0.5
#   t2  A=-1 r=0.5   -> L1= 0.5, L2= 0.8,  max =  0.8       clipped, grad 0; below c*|A| = 3
#   t3  A=-1 r=5     -> L1= 5,   L2= 1.28, max =  5 -> dual clip min(5, 3) = 3, grad 0
#   t4  A=-2 r=1.1   -> L1= 2.2 = L2 (inside range),  2.2    unclipped, grad -A r = 2.2
#   t5  A=+2 r=1     -> masked out
PPO_ADV = [[1.0, 1.0, -1.0, -1.0, -2.0, 2.0]]
PPO_RATIO = [[1.5, 0.5, 0.5, 5.0, 1.1, 1.0]]
PPO_MASK = [[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]]


def _ppo(dual_clip=3.0, agg_mode="token-mean"):
    lp, old = _lp_pair(PPO_RATIO)
    loss, metrics = policy_loss(
        "ppo", lp, old, torch.tensor(PPO_ADV, dtype=F64), torch.tensor(PPO_MASK, dtype=F64),
        dual_clip=dual_clip, agg_mode=agg_mode, **CLIP,
    )  # fmt: skip
    loss.backward()
    return loss, metrics, lp.grad


def test_ppo_by_hand_with_dual_clip():
    loss, metrics, grad = _ppo()
    # token-mean over 5 valid tokens: (-1.28 - 0.5 + 0.8 + 3 + 2.2) / 5 = 4.22 / 5
    assert loss.item() == pytest.approx(4.22 / 5, abs=1e-12)
    assert metrics["clipfrac"] == pytest.approx(2 / 5, abs=1e-12)  # t0, t2
    assert metrics["clipfrac_lower"] == pytest.approx(1 / 5, abs=1e-12)  # t3
    expected_kl = -sum(math.log(r) for r in PPO_RATIO[0][:5]) / 5  # mean(old - lp)
    assert metrics["ppo_kl"] == pytest.approx(expected_kl, abs=1e-12)
    # d loss / d lp = -A * r / 5 where unclipped; clipped, dual-clipped and masked tokens get 0
    expected_grad = torch.tensor([[0.0, -0.5 / 5, 0.0, 0.0, 2.2 / 5, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected_grad, rtol=0.0, atol=1e-12)
    assert set(metrics) == {"clipfrac", "clipfrac_lower", "ppo_kl"}
    assert all(isinstance(value, float) for value in metrics.values())


def test_ppo_without_dual_clip_leaves_large_negative_ratio_unbounded():
    loss, metrics, grad = _ppo(dual_clip=None)
    # t3 now contributes L1 = 5 (and a gradient -A r / 5 = 5 / 5)
    assert loss.item() == pytest.approx((4.22 - 3.0 + 5.0) / 5, abs=1e-12)
    assert metrics["clipfrac_lower"] == 0.0
    assert metrics["clipfrac"] == pytest.approx(2 / 5, abs=1e-12)
    torch.testing.assert_close(
        grad, torch.tensor([[0.0, -0.1, 0.0, 1.0, 0.44, 0.0]], dtype=F64), rtol=0.0, atol=1e-12
    )


def test_ppo_dual_clip_value_acts_as_bound():
    # c = 6 is above t3's 5, so nothing is dual-clipped
    loss, metrics, _ = _ppo(dual_clip=6.0)
    assert loss.item() == pytest.approx(6.22 / 5, abs=1e-12)
    assert metrics["clipfrac_lower"] == 0.0


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0])
def test_ppo_dual_clip_must_exceed_one(bad):
    with pytest.raises(ValueError, match="dual_clip must be > 1.0"):
        _ppo(dual_clip=bad)


@pytest.mark.parametrize(
    ("agg_mode", "expected"),
    [
        # two rows: row 0 = the hand case above (sum 4.22 over 5 tokens), row 1 fully masked
        ("token-mean", 4.22 / 5),
        ("seq-mean-token-mean", 4.22 / 5),
        ("seq-mean-token-sum", 4.22),
        ("seq-mean-token-sum-norm", 4.22 / 6),
    ],
)
def test_ppo_honours_agg_mode_and_skips_empty_rows(agg_mode, expected):
    lp, old = _lp_pair(PPO_RATIO * 2)
    mask = torch.tensor([PPO_MASK[0], [0.0] * 6], dtype=F64)
    loss, metrics = policy_loss(
        "ppo", lp, old, torch.tensor(PPO_ADV * 2, dtype=F64), mask, agg_mode=agg_mode, **CLIP
    )
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["clipfrac"] == pytest.approx(2 / 5, abs=1e-12)


def test_ppo_log_ratio_clamp_and_ppo_kl_uses_clamped_ratio():
    # lp - old = 25 is clamped to 20 (verl); with A < 0 and no dual clip the loss is exp(20)
    lp = torch.tensor([[25.0]], dtype=F64, requires_grad=True)
    loss, metrics = policy_loss(
        "ppo", lp, torch.zeros(1, 1, dtype=F64), torch.tensor([-1.0], dtype=F64), torch.ones(1, 1),
        dual_clip=None, agg_mode="token-mean", **CLIP,
    )  # fmt: skip
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-12)
    assert metrics["ppo_kl"] == -20.0
    loss.backward()
    assert lp.grad.item() == 0.0  # outside the clamp the ratio is constant


def test_sequence_advantages_broadcast_like_token_advantages():
    gen = torch.Generator().manual_seed(3)
    lp = (torch.randn(4, 6, dtype=F64, generator=gen) * 0.3).requires_grad_(True)
    old = torch.randn(4, 6, dtype=F64, generator=gen) * 0.3
    adv = torch.randn(4, dtype=F64, generator=gen)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).to(F64)
    for mode in ["ppo", "gspo"]:
        a, ma = policy_loss(mode, lp, old, adv, mask, agg_mode="seq-mean-token-mean", **CLIP)
        b, mb = policy_loss(
            mode, lp, old, adv[:, None].expand(4, 6), mask, agg_mode="seq-mean-token-mean", **CLIP
        )
        (ga,) = torch.autograd.grad(a, lp)
        (gb,) = torch.autograd.grad(b, lp)
        assert a.item() == b.item() and ma == mb and torch.equal(ga, gb)


def test_shape_errors():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[N\] or \[N, T\]"):
        policy_loss("ppo", lp, lp, torch.zeros(3), torch.ones(2, 3), agg_mode="token-mean", **CLIP)
    with pytest.raises(ValueError, match="loss_mask shape"):
        policy_loss("ppo", lp, lp, torch.zeros(2), torch.ones(2, 4), agg_mode="token-mean", **CLIP)
    with pytest.raises(ValueError, match="old_log_probs shape"):
        policy_loss(
            "gspo", lp, torch.zeros(3, 3), torch.zeros(2), torch.ones(2, 3), agg_mode="token-mean", **CLIP
        )


def test_old_log_probs_and_advantages_get_no_gradient():
    # on-policy first step: old_log_probs is the same tensor as log_probs
    lp = torch.tensor([[-0.5, -1.5]], dtype=F64, requires_grad=True)
    adv = torch.tensor([2.0], dtype=F64, requires_grad=True)
    loss, metrics = policy_loss("ppo", lp, lp, adv, torch.ones(1, 2), agg_mode="token-mean", **CLIP)
    loss.backward()
    # ratio = 1 everywhere: loss = -A, d loss / d lp_t = -A * 1 / 2
    assert loss.item() == -2.0 and metrics["ppo_kl"] == 0.0 and metrics["clipfrac"] == 0.0
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -1.0]], dtype=F64), rtol=0.0, atol=1e-12)
    assert adv.grad is None


# -------------------------------------------------------------------------------------- GSPO
# row 0: 3 tokens, log-ratios 0.1 0.2 0.3 -> s = e^0.2 = 1.2214 (inside 0.8..1.28), A=+1 -> -s, unclipped
# row 1: 2 tokens, log-ratios 0.5 0.5      -> s = e^0.5 = 1.6487 > 1.28,          A=+1 -> -1.28, clipped
# row 2: 2 tokens, log-ratios -0.6 0.0     -> s = e^-0.3 = 0.7408 < 0.8,           A=-1 -> max(0.74, 0.8) = 0.8, clipped
# The third token of rows 1 and 2 is padding (its log-ratio 9.0 must not leak into s).
GSPO_LOG_RATIO = [[0.1, 0.2, 0.3], [0.5, 0.5, 9.0], [-0.6, 0.0, 9.0]]
GSPO_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
GSPO_ADV = [1.0, 1.0, -1.0]


def _gspo(agg_mode):
    old = torch.full((3, 3), -2.0, dtype=F64)
    lp = (old + torch.tensor(GSPO_LOG_RATIO, dtype=F64)).requires_grad_(True)
    loss, metrics = policy_loss(
        "gspo", lp, old, torch.tensor(GSPO_ADV, dtype=F64), torch.tensor(GSPO_MASK, dtype=F64),
        agg_mode=agg_mode, **CLIP,
    )  # fmt: skip
    loss.backward()
    return loss, metrics, lp.grad


def test_gspo_by_hand_seq_mean_token_mean():
    loss, metrics, grad = _gspo("seq-mean-token-mean")
    s0 = math.exp(0.2)
    assert loss.item() == pytest.approx((-s0 - 1.28 + 0.8) / 3, abs=1e-12)
    assert metrics["clipfrac"] == pytest.approx(4 / 7, abs=1e-12)  # all tokens of rows 1 and 2
    assert metrics["clipfrac_lower"] == 0.0
    expected_kl = -(0.1 + 0.2 + 0.3 + 0.5 + 0.5 - 0.6 + 0.0) / 7
    assert metrics["ppo_kl"] == pytest.approx(expected_kl, abs=1e-12)
    # unclipped row 0: d/d lp_0t = -A s_0 / (|rows| * |y_0|) = -s0 / 9 ; clipped rows: 0
    expected_grad = torch.tensor([[-s0 / 9] * 3, [0.0] * 3, [0.0] * 3], dtype=F64)
    torch.testing.assert_close(grad, expected_grad, rtol=0.0, atol=1e-12)


def test_gspo_honours_token_mean():
    loss, _, grad = _gspo("token-mean")
    s0 = math.exp(0.2)
    assert loss.item() == pytest.approx((-3 * s0 - 2 * 1.28 + 2 * 0.8) / 7, abs=1e-12)
    expected_grad = torch.tensor([[-s0 / 7] * 3, [0.0] * 3, [0.0] * 3], dtype=F64)
    torch.testing.assert_close(grad, expected_grad, rtol=0.0, atol=1e-12)


def test_gspo_log_ratio_cap_at_ten():
    # mean log-ratio 12 is capped at 10; A < 0 so max(-A s, -A clip(s)) = e^10; no gradient through the cap
    lp = torch.full((1, 2), 12.0, dtype=F64, requires_grad=True)
    loss, _ = policy_loss(
        "gspo", lp, torch.zeros(1, 2, dtype=F64), torch.tensor([-1.0], dtype=F64), torch.ones(1, 2),
        agg_mode="seq-mean-token-mean", **CLIP,
    )  # fmt: skip
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-12)
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(1, 2, dtype=F64))


def _sequence_level_objective(lp, old, adv, mask, clip_low, clip_high, weights):
    """GSPO as written in the paper (eq. 5-7), no stop-gradients: s_i = exp(mean_t(lp - old)),
    J = sum_i w_i * min(s_i A_i, clip(s_i) A_i); returns -J."""
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))  # [N]
    per_seq = torch.minimum(s * adv, torch.clamp(s, 1 - clip_low, 1 + clip_high) * adv)  # [N]
    return -(weights * per_seq).sum()


@pytest.mark.parametrize("clip", [(10.0, 10.0), (0.05, 0.05)])  # never clipped / often clipped
def test_gspo_gradient_equals_sequence_level_derivation(clip):
    # For sequence-level advantages, GSPO-token's gradient is the gradient of the sequence objective:
    #   d loss / d lp_it = -A_i s_i / |y_i| * w_i   for unclipped sequences (0 for clipped), with
    #   w_i = 1 / #rows          under seq-mean-token-mean
    #   w_i = |y_i| / #tokens    under token-mean
    gen = torch.Generator().manual_seed(11)
    n, t = 6, 8
    old = torch.randn(n, t, dtype=F64, generator=gen) * 0.5 - 2.0
    lp = (old + torch.randn(n, t, dtype=F64, generator=gen) * 0.2).requires_grad_(True)
    adv = torch.randn(n, dtype=F64, generator=gen)
    lengths = torch.tensor([8, 1, 5, 3, 7, 2])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    clip_low, clip_high = clip
    for agg_mode, weights in [
        ("seq-mean-token-mean", torch.full((n,), 1.0 / n, dtype=F64)),
        ("token-mean", lengths.to(F64) / lengths.sum()),
    ]:
        loss, metrics = policy_loss(
            "gspo", lp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, agg_mode=agg_mode
        )
        (grad,) = torch.autograd.grad(loss, lp)
        reference = _sequence_level_objective(lp, old, adv, mask, clip_low, clip_high, weights)
        (ref_grad,) = torch.autograd.grad(reference, lp)
        torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
        # and the explicit formula
        s = torch.exp(((lp.detach() - old) * mask).sum(-1) / lengths)
        clipped = (adv > 0) & (s > 1 + clip_high) | (adv < 0) & (s < 1 - clip_low)
        explicit = torch.where(clipped, 0.0, -adv * s / lengths * weights)[:, None] * mask
        torch.testing.assert_close(grad, explicit, rtol=1e-12, atol=1e-12)
        assert metrics["clipfrac"] == pytest.approx(
            float((clipped.to(F64) * lengths).sum() / lengths.sum()), abs=1e-12
        )
    if clip == (0.05, 0.05):
        assert 0 < int(clipped.sum()) < n  # the case really mixes clipped and unclipped sequences


@pytest.mark.parametrize("mode", ["ppo", "gspo"])
@pytest.mark.parametrize(
    "agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_gradcheck_float64(mode, agg_mode):
    gen = torch.Generator().manual_seed(5)
    n, t = 4, 5
    old = torch.randn(n, t, dtype=F64, generator=gen) * 0.5 - 1.0
    lp = (old + torch.randn(n, t, dtype=F64, generator=gen) * 0.3).requires_grad_(True)
    adv = torch.randn(n, dtype=F64, generator=gen)
    mask = (torch.arange(t)[None, :] < torch.tensor([5, 3, 0, 2])[:, None]).to(F64)
    # keep every ratio away from the kinks (clip edges, dual-clip bound) so finite differences are valid
    ratio = torch.exp(lp.detach() - old)
    seq_ratio = torch.exp(((lp.detach() - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
    kinks = torch.tensor([0.8, 1.28, 3.0], dtype=F64)
    assert (ratio[..., None] - kinks).abs().min() > 1e-3 and (seq_ratio[..., None] - kinks).abs().min() > 1e-3

    def fn(x):
        return policy_loss(mode, x, old, adv, mask, agg_mode=agg_mode, **CLIP)[0]

    assert torch.autograd.gradcheck(fn, (lp,), eps=1e-6, atol=1e-8, rtol=1e-6)
