"""Vectorised policy losses vs the per-element loop reference (tests/algorithms/reference.py),
values, gradients and metrics in float64, on random inputs with ragged and empty rows."""

import pytest
import torch

from grouprl.algorithms import policy_loss

from .reference import ref_policy_loss, ref_verl_loss

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


# ----------------------------------------------------------------- CISPO, SAPO, GMPO against verl's
def _verl_batch(seed: int, token_advantages: bool, empty_row: bool = False):
    lp, old, adv, mask = _batch(seed, token_advantages)
    if not empty_row:  # verl's geo_mean averages empty rows in as zeros; grouprl leaves them out
        mask[1, :3] = 1.0
    return lp, old, adv, mask


@pytest.mark.parametrize(
    "mode, ours_agg, verl_agg",
    [
        ("cispo", "token-mean", "token-mean"),
        ("cispo", "seq-mean-token-mean", "seq-mean-token-mean"),
        ("cispo", "seq-mean-token-sum", "seq-mean-token-sum"),
        ("sapo", "seq-mean-token-mean", None),  # verl aggregates SAPO this way whatever its mode
        ("gmpo", "seq-mean-token-mean", None),  # and geo_mean as the mean over rows
        ("geo_mean", "seq-mean-token-mean", None),
    ],
)
@pytest.mark.parametrize("token_advantages", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_sapo_gmpo_match_verls_formulas(mode, ours_agg, verl_agg, token_advantages, seed):
    lp, old, adv, mask = _verl_batch(seed, token_advantages)
    clip = {"clip_low": 0.2, "clip_high": 0.28} if mode != "gmpo" and mode != "geo_mean" else {"clip_low": 0.4, "clip_high": 0.4}
    taus = {"tau_pos": 1.0, "tau_neg": 1.05} if seed != 2 else {"tau_pos": 0.7, "tau_neg": 2.0}
    x = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(mode, x, old, adv, mask, agg_mode=ours_agg, **clip, **taus)
    (grad,) = torch.autograd.grad(loss, x)
    x_ref = lp.clone().requires_grad_(True)
    verl_mode = "geo_mean" if mode == "gmpo" else mode
    ref_loss, ref_metrics = ref_verl_loss(verl_mode, x_ref, old, adv, mask, agg_mode=verl_agg or ours_agg, **clip, **taus)
    (ref_grad,) = torch.autograd.grad(ref_loss, x_ref)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)
    for name in ("clipfrac", "clipfrac_lower", "ppo_kl"):
        assert metrics[name] == pytest.approx(ref_metrics[name], abs=1e-10), name
    assert grad.abs().sum() > 0


def test_gmpo_leaves_empty_rows_out_where_verl_counts_them_as_zero():
    lp, old, adv, mask = _verl_batch(0, False, empty_row=True)
    assert (mask.sum(-1) == 0).sum() == 1
    ours, _ = policy_loss("gmpo", lp, old, adv, mask, clip_low=0.4, clip_high=0.4, agg_mode="seq-mean-token-mean")
    verl, _ = ref_verl_loss("geo_mean", lp, old, adv, mask, 0.4, 0.4)
    assert float(ours) == pytest.approx(float(verl) * 5 / 4, rel=1e-12)


def test_the_new_losses_by_hand():
    """One token each, values worked out on paper."""
    lp = torch.tensor([[0.0]], dtype=F64)
    one = torch.ones(1, 1, dtype=F64)
    # CISPO: ratio e^0.5 = 1.6487 clipped to 1.28; loss = -1.28 * A * lp, gradient -1.28 * A
    x = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    loss, m = policy_loss("cispo", x, torch.tensor([[-1.5]], dtype=F64), torch.tensor([2.0], dtype=F64), one,
                          clip_low=0.2, clip_high=0.28, agg_mode="token-mean")  # fmt: skip
    (g,) = torch.autograd.grad(loss, x)
    assert float(loss.detach()) == pytest.approx(-1.28 * 2.0 * -1.0) and float(g) == pytest.approx(-1.28 * 2.0)
    assert m["clipfrac"] == 1.0
    # SAPO at ratio 1: gate 2 / tau with slope 1: loss -A * 2 / tau, gradient -A (the plain policy gradient)
    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss("sapo", x, lp, torch.tensor([-3.0], dtype=F64), one, clip_low=0.2, clip_high=0.28,
                          agg_mode="seq-mean-token-mean", tau_neg=1.05)  # fmt: skip
    (g,) = torch.autograd.grad(loss, x)
    assert float(loss.detach()) == pytest.approx(3.0 * 2 / 1.05) and float(g) == pytest.approx(3.0)
    # GMPO: two tokens with log-ratios 0.1 and 0.9 (the second clipped to 0.4 for A > 0):
    # ratio exp((0.1 + 0.4) / 2), loss -A ratio; the clipped token has no gradient
    x = torch.tensor([[0.1, 0.9]], dtype=F64, requires_grad=True)
    loss, m = policy_loss("gmpo", x, torch.zeros(1, 2, dtype=F64), torch.tensor([1.5], dtype=F64),
                          torch.ones(1, 2, dtype=F64), clip_low=0.4, clip_high=0.4, agg_mode="seq-mean-token-mean")  # fmt: skip
    (g,) = torch.autograd.grad(loss, x)
    ratio = torch.exp(torch.tensor(0.25, dtype=F64))
    assert float(loss.detach()) == pytest.approx(float(-1.5 * ratio))
    assert g.tolist()[0] == pytest.approx([float(-1.5 * ratio / 2), 0.0])
    assert (m["clipfrac"], m["clipfrac_lower"]) == (0.5, 0.0)
