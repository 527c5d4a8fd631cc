"""Discounted returns over per-step (per-turn) rewards, for multi-turn agents."""

from __future__ import annotations

import torch


def discounted_returns(
    step_rewards: torch.Tensor, gamma: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """G_k = r_k + gamma * G_{k'} where k' is the next *valid* step after k (Sutton & Barto eq. 3.9).

    step_rewards [N, K], mask [N, K] (bool/0-1; None = all steps valid) -> returns [N, K].

    Choice for masked steps (documented because it matters for turns in the middle):
    a masked step is *skipped*: its reward is ignored, it consumes no discount factor,
    it does not cut the chain, and its own return is 0. So the returns of the valid
    steps equal the plain discounted returns of the sequence with the masked steps
    deleted. For trailing padding (the usual case) this is identical to verl's
    REINFORCE++ returns, which instead *reset* the running return at masked steps;
    the two differ only for masked steps followed by valid ones.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if step_rewards.dim() != 2:
        raise ValueError(f"step_rewards must be [N, K], got shape {tuple(step_rewards.shape)}")
    if not step_rewards.is_floating_point():
        step_rewards = step_rewards.to(torch.get_default_dtype())
    if mask is None:
        valid = torch.ones_like(step_rewards, dtype=torch.bool)
    else:
        if mask.shape != step_rewards.shape:
            raise ValueError(
                f"mask shape {tuple(mask.shape)} != step_rewards shape {tuple(step_rewards.shape)}"
            )
        valid = mask.to(step_rewards.device) != 0  # [N, K]

    running = step_rewards.new_zeros(step_rewards.shape[0])  # [N]; G after the last step
    returns_by_step: list[torch.Tensor] = []
    # K (turns) is small; loop over it backwards, vectorised over the batch.
    for k in reversed(range(step_rewards.shape[1])):
        running = torch.where(valid[:, k], step_rewards[:, k] + gamma * running, running)  # [N]
        returns_by_step.append(torch.where(valid[:, k], running, torch.zeros_like(running)))
    if not returns_by_step:
        return torch.zeros_like(step_rewards)
    return torch.stack(returns_by_step[::-1], dim=1)  # [N, K]
