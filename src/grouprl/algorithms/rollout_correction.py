"""The rollout engine and the trainer disagree a little on the same tokens (other kernels,
precision, batching), so the samples come from pi_rollout while the loss's ratio is taken
against the trainer's pi_old. Importance sampling corrects the gradient toward pi_old (Yao et
al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"; Liu, Li et
al. 2025, "When speed kills stability"). With rho_it = old_lp_it - rollout_lp_it on the loss's
tokens (m_it = 1), the log-ratio at each level is

    token:      rho_it                                  a weight per token
    sequence:   sum_t m_it rho_it                       one per sequence (the product of ratios)
    geometric:  sum_t m_it rho_it / sum_t m_it          one per sequence (the geometric mean)

and the ratio w = exp(log-ratio) (bounded to exp(+-20) so it stays finite) is used in one of
two modes:

    truncate  (TIS)  weight = min(w, upper); every token stays in the loss
    mask      (MIS)  a token (token level) or a whole sequence whose w leaves [lower, upper]
                     leaves the loss: its mask is 0, so it leaves the loss's denominator too
                     (token count or sequence count); the rest keep weight w

Weights are constants for the gradient. Functions take old_log_probs, rollout_log_probs and
loss_mask [N, T] and return tensors [N, T] and metrics {name: 0-d tensor}.
"""

from __future__ import annotations

import torch

from .masking import as_float_mask, masked_mean, masked_sum, safe_count

LOG_RATIO_BOUND = 20.0  # exp() stays finite; such ratios are truncated or masked anyway


def token_log_ratio(old_log_probs, rollout_log_probs, loss_mask) -> torch.Tensor:
    return (old_log_probs - rollout_log_probs).detach()  # [N, T]


def sequence_log_ratio(old_log_probs, rollout_log_probs, loss_mask) -> torch.Tensor:
    mask = as_float_mask(loss_mask, old_log_probs)  # [N, T]
    per_row = masked_sum((old_log_probs - rollout_log_probs).detach(), mask, dim=-1)  # [N]
    return per_row.unsqueeze(-1).expand_as(mask)


def geometric_log_ratio(old_log_probs, rollout_log_probs, loss_mask) -> torch.Tensor:
    mask = as_float_mask(loss_mask, old_log_probs)  # [N, T]
    per_row = masked_sum((old_log_probs - rollout_log_probs).detach(), mask, dim=-1)  # [N]
    return (per_row / safe_count(mask.sum(-1))).unsqueeze(-1).expand_as(mask)


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def _effective_sample_size(weights: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    """(sum w)^2 / (n sum w^2) over the tokens (or, for sequence weights, the rows) in `mask`:
    1 when every weight is equal, 1/n when one weight carries everything."""
    if per_sequence:
        rows = mask.sum(-1) > 0  # [N]
        w = weights[:, 0][rows] if weights.shape[-1] else weights.new_zeros(0)
    else:
        w = weights[mask != 0]
    if w.numel() == 0:
        return weights.new_ones(())
    return w.sum() ** 2 / (w.numel() * (w * w).sum()).clamp_min(torch.finfo(w.dtype).tiny)


def truncate(log_ratio, loss_mask, *, upper: float, lower: float, per_sequence: bool):
    """TIS: weights min(w, upper); nothing leaves the loss. -> (weights, keep, metrics)."""
    mask = as_float_mask(loss_mask, log_ratio)
    ratio = _ratio(log_ratio)
    weights = ratio.clamp(max=upper)
    metrics = {
        "mean": masked_mean(weights, mask),
        "capped_frac": masked_mean((ratio > upper).to(weights.dtype), mask),
        "ess": _effective_sample_size(weights, mask, per_sequence),
    }
    return weights, torch.ones_like(mask), metrics


def mask_out(log_ratio, loss_mask, *, upper: float, lower: float, per_sequence: bool):
    """MIS: tokens (or whole sequences) whose ratio leaves [lower, upper] leave the loss; the
    rest keep their ratio as weight. -> (weights, keep, metrics); keep is 0 where rejected."""
    mask = as_float_mask(loss_mask, log_ratio)
    ratio = _ratio(log_ratio)
    keep = ((ratio >= lower) & (ratio <= upper)).to(mask.dtype)  # [N, T]
    kept = mask * keep
    in_loss_rows = mask.sum(-1) > 0  # [N]
    dropped_rows = ((mask * (1 - keep)).sum(-1) > 0) & in_loss_rows
    metrics = {
        "mean": masked_mean(ratio, kept),
        "masked_frac": masked_mean(1 - keep, mask),  # share of the loss's tokens rejected
        "masked_seq_frac": dropped_rows.to(mask.dtype).sum() / safe_count(in_loss_rows.to(mask.dtype).sum()),
        "ess": _effective_sample_size(ratio, kept, per_sequence),
    }
    return ratio, keep, metrics


def logprob_mismatch(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor, threshold: float
) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs (`log_probs`, pi_old) are from the engine's over the
    loss's tokens, which the engine sampled:

      mean, max, above_threshold   |old - rollout|: mean, largest, share of tokens above `threshold`
      kl_k1                        KL(pi_rollout || pi_old) ~ mean(rollout - old) (can be < 0)
      kl_k3                        the same, k3 estimator: mean(w - 1 - log w), w = pi_old / pi_rollout (>= 0)
      chi2_token                   mean(w^2) - 1 over the tokens: the chi-square divergence, i.e. the
                                   variance of token weights, estimated from the samples (a little
                                   below 0 where the weights are all close to 1)
      chi2_seq                     mean over sequences of (prod_t w_t)^2 - 1: the same for sequence weights
    """
    diff = (log_probs - rollout_log_probs).detach()  # [N, T] = log w
    mask = as_float_mask(loss_mask, diff)
    gap = diff.abs()
    in_loss = torch.where(mask != 0, gap, torch.zeros_like(gap))
    log_w = diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rows = (mask.sum(-1) > 0).to(diff.dtype)  # [N]
    seq_w2 = torch.exp(2 * masked_sum(diff, mask, dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # [N]
    return {
        "mean": masked_mean(gap, mask),
        "max": in_loss.max() if in_loss.numel() else in_loss.new_zeros(()),
        "above_threshold": masked_mean((gap > threshold).to(diff.dtype), mask),
        "kl_k1": masked_mean(-diff, mask),
        "kl_k3": masked_mean(torch.exp(log_w) - 1 - log_w, mask),
        "chi2_token": masked_mean(torch.exp(2 * log_w), mask) - 1 if mask.sum() > 0 else diff.new_zeros(()),
        "chi2_seq": (seq_w2 * rows).sum() / safe_count(rows.sum()) - 1 if rows.sum() > 0 else diff.new_zeros(()),
    }


def turn_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """The policy turn each token belongs to, [N, T] long: 1 for the first run of loss tokens
    of a row, 2 for the next run after a gap (an observation), ...; 0 outside the loss."""
    on = loss_mask != 0  # [N, T]
    starts = on.clone()
    starts[:, 1:] &= ~on[:, :-1]  # a run starts where the previous token is not a loss token
    return torch.where(on, starts.long().cumsum(-1), torch.zeros_like(on, dtype=torch.long))


TURN_SUMS = ("gap", "kl_k1", "kl_k3", "masked", "tokens")


def turn_mismatch_sums(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    sampled_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    max_turns: int,
) -> torch.Tensor:
    """Per policy turn (`turn_index` of `sampled_mask`, the policy's tokens as sampled), the sums
    that make `logprob_mismatch`'s figures per turn: [max_turns, 5] with columns TURN_SUMS =
    |old - rollout|, rollout - old (k1), k3, tokens the correction masked (in `sampled_mask`, out
    of `loss_mask`), tokens. Sums, not means, so that ranks add them up before dividing."""
    diff = (log_probs - rollout_log_probs).detach().double()
    log_w = diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    turns = turn_index(sampled_mask)
    masked = ((sampled_mask != 0) & (loss_mask == 0)).double()
    columns = [diff.abs(), -diff, torch.exp(log_w) - 1 - log_w, masked, torch.ones_like(diff)]
    out = diff.new_zeros((max_turns, len(columns)))
    for k in range(1, max_turns + 1):
        here = turns == k
        out[k - 1] = torch.stack([c[here].sum() for c in columns])
    return out
