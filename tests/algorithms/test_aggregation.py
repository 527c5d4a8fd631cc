"""Every aggregation mode by hand, including empty rows, empty batches and NaN under the mask."""

import pytest
import torch

from grouprl.algorithms import aggregate_loss

from .reference import ref_aggregate

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

# Row 0: 2 valid tokens, row 1: 4 valid tokens, row 2: fully masked (left out of sequence means).
LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]]
MASK = [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
# valid sum = 1 + 2 + 5 + 6 + 7 + 8 = 29 over 6 tokens; T = 4
EXPECTED = {
    "token-mean": 29.0 / 6.0,
    "seq-mean-token-mean": (1.5 + 6.5) / 2.0,  # row means 3/2 and 26/4; row 2 excluded
    "seq-mean-token-sum": (3.0 + 26.0) / 2.0,  # row sums, mean over the 2 non-empty rows
    "seq-mean-token-sum-norm": 29.0 / 4.0,  # verl: total / T, NOT divided by the number of rows
}
# d loss / d loss_mat at valid tokens, per row (0 at masked tokens)
EXPECTED_GRAD_ROWS = {
    "token-mean": [1 / 6, 1 / 6, 0.0],
    "seq-mean-token-mean": [1 / (2 * 2), 1 / (2 * 4), 0.0],
    "seq-mean-token-sum": [1 / 2, 1 / 2, 0.0],
    "seq-mean-token-sum-norm": [1 / 4, 1 / 4, 0.0],
}


@pytest.mark.parametrize("mode", MODES)
def test_modes_by_hand(mode):
    loss_mat = torch.tensor(LOSS, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float64)
    loss = aggregate_loss(loss_mat, mask, mode)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, torch.tensor(EXPECTED[mode], dtype=torch.float64), rtol=0.0, atol=1e-12)
    loss.backward()
    expected_grad = torch.tensor(EXPECTED_GRAD_ROWS[mode], dtype=torch.float64).unsqueeze(-1) * mask
    torch.testing.assert_close(loss_mat.grad, expected_grad, rtol=0.0, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_bool_mask_and_non_finite_values_under_the_mask(mode):
    loss_mat = torch.tensor(LOSS, dtype=torch.float64)
    loss_mat[0, 3] = float("inf")
    loss_mat[2, :] = float("nan")
    loss_mat.requires_grad_(True)
    mask = torch.tensor(MASK) > 0
    loss = aggregate_loss(loss_mat, mask, mode)
    torch.testing.assert_close(loss, torch.tensor(EXPECTED[mode], dtype=torch.float64), rtol=0.0, atol=1e-12)
    loss.backward()
    assert torch.isfinite(loss_mat.grad).all()
    assert loss_mat.grad[2].abs().sum() == 0 and loss_mat.grad[0, 3] == 0


@pytest.mark.parametrize("mode", MODES)
def test_empty_mask_gives_zero_loss_and_zero_grad(mode):
    loss_mat = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    loss = aggregate_loss(loss_mat, torch.zeros(3, 5), mode)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(loss_mat.grad, torch.zeros(3, 5, dtype=torch.float64))


def test_seq_mean_modes_do_not_count_empty_rows():
    # Adding fully masked rows must not change a sequence mean (it would halve it if counted).
    loss_mat = torch.tensor([[2.0, 4.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    padded = torch.cat([loss_mat, torch.full((3, 2), 100.0, dtype=torch.float64)])
    padded_mask = torch.cat([mask, torch.zeros(3, 2)])
    for mode in ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"]:
        assert aggregate_loss(padded, padded_mask, mode).item() == aggregate_loss(loss_mat, mask, mode).item()
    assert aggregate_loss(padded, padded_mask, "seq-mean-token-mean").item() == 3.0
    assert aggregate_loss(padded, padded_mask, "seq-mean-token-sum").item() == 6.0
    # seq-mean-token-sum-norm depends on T only: 6 / 2
    assert aggregate_loss(padded, padded_mask, "seq-mean-token-sum-norm").item() == 3.0


@pytest.mark.parametrize("mode", MODES)
def test_matches_loop_reference_on_random_inputs(mode):
    gen = torch.Generator().manual_seed(7)
    loss_mat = torch.randn(6, 9, dtype=torch.float64, generator=gen, requires_grad=True)
    lengths = [9, 0, 3, 1, 7, 5]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(9)] for n in lengths], dtype=torch.float64)
    loss = aggregate_loss(loss_mat, mask, mode)
    (grad,) = torch.autograd.grad(loss, loss_mat)
    ref_input = loss_mat.detach().clone().requires_grad_(True)
    ref_loss = ref_aggregate(ref_input, mask, mode)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_input)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="loss_mat shape"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 4), "token-mean")
