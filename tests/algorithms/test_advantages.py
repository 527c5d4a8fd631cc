"""Advantage estimators: hand-worked values, singleton groups, shuffled groups vs a loop reference."""

import math
import random

import pytest
import torch

from grouprl.algorithms import compute_advantages

from .reference import ref_advantages

EPS = 1e-6


def _close(actual: torch.Tensor, expected: list[float], atol: float = 1e-12):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0.0, atol=atol)


def test_grpo_single_group_by_hand():
    # r = [1, 0, 1, 1]: mean 0.75; unbiased var = (3 * 0.25^2 + 0.75^2) / 3 = 0.25, std 0.5
    adv = compute_advantages("grpo", torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), ["p"] * 4)
    s = 0.5 + EPS
    _close(adv, [0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s])


def test_grpo_interleaved_groups_and_singleton_by_hand():
    rewards = torch.tensor([2.0, 5.0, 4.0, 7.0, 3.0], dtype=torch.float64)
    ids = ["q1", "q2", "q1", "q2", "solo"]
    # q1 = {2, 4}: mean 3, unbiased std sqrt(2); q2 = {5, 7}: mean 6, std sqrt(2);
    # solo: mean 0, std 1 -> 3 / (1 + eps)
    s = math.sqrt(2.0) + EPS
    _close(compute_advantages("grpo", rewards, ids), [-1 / s, -1 / s, 1 / s, 1 / s, 3 / (1 + EPS)])
    # Dr. GRPO: no std division; singleton keeps its raw reward (mean 0)
    _close(compute_advantages("grpo", rewards, ids, norm_by_std=False), [-1.0, -1.0, 1.0, 1.0, 3.0])
    # epsilon is honoured
    s = math.sqrt(2.0) + 0.5
    _close(compute_advantages("grpo", rewards, ids, epsilon=0.5), [-1 / s, -1 / s, 1 / s, 1 / s, 3 / 1.5])


def test_grpo_identical_rewards_give_zero_not_nan():
    adv = compute_advantages("grpo", torch.tensor([0.7, 0.7, 0.7]), [1, 1, 1])
    assert torch.equal(adv, torch.zeros(3))


def test_rloo_by_hand():
    rewards = torch.tensor([1.0, 2.0, 6.0, 2.0, 5.0, 4.0, 7.0, 3.0], dtype=torch.float64)
    ids = [0, 0, 0, "b", "b", 9, 9, ("t", 1)]
    # group 0 = {1, 2, 6}: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5
    # group b = {2, 5}: -3, 3 ; group 9 = {4, 7}: -3, 3 ; singleton ("t", 1): reward unchanged (verl)
    _close(compute_advantages("rloo", rewards, ids), [-3.0, -1.5, 4.5, -3.0, 3.0, -3.0, 3.0, 3.0])
    # norm_by_std / epsilon do not apply to RLOO
    _close(
        compute_advantages("rloo", rewards, ids, norm_by_std=False, epsilon=0.3),
        [-3.0, -1.5, 4.5, -3.0, 3.0, -3.0, 3.0, 3.0],
    )


def test_grpo_batch_by_hand_ignores_groups():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    # batch mean 2.5; unbiased var = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3
    s = math.sqrt(5.0 / 3.0) + EPS
    expected = [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s]
    _close(compute_advantages("grpo_batch", rewards, ["a", "b", "a", "c"]), expected)
    _close(compute_advantages("grpo_batch", rewards, [0, 1, 2, 3]), expected)
    _close(compute_advantages("grpo_batch", rewards, [0, 1, 2, 3], norm_by_std=False), [-1.5, -0.5, 0.5, 1.5])
    # one sample: the singleton convention, mean 0 and std 1
    _close(
        compute_advantages("grpo_batch", torch.tensor([2.0], dtype=torch.float64), ["x"]), [2.0 / (1 + EPS)]
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_singleton_group_alone(estimator):
    adv = compute_advantages(estimator, torch.tensor([0.8], dtype=torch.float64), [42])
    _close(adv, [0.8 / (1 + EPS)] if estimator == "grpo" else [0.8])


def _random_batch(seed: int):
    rng = random.Random(seed)
    ids, rewards = [], []
    sizes = [1, 1, 2, 3, 4, 5, 8]  # includes singletons
    for g, size in enumerate(sizes):
        for _ in range(size):
            ids.append(f"prompt-{g}")
            rewards.append(rng.choice([0.0, 1.0, rng.uniform(-2.0, 2.0)]))
    order = list(range(len(ids)))
    rng.shuffle(order)  # groups interleaved, non-contiguous
    return [rewards[i] for i in order], [ids[i] for i in order]


@pytest.mark.parametrize("estimator", ["grpo", "grpo_batch", "rloo"])
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_matches_loop_reference_on_shuffled_groups(estimator, norm_by_std, seed):
    rewards, ids = _random_batch(seed)
    adv = compute_advantages(
        estimator, torch.tensor(rewards, dtype=torch.float64), ids, norm_by_std=norm_by_std
    )
    _close(adv, ref_advantages(estimator, rewards, ids, norm_by_std, EPS), atol=1e-10)
    # float32 input stays float32 and agrees to float32 precision
    adv32 = compute_advantages(
        estimator, torch.tensor(rewards, dtype=torch.float32), ids, norm_by_std=norm_by_std
    )
    assert adv32.dtype == torch.float32
    torch.testing.assert_close(adv32.double(), adv, rtol=1e-5, atol=1e-5)


def test_permuting_samples_permutes_advantages():
    rewards, ids = _random_batch(3)
    base = compute_advantages("grpo", torch.tensor(rewards, dtype=torch.float64), ids)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    permuted = compute_advantages(
        "grpo", torch.tensor(rewards, dtype=torch.float64)[perm], [ids[i] for i in perm]
    )
    torch.testing.assert_close(permuted, base[perm], rtol=0.0, atol=1e-12)


def test_group_id_kinds_are_equivalent():
    rewards = torch.tensor([1.0, 0.0, 0.5, 3.0, 1.0], dtype=torch.float64)
    by_str = compute_advantages("grpo", rewards, ["b", "a", "b", "a", "c"])
    by_int = compute_advantages("grpo", rewards, [10, 3, 10, 3, 7])
    by_tensor = compute_advantages("grpo", rewards, torch.tensor([10, 3, 10, 3, 7]))
    by_tuple = compute_advantages("grpo", rewards, (("x", 1), ("y", 2), ("x", 1), ("y", 2), ("z", 3)))
    assert torch.equal(by_str, by_int) and torch.equal(by_str, by_tensor) and torch.equal(by_str, by_tuple)


def test_integer_rewards_become_float_and_output_is_detached():
    adv = compute_advantages("grpo", torch.tensor([1, 0, 1, 0]), [0, 0, 0, 0])
    assert adv.dtype == torch.get_default_dtype()
    s = math.sqrt(1.0 / 3.0) + EPS  # mean 0.5, unbiased var = 4 * 0.25 / 3
    torch.testing.assert_close(adv, torch.tensor([0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s]), rtol=0.0, atol=1e-6)
    rewards = torch.tensor([1.0, 2.0], requires_grad=True)
    assert not compute_advantages("rloo", rewards, [0, 0]).requires_grad


def test_shape_errors():
    with pytest.raises(ValueError, match="3 group ids for 2 rewards"):
        compute_advantages("grpo", torch.tensor([1.0, 2.0]), [0, 0, 1])
    with pytest.raises(ValueError, match=r"rewards must be a 1-d tensor \[N\]"):
        compute_advantages("grpo", torch.ones(2, 3), [0, 1])
