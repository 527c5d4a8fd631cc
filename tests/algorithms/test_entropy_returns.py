"""entropy_from_logits and discounted_returns."""

import math
import random

import pytest
import torch

from grouprl.algorithms import discounted_returns, entropy_from_logits

from .reference import ref_discounted_returns, ref_entropy_row

F64 = torch.float64

# ------------------------------------------------------------------------------------ entropy


def test_entropy_by_hand():
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]],  # uniform over 4: ln 4 (shift-invariant)
            [
                [math.log(3.0), 0.0, -math.inf, -math.inf],
                [1e4, 0.0, 0.0, 0.0],
            ],  # p = (3/4, 1/4, 0, 0); near one-hot
        ],
        dtype=F64,
    )
    entropy = entropy_from_logits(logits)
    assert entropy.shape == (2, 2)
    expected = [[math.log(4.0), math.log(4.0)], [-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), 0.0]]
    torch.testing.assert_close(entropy, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)


def test_entropy_with_minus_inf_logits_has_finite_gradient():
    logits = torch.tensor([[[0.3, -0.2, -math.inf]]], dtype=F64, requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 2] == 0.0
    finite = torch.tensor([[[0.3, -0.2]]], dtype=F64, requires_grad=True)
    entropy_from_logits(finite).sum().backward()
    torch.testing.assert_close(logits.grad[..., :2], finite.grad, rtol=0, atol=1e-12)


def test_entropy_matches_reference_and_gradcheck():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 4, 11, dtype=F64, generator=gen) * 3.0).requires_grad_(True)
    entropy = entropy_from_logits(logits)
    expected = [[ref_entropy_row(logits[i, t].tolist()) for t in range(4)] for i in range(3)]
    torch.testing.assert_close(entropy, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)
    # gradient of H w.r.t. logits: -p_v (log p_v + H)
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    log_p = torch.log_softmax(logits.detach(), -1)
    torch.testing.assert_close(
        grad, -log_p.exp() * (log_p + entropy.detach()[..., None]), rtol=1e-10, atol=1e-12
    )
    assert torch.autograd.gradcheck(
        entropy_from_logits, (logits[:1, :2].detach().requires_grad_(True),), eps=1e-6, atol=1e-8
    )


def test_entropy_float32_large_logits_no_overflow():
    logits = torch.tensor([[[1000.0, 999.0, -1000.0]]])
    p = torch.tensor([1.0, math.exp(-1.0)]) / (1.0 + math.exp(-1.0))
    expected = -(p * p.log()).sum()
    torch.testing.assert_close(entropy_from_logits(logits)[0, 0], expected, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- discounted returns


def test_discounted_returns_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 7.0, 2.0], [1.0, 2.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 0]])
    returns = discounted_returns(rewards, 0.5, mask)
    expected = [
        [1.0 + 0.5 * (0.0 + 0.5 * 2.0), 0.0 + 0.5 * 2.0, 2.0],  # 1.5, 1, 2
        [1.0 + 0.5 * 2.0, 0.0, 2.0],  # masked middle turn skipped: no reward, no discount step
        [1.0 + 0.5 * 2.0, 2.0, 0.0],  # trailing padding
    ]
    torch.testing.assert_close(returns, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    # no mask = all steps valid
    torch.testing.assert_close(discounted_returns(rewards[:1], 0.5), returns[:1], rtol=0, atol=0)
    # gamma = 1: suffix sums; gamma = 0: the rewards themselves
    torch.testing.assert_close(
        discounted_returns(rewards, 1.0)[1], torch.tensor([10.0, 9.0, 2.0], dtype=F64), rtol=0, atol=0
    )
    torch.testing.assert_close(discounted_returns(rewards, 0.0, mask), rewards * mask, rtol=0, atol=0)


def test_discounted_returns_matches_reference_and_is_differentiable():
    rng = random.Random(0)
    n, k = 6, 9
    rewards = [[rng.uniform(-1, 1) for _ in range(k)] for _ in range(n)]
    mask = [[rng.random() > 0.3 for _ in range(k)] for _ in range(n)]
    mask[0] = [False] * k
    r = torch.tensor(rewards, dtype=F64, requires_grad=True)
    returns = discounted_returns(r, 0.9, torch.tensor(mask))
    torch.testing.assert_close(
        returns, torch.tensor(ref_discounted_returns(rewards, 0.9, mask), dtype=F64), rtol=1e-12, atol=1e-12
    )
    assert torch.autograd.gradcheck(
        lambda x: discounted_returns(x, 0.9, torch.tensor(mask)), (r,), eps=1e-6, atol=1e-8
    )


def test_discounted_returns_integer_rewards_and_errors():
    assert discounted_returns(torch.tensor([[1, 1]]), 0.5).tolist() == [[1.5, 1.0]]
    with pytest.raises(ValueError, match="gamma must be in"):
        discounted_returns(torch.zeros(1, 2), 1.5)
    with pytest.raises(ValueError, match="mask shape"):
        discounted_returns(torch.zeros(1, 2), 0.5, torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"step_rewards must be \[N, K\]"):
        discounted_returns(torch.zeros(3), 0.5)
