"""KL estimators by hand, including verl's clamps and the straight-through '+' variants."""

import math

import pytest
import torch

from grouprl.algorithms import kl_estimate

from .reference import ref_kl

F64 = torch.float64
# x = lp - ref = [0.5, -1.0, 0.0, -29.0, 25.0, 5.0]
LP = [[-1.0, -2.0, -0.5, -30.0, 24.0, 4.0]]
REF = [[-1.5, -1.0, -0.5, -1.0, -1.0, -1.0]]
X = [0.5, -1.0, 0.0, -29.0, 25.0, 5.0]

EXPECTED = {
    "k1": X,
    "abs": [0.5, 1.0, 0.0, 29.0, 25.0, 5.0],
    "k2": [0.125, 0.5, 0.0, 420.5, 312.5, 12.5],
    # k3 with d = ref - lp = -x, clamped to [-20, 20]; value e^d - d - 1 clamped to [-10, 10]:
    #   d=-0.5: e^-0.5 - 0.5 ... = e^-0.5 + 0.5 - 1 ; d=1: e - 2 ; d=0: 0 ;
    #   d=29 -> 20: e^20 - 21 -> 10 ; d=-25 -> -20: e^-20 + 19 -> 10 ; d=-5: e^-5 + 4
    "k3": [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0, 10.0, 10.0, math.exp(-5.0) + 4.0],
}
# d/d lp of k3 = 1 - e^d inside the clamps, 0 where either clamp is active
K3_GRAD = [1 - math.exp(-0.5), 1 - math.e, 0.0, 0.0, 0.0, 1 - math.exp(-5.0)]
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _run(kind):
    lp = torch.tensor(LP, dtype=F64, requires_grad=True)
    out = kl_estimate(lp, torch.tensor(REF, dtype=F64), kind)
    out.sum().backward()
    return out, lp.grad[0]


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_values_by_hand(kind):
    out, _ = _run(kind)
    assert out.shape == (1, 6)
    expected = EXPECTED[ALIASES.get(kind, kind)]
    torch.testing.assert_close(out[0], torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)


def test_gradients_by_hand():
    grads = {kind: _run(kind)[1] for kind in ["k1", "abs", "k2", "k3"]}
    torch.testing.assert_close(grads["k1"], torch.ones(6, dtype=F64), rtol=0, atol=0)
    # sign(x); at x = 0 torch's abs has subgradient 0
    torch.testing.assert_close(
        grads["abs"], torch.tensor([1.0, -1.0, 0.0, -1.0, 1.0, 1.0], dtype=F64), rtol=0, atol=0
    )
    torch.testing.assert_close(grads["k2"], torch.tensor(X, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(grads["k3"], torch.tensor(K3_GRAD, dtype=F64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+"])
def test_straight_through_plus_variants_have_base_value_and_k2_gradient(kind):
    out, grad = _run(kind)
    base = kind[:-1]
    torch.testing.assert_close(
        out[0], torch.tensor(EXPECTED[ALIASES.get(base, base)], dtype=F64), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(grad, torch.tensor(X, dtype=F64), rtol=0, atol=1e-12)  # k2's gradient, x


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "k3+", "abs+"])
def test_matches_per_element_reference_and_gradcheck(kind):
    gen = torch.Generator().manual_seed(2)
    lp = (torch.randn(3, 4, dtype=F64, generator=gen) - 1.0).requires_grad_(True)
    ref = torch.randn(3, 4, dtype=F64, generator=gen) - 1.0
    out = kl_estimate(lp, ref, kind)
    (grad,) = torch.autograd.grad(out.sum(), lp)
    lp_ref = lp.detach().clone().requires_grad_(True)
    ref_out = torch.stack(
        [torch.stack([ref_kl(lp_ref[i, t], float(ref[i, t]), kind) for t in range(4)]) for i in range(3)]
    )
    (ref_grad,) = torch.autograd.grad(ref_out.sum(), lp_ref)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    if not kind.endswith("+"):  # '+' variants deliberately differ from the derivative of their value
        assert (lp.detach() - ref).abs().min() > 1e-3  # away from abs's kink
        assert torch.autograd.gradcheck(lambda x: kl_estimate(x, ref, kind), (lp,), eps=1e-6, atol=1e-8)


def test_k3_is_nonnegative_and_k1_k3_agree_to_second_order():
    x = torch.linspace(-3.0, 3.0, 61, dtype=F64)[None, :]
    k3 = kl_estimate(x, torch.zeros_like(x), "k3")
    assert (k3 >= 0).all()
    # for small x: k3 = e^-x + x - 1 = x^2/2 - x^3/6 + O(x^4) = k2 - x^3/6 + ...
    small = torch.tensor([[1e-3]], dtype=F64)
    assert kl_estimate(small, torch.zeros_like(small), "k3").item() == pytest.approx(
        0.5e-6 - 1e-9 / 6, rel=1e-6
    )


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="ref_log_probs shape"):
        kl_estimate(torch.zeros(2, 3), torch.zeros(2, 4), "k1")
