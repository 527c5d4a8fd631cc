"""Vectorised policy losses vs the per-element loop reference (tests/algorithms/reference.py),
values, gradients and metrics in float64, on random inputs with ragged and empty rows."""

import pytest
import torch

from grouprl.algorithms import policy_loss

from .reference import ref_policy_loss

F64 = torch.float64
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _batch(seed: int, token_advantages: bool):
    gen = torch.Generator().manual_seed(seed)
    n, t = 5, 7
    old = torch.randn(n, t, dtype=F64, generator=gen) - 1.0
    # wide spread of log-ratios so that every branch (clip low/high, dual clip) occurs
    lp = old + torch.randn(n, t, dtype=F64, generator=gen) * 0.8
    adv = torch.randn((n, t) if token_advantages else (n,), dtype=F64, generator=gen)
    lengths = torch.tensor([7, 0, 4, 1, 6])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    mask[0, 3] = 0.0  # a hole inside a row
    return lp, old, adv, mask


@pytest.mark.parametrize("mode", ["ppo", "gspo"])
@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("dual_clip", [3.0, None, 1.5])
@pytest.mark.parametrize("token_advantages", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_matches_loop_reference(mode, agg_mode, dual_clip, token_advantages, seed):
    lp, old, adv, mask = _batch(seed, token_advantages)
    clip = {"clip_low": 0.2, "clip_high": 0.28}
    x = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(mode, x, old, adv, mask, dual_clip=dual_clip, agg_mode=agg_mode, **clip)
    (grad,) = torch.autograd.grad(loss, x)
    x_ref = lp.clone().requires_grad_(True)
    ref_loss, ref_metrics = ref_policy_loss(
        mode, x_ref, old, adv, mask, clip["clip_low"], clip["clip_high"], dual_clip, agg_mode
    )
    (ref_grad,) = torch.autograd.grad(ref_loss, x_ref)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)
    assert metrics.keys() == ref_metrics.keys()
    for name in metrics:
        assert metrics[name] == pytest.approx(ref_metrics[name], abs=1e-10), name


def test_reference_batches_exercise_every_ppo_branch():
    # guards the test above against silently testing only the unclipped branch
    lp, old, adv, mask = _batch(0, token_advantages=True)
    ratio = torch.exp(lp - old)
    valid = mask > 0
    assert ((adv > 0) & (ratio > 1.28) & valid).any()
    assert ((adv < 0) & (ratio < 0.8) & valid).any()
    assert ((adv < 0) & (ratio > 3.0) & valid).any()
    assert ((ratio > 0.8) & (ratio < 1.28) & valid).any()
    _, metrics = policy_loss("gspo", lp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg_mode="token-mean")
    assert 0.0 < metrics["clipfrac"] < 1.0


def test_ppo_gradient_is_zero_exactly_on_clipped_tokens():
    lp, old, adv, mask = _batch(1, token_advantages=True)
    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(
        "ppo", x, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg_mode="seq-mean-token-sum"
    )
    (grad,) = torch.autograd.grad(loss, x)
    ratio = torch.exp(lp - old)
    clipped = (adv > 0) & (ratio > 1.28) | (adv < 0) & (ratio < 0.8) | (adv < 0) & (ratio > 3.0)
    non_empty_rows = int((mask.sum(-1) > 0).sum())
    # unclipped: d/d lp of (-A r) summed per row, averaged over non-empty rows
    expected = torch.where(clipped, 0.0, -adv * ratio) * mask / non_empty_rows
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    assert (clipped & (mask > 0)).any() and (~clipped & (mask > 0)).any()
