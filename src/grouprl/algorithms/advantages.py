"""Outcome-reward advantage estimators (one scalar reward per sampled response).

Every estimator has the signature
    fn(rewards [N] float, group_index [N] long in 0..G-1, *, norm_by_std, epsilon) -> [N]
where `group_index` is the dense group number of each sample (built from arbitrary
hashable group ids by `group_index_from_ids`). Groups need not be contiguous.

Conventions follow verl `core_algos.py` (`compute_grpo_outcome_advantage`,
`compute_rloo_outcome_advantage`), including its singleton-group fallbacks.
Advantages are constants for the policy gradient, so they are computed without
autograd (as verl does under `torch.no_grad`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def group_index_from_ids(group_ids: Sequence[Hashable] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Map arbitrary hashable group ids to dense indices 0..G-1 (first-appearance order). -> [N] long"""
    if isinstance(group_ids, torch.Tensor):
        _, inverse = torch.unique(group_ids.reshape(-1), return_inverse=True)
        return inverse.to(device)
    dense: dict[Hashable, int] = {}
    # One dict lookup per sample; all arithmetic below is vectorised.
    index = [dense.setdefault(group_id, len(dense)) for group_id in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device)


def _group_sums(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """sum of `values` [N] within each group -> [G]"""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, group_index, values
    )


def _group_stats(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean, unbiased group std), each [N].

    Two-pass (mean first, then squared deviations) for the same accuracy as torch.std.
    Singleton groups get mean 0 and std 1 (verl's fallback: the unbiased std of one
    value is undefined).
    """
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() > 0 else 0
    counts = _group_sums(torch.ones_like(rewards), group_index, num_groups)  # [G]
    means = _group_sums(rewards, group_index, num_groups) / counts.clamp(min=1.0)  # [G]
    squared_dev = (rewards - means[group_index]) ** 2  # [N]
    variances = _group_sums(squared_dev, group_index, num_groups) / (counts - 1.0).clamp(min=1.0)  # [G]
    stds = variances.sqrt()  # [G]
    singleton = counts <= 1.0  # [G]
    means = torch.where(singleton, torch.zeros_like(means), means)
    stds = torch.where(singleton, torch.ones_like(stds), stds)
    return counts[group_index], means[group_index], stds[group_index]


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, *, norm_by_std: bool, epsilon: float
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, arXiv 2402.03300, eq. for outcome supervision):
        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)      std: unbiased (n - 1)
    norm_by_std=False gives Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): A_i = r_i - mean_g(r).
    Singleton group: mean 0, std 1, i.e. A = r / (1 + eps) (or r unnormalised)."""
    _, group_mean, group_std = _group_stats(rewards, group_index)  # [N] each
    centered = rewards - group_mean  # [N]
    return centered / (group_std + epsilon) if norm_by_std else centered


@torch.no_grad()
def grpo_batch_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, *, norm_by_std: bool, epsilon: float
) -> torch.Tensor:
    """GRPO statistics over the whole batch instead of per group:
        A_i = (r_i - mean(r)) / (std(r) + eps)   (or r_i - mean(r) without std)
    i.e. the grpo estimator with every sample in one group (group ids ignored). A batch
    of one sample follows the singleton convention (mean 0, std 1)."""
    return grpo_advantages(rewards, torch.zeros_like(group_index), norm_by_std=norm_by_std, epsilon=epsilon)


@torch.no_grad()
def rloo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, *, norm_by_std: bool, epsilon: float
) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740; Kool et al. 2019), leave-one-out baseline:
        A_i = r_i - 1/(n-1) sum_{j != i} r_j = n/(n-1) * (r_i - mean_g(r))
    Singleton group (n = 1): no baseline exists; as in verl's loop implementation
    (`compute_rloo_outcome_advantage`) the reward is returned unchanged, A = r.
    `norm_by_std` and `epsilon` do not apply to RLOO and are ignored."""
    del norm_by_std, epsilon
    group_size, group_mean, _ = _group_stats(rewards, group_index)  # [N] each; singleton mean = 0
    scale = torch.where(
        group_size > 1.0, group_size / (group_size - 1.0).clamp(min=1.0), torch.ones_like(group_size)
    )
    return scale * (rewards - group_mean)
