"""Public entry points: check shapes, resolve names through `registry`, call the function."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from .advantages import group_index_from_ids
from .registry import lookup


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Outcome advantages: rewards [N], group_ids (N hashables, any order) -> [N] float, detached.

    estimator: "grpo" | "grpo_batch" | "rloo" (see advantages.py for the formulas).
    """
    fn = lookup("advantage_estimator", estimator)
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-d tensor [N], got shape {tuple(rewards.shape)}")
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"got {len(group_ids)} group ids for {rewards.shape[0]} rewards")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    group_index = group_index_from_ids(group_ids, rewards.device)  # [N]
    return fn(rewards.detach(), group_index, norm_by_std=norm_by_std, epsilon=epsilon)


def aggregate_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce loss_mat [N, T] under loss_mask [N, T] to a scalar with aggregation `mode`."""
    fn = lookup("agg_mode", mode)
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mat shape {tuple(loss_mat.shape)} != loss_mask shape {tuple(loss_mask.shape)}"
        )
    return fn(loss_mat, loss_mask)


def policy_loss(
    mode: str,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = 3.0,
    agg_mode: str,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss `mode` ("ppo" | "gspo"), reduced with `agg_mode`.

    log_probs, old_log_probs, loss_mask: [N, T]; advantages: [N] (one per sequence,
    broadcast over tokens) or [N, T]. `token_weights` [N, T] (constants, e.g. rollout
    importance weights from `rollout_is_weights`) multiply the per-token losses before the
    reduction. Returns (scalar loss, metrics as python floats: "clipfrac", "clipfrac_lower",
    "ppo_kl"). `dual_clip` applies to "ppo" only.
    """
    token_losses = lookup("policy_loss", mode)
    reduce = lookup("agg_mode", agg_mode)
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [N, T], got shape {tuple(log_probs.shape)}")
    for name, tensor in (("old_log_probs", old_log_probs), ("loss_mask", loss_mask)):
        if tensor.shape != log_probs.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} != log_probs shape {tuple(log_probs.shape)}"
            )
    if advantages.shape == log_probs.shape[:1]:
        advantages = advantages.unsqueeze(-1)  # [N, 1]; broadcasts over tokens
    elif advantages.shape != log_probs.shape:
        raise ValueError(
            f"advantages must be [N] or [N, T] = {tuple(log_probs.shape)}, got shape {tuple(advantages.shape)}"
        )
    advantages = advantages.to(log_probs.dtype).detach()
    # tokens outside the loss carry no advantage: a NaN on a fully masked row (e.g. a masked
    # truncated sample) must not reach the gradient through 0 * NaN
    advantages = torch.where(loss_mask != 0, advantages, torch.zeros((), dtype=advantages.dtype))
    old_log_probs = old_log_probs.detach()  # the behaviour policy is a constant

    pg_losses, metrics = token_losses(
        log_probs,
        old_log_probs,
        advantages,
        loss_mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )  # [N, T]
    if token_weights is not None:
        if token_weights.shape != log_probs.shape:
            raise ValueError(
                f"token_weights shape {tuple(token_weights.shape)} != log_probs shape {tuple(log_probs.shape)}"
            )
        pg_losses = pg_losses * token_weights.detach().to(pg_losses.dtype)
    loss = reduce(pg_losses, loss_mask)
    return loss, {name: float(value) for name, value in metrics.items()}


def rollout_is_weights(
    level: str,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights [N, T] of engine samples (see rollout_correction.py) at
    `level` ("token" | "sequence"), capped at `cap`; metrics "mean", "capped_frac"."""
    fn = lookup("rollout_correction", level)
    for name, tensor in (("rollout_log_probs", rollout_log_probs), ("loss_mask", loss_mask)):
        if tensor.shape != old_log_probs.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} != old_log_probs shape {tuple(old_log_probs.shape)}"
            )
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    weights, metrics = fn(old_log_probs, rollout_log_probs, loss_mask, cap=cap)
    return weights, {name: float(value) for name, value in metrics.items()}


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate [N, T] with estimator `kind` (k1/kl, abs, k2/mse, k3/low_var_kl, '+' variants)."""
    fn = lookup("kl_estimator", kind)
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs shape {tuple(log_probs.shape)} != ref_log_probs shape {tuple(ref_log_probs.shape)}"
        )
    return fn(log_probs, ref_log_probs)
