"""The rollout engine and the trainer disagree a little on the same tokens (other kernels,
precision, batching), so the samples come from pi_rollout while the loss's ratio is taken
against the trainer's pi_old. Truncated importance sampling (TIS; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training") reweights each token's
policy-gradient loss by the capped ratio pi_old / pi_rollout:

    token:     w_it = min(exp(old_lp_it - rollout_lp_it), C)
    sequence:  w_i  = min(exp(sum_t m_it (old_lp_it - rollout_lp_it)), C), broadcast over t

Both are constants for the gradient. Every function takes old_log_probs, rollout_log_probs and
loss_mask [N, T] and returns (weights [N, T], metrics {name: 0-d tensor}).
"""

from __future__ import annotations

import torch

from .masking import as_float_mask, masked_mean, masked_sum

LOG_RATIO_BOUND = 20.0  # exp() stays finite; such tokens are capped anyway


def _capped(log_ratio: torch.Tensor, cap: float, loss_mask: torch.Tensor):
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    weights = ratio.clamp(max=cap)
    metrics = {
        "mean": masked_mean(weights, loss_mask),
        "capped_frac": masked_mean((ratio > cap).to(weights.dtype), loss_mask),
    }
    return weights, metrics


def token_is_weights(old_log_probs, rollout_log_probs, loss_mask, *, cap: float):
    log_ratio = (old_log_probs - rollout_log_probs).detach()  # [N, T]
    return _capped(log_ratio, cap, loss_mask)


def sequence_is_weights(old_log_probs, rollout_log_probs, loss_mask, *, cap: float):
    mask = as_float_mask(loss_mask, old_log_probs)  # [N, T]
    log_ratio = masked_sum((old_log_probs - rollout_log_probs).detach(), mask, dim=-1)  # [N]
    return _capped(log_ratio.unsqueeze(-1).expand_as(mask), cap, loss_mask)


def logprob_mismatch(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor, threshold: float
) -> dict[str, torch.Tensor]:
    """|trainer - engine| log-prob difference over the loss's tokens: mean, max, and the share
    of tokens above `threshold`."""
    diff = (log_probs - rollout_log_probs).abs().detach()  # [N, T]
    mask = as_float_mask(loss_mask, diff)
    in_loss = torch.where(mask != 0, diff, torch.zeros_like(diff))
    return {
        "mean": masked_mean(diff, loss_mask),
        "max": in_loss.max() if in_loss.numel() else in_loss.new_zeros(()),
        "above_threshold": masked_mean((diff > threshold).to(diff.dtype), loss_mask),
    }
