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


def _reducer(mode: str, norm_length: float | None):
    """The aggregation `mode` as fn(loss_mat, loss_mask); `norm_length` is the constant that
    seq-mean-token-sum-norm divides by (None: the padded length)."""
    fn = lookup("agg_mode", mode)
    if norm_length is not None and mode == "seq-mean-token-sum-norm":
        if not norm_length > 0:
            raise ValueError(f"norm_length must be > 0, got {norm_length}")
        return lambda loss_mat, loss_mask: fn(loss_mat, loss_mask, norm_length=norm_length)
    return fn


def aggregate_loss(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, *, norm_length: float | None = None
) -> torch.Tensor:
    """Reduce loss_mat [N, T] under loss_mask [N, T] to a scalar with aggregation `mode`
    (`norm_length`: seq-mean-token-sum-norm's constant divisor; None = the padded length T)."""
    fn = _reducer(mode, norm_length)
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
    norm_length: float | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient loss `mode` ("ppo" | "gspo" | "cispo" | "sapo" | "gmpo"; verl's names
    "vanilla", "geo_mean" too), reduced with `agg_mode`. `tau_pos` / `tau_neg`: SAPO's gate
    temperatures.

    log_probs, old_log_probs, loss_mask: [N, T]; advantages: [N] (one per sequence,
    broadcast over tokens) or [N, T]. `token_weights` [N, T] (constants, e.g. rollout
    importance weights from `rollout_is_weights`) multiply the per-token losses before the
    reduction. Returns (scalar loss, metrics as python floats: "clipfrac", "clipfrac_lower",
    "ppo_kl"). `dual_clip` applies to "ppo" only; `norm_length` is seq-mean-token-sum-norm's
    constant divisor (None: the padded length).
    """
    token_losses = lookup("policy_loss", mode)
    reduce = _reducer(agg_mode, norm_length)
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
        **({"tau_pos": tau_pos, "tau_neg": tau_neg} if token_losses is lookup("policy_loss", "sapo") else {}),
    )  # [N, T]
    if token_weights is not None:
        if token_weights.shape != log_probs.shape:
            raise ValueError(
                f"token_weights shape {tuple(token_weights.shape)} != log_probs shape {tuple(log_probs.shape)}"
            )
        pg_losses = pg_losses * token_weights.detach().to(pg_losses.dtype)
    loss = reduce(pg_losses, loss_mask)
    return loss, {name: float(value) for name, value in metrics.items()}


def rollout_correction(
    level: str,
    mode: str,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    upper: float,
    lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance correction of engine samples (see rollout_correction.py): the ratio
    pi_old / pi_rollout at `level` ("token" | "sequence" | "geometric"), in `mode` ("truncate":
    weights min(w, upper); "mask": what leaves [lower, upper] leaves the loss, the rest keeps
    weight w; `lower` defaults to 1 / upper). Returns (weights [N, T], keep [N, T]: multiply the
    loss mask by it, metrics as python floats: "mean", "ess", and "capped_frac" (truncate) or
    "masked_frac", "masked_seq_frac" (mask))."""
    log_ratio_of = lookup("rollout_correction", level)
    apply = lookup("rollout_correction_mode", mode)
    for name, tensor in (("rollout_log_probs", rollout_log_probs), ("loss_mask", loss_mask)):
        if tensor.shape != old_log_probs.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} != old_log_probs shape {tuple(old_log_probs.shape)}"
            )
    if not upper > 0:
        raise ValueError(f"upper bound must be > 0, got {upper}")
    if mode == "mask":  # truncation has no lower edge
        lower = 1.0 / upper if lower is None else lower
        if not 0 <= lower < upper:
            raise ValueError(f"lower bound must be in [0, upper={upper}), got {lower}")
    else:
        lower = 0.0
    log_ratio = log_ratio_of(old_log_probs, rollout_log_probs, loss_mask)  # [N, T]
    weights, keep, metrics = apply(log_ratio, loss_mask, upper=upper, lower=lower, per_sequence=level != "token")
    return weights, keep, {name: float(value) for name, value in metrics.items()}


def rollout_is_weights(
    level: str,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights [N, T] of engine samples at `level`, capped at `cap`
    (`rollout_correction` in truncate mode); metrics "mean", "capped_frac", "ess"."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    weights, _, metrics = rollout_correction(
        level, "truncate", old_log_probs, rollout_log_probs, loss_mask, upper=cap
    )
    return weights, metrics


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate [N, T] with estimator `kind` (k1/kl, abs, k2/mse, k3/low_var_kl, '+' variants)."""
    fn = lookup("kl_estimator", kind)
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs shape {tuple(log_probs.shape)} != ref_log_probs shape {tuple(ref_log_probs.shape)}"
        )
    return fn(log_probs, ref_log_probs)
