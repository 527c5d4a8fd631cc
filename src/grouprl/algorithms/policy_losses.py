"""Per-token clipped policy-gradient losses (verl `compute_policy_loss_*` conventions).

Every loss has the signature
    fn(log_probs [N, T], old_log_probs [N, T], advantages [N, T], loss_mask [N, T], *,
       clip_low, clip_high, dual_clip) -> (pg_losses [N, T], metrics {name: 0-d tensor})
and returns the *unreduced* loss matrix; `api.policy_loss` reduces it with the requested
aggregation mode, so every loss honours `agg_mode` (verl hard-codes seq-mean-token-mean
for GSPO; we do not). Metrics are detached masked means over valid tokens.
"""

from __future__ import annotations

import torch

from .masking import masked_mean

# Bounds on log-ratios before exp(), as in verl: keep exp() finite for tokens whose
# probability moved by many orders of magnitude (those tokens are clipped anyway).
PPO_LOG_RATIO_BOUND = 20.0
GSPO_LOG_RATIO_MAX = 10.0


def clip_metrics(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, clipped: torch.Tensor | None, lower: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Every loss's metrics, detached masked means over valid tokens: clipfrac (`clipped`),
    clipfrac_lower (`lower`), ppo_kl = mean_t (old_lp - lp) from `log_ratio`; None is 0."""
    with torch.no_grad():
        zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)

        def share(flags):
            return zero if flags is None else masked_mean(flags.to(log_ratio.dtype), loss_mask)

        return {"clipfrac": share(clipped), "clipfrac_lower": share(lower), "ppo_kl": masked_mean(-log_ratio, loss_mask)}


def token_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-ratio clamped to +-20, its exp) per token [N, T]: PPO's, CISPO's and SAPO's ratio."""
    log_ratio = torch.clamp(log_probs - old_log_probs, min=-PPO_LOG_RATIO_BOUND, max=PPO_LOG_RATIO_BOUND)
    return log_ratio, torch.exp(log_ratio)


def ppo_token_losses(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347) with decoupled clip
    range [1 - clip_low, 1 + clip_high] (DAPO "clip-higher", arXiv 2503.14476) and dual
    clip for negative advantages (Ye et al. 2020, arXiv 1912.09729):

        r_t  = exp(clamp(lp_t - old_lp_t, -20, 20))
        L1_t = -A_t r_t,   L2_t = -A_t clip(r_t, 1 - clip_low, 1 + clip_high)
        C_t  = max(L1_t, L2_t)
        L_t  = min(C_t, -A_t c)  if A_t < 0 and dual clip c is set,  else C_t

    metrics: clipfrac       = mean_t [L2_t > L1_t]
             clipfrac_lower = mean_t [A_t < 0 and C_t > -A_t c]   (tokens the dual clip bounds)
             ppo_kl         = mean_t (old_lp_t - lp_t)  using the *clamped* log-ratio, as verl.
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0 (or None to disable it), got {dual_clip}")

    log_ratio, ratio = token_ratio(log_probs, old_log_probs)  # [N, T]
    unclipped = -advantages * ratio  # [N, T]
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # [N, T]
    clip_losses = torch.maximum(unclipped, clipped)  # [N, T]

    if dual_clip is None:
        pg_losses = clip_losses
        dual_clipped = torch.zeros_like(clip_losses, dtype=torch.bool)
    else:
        dual_bound = -advantages * dual_clip  # [N, T]; positive where A < 0
        negative_adv = advantages < 0  # [N, T]
        pg_losses = torch.where(negative_adv, torch.minimum(clip_losses, dual_bound), clip_losses)
        dual_clipped = negative_adv & (clip_losses > dual_bound)

    return pg_losses, clip_metrics(log_ratio, loss_mask, clipped > unclipped, dual_clipped)


def gspo_token_losses(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), token-level form "GSPO-token" (eq. 13-14):

        s_i     = exp( 1/|y_i| sum_t (lp_it - old_lp_it) )        sequence importance ratio
        s_it    = sg[s_i] * pi(y_it) / sg[pi(y_it)]               value s_i, grad s_i * d lp_it
        L1_it   = -A_it s_it,   L2_it = -A_it clip(s_it, 1 - clip_low, 1 + clip_high)
        L_it    = max(L1_it, L2_it)

    The log of s_it is capped at 10 before exp() (verl). With A_it = A_i for all t and
    seq-mean-token-mean aggregation this has exactly the gradient of the sequence-level
    objective -mean_i min(s_i A_i, clip(s_i) A_i). There is no dual clip in GSPO;
    `dual_clip` is accepted for a uniform signature and ignored.
    metrics: clipfrac = mean_t [L2 > L1]; clipfrac_lower = 0; ppo_kl = mean_t (old_lp - lp) unclamped.
    """
    del dual_clip
    mask = loss_mask.to(log_probs.dtype)  # [N, T]
    log_ratio = log_probs - old_log_probs  # [N, T]
    seq_lengths = mask.sum(dim=-1).clamp(min=1.0)  # [N]; |y_i|
    masked_log_ratio = torch.where(mask != 0, log_ratio, torch.zeros_like(log_ratio)) * mask
    seq_log_ratio = masked_log_ratio.sum(dim=-1) / seq_lengths  # [N]; log s_i
    # value: log s_i ; gradient: d lp_it  (stop-gradient on both s_i and pi(y_it))
    token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [N, T]
    token_log_ratio = torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX)
    seq_ratio = torch.exp(token_log_ratio)  # [N, T]

    unclipped = -advantages * seq_ratio  # [N, T]
    clipped = -advantages * torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)  # [N, T]
    pg_losses = torch.maximum(unclipped, clipped)  # [N, T]

    return pg_losses, clip_metrics(log_ratio, loss_mask, clipped > unclipped, None)


def cispo_token_losses(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped and detached, and
    every token keeps its gradient (none is zeroed by the clip, as PPO's are):

        r_t = exp(clamp(lp_t - old_lp_t, -20, 20)),   L_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] A_t lp_t

    (the value carries lp_t, as verl's; the gradient is -clip(r_t) A_t d lp_t). No dual clip.
    metrics: clipfrac = mean_t [clip(r_t) != r_t]; clipfrac_lower = 0; ppo_kl = mean_t (old_lp - lp), clamped.
    """
    del dual_clip
    log_ratio, ratio = token_ratio(log_probs, old_log_probs)  # [N, T]
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # [N, T]
    pg_losses = -clipped.detach() * advantages * log_probs  # [N, T]
    return pg_losses, clip_metrics(log_ratio, loss_mask, ratio != clipped, None)


def sapo_token_losses(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (soft adaptive policy optimisation, arXiv 2511.20347): a smooth gate in place of the
    hard clip, steeper for negative advantages:

        r_t = exp(clamp(lp_t - old_lp_t, -20, 20)),   tau_t = tau_pos if A_t > 0 else tau_neg
        L_t = -A_t * sigmoid(tau_t (r_t - 1)) * 4 / tau_t

    (at r = 1 the gate is 2 / tau with slope 1: the plain policy gradient). clip_low, clip_high
    and dual clip do not apply. verl aggregates SAPO with seq-mean-token-mean whatever its
    loss_agg_mode; here the run's actor.loss_agg_mode does (seq-mean-token-mean gives verl's).
    metrics: clipfrac = clipfrac_lower = 0; ppo_kl = mean_t (old_lp - lp), clamped.
    """
    del clip_low, clip_high, dual_clip
    log_ratio, ratio = token_ratio(log_probs, old_log_probs)  # [N, T]
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))  # [N, T]
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # [N, T]
    pg_losses = -gates * advantages  # [N, T]
    return pg_losses, clip_metrics(log_ratio, loss_mask, None, None)


def gmpo_token_losses(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (geometric-mean policy optimisation, arXiv 2507.20673; verl's `geo_mean`): the
    sequence's ratio is the geometric mean of its tokens' ratios, each log-ratio clipped to
    [-clip_low, clip_high] (log space: GMPO's clip 0.4 allows ratios in [e^-0.4, e^0.4]) in the
    direction of the advantage's sign:

        d_t   = lp_t - old_lp_t,    c_t = clamp(d_t, -clip_low, clip_high)
        m_t   = sgn(A_t) min(sgn(A_t) d_t, sgn(A_t) c_t)
        L_i   = -Abar_i exp( mean_t m_t )         (Abar_i: the row's mean advantage)

    Returned as a token matrix whose every valid token of row i holds L_i (with its whole
    gradient): seq-mean-token-mean then gives mean_i L_i, verl's loss (which averages over every
    row, empty ones too). No dual clip.
    metrics: clipfrac = mean_t [c_t != d_t and A_t > 0]; clipfrac_lower = the same for A_t < 0;
    ppo_kl = mean_t (old_lp - lp), unclamped.
    """
    del dual_clip
    mask = loss_mask.to(log_probs.dtype)  # [N, T]
    log_ratio = log_probs - old_log_probs  # [N, T]
    clamped = torch.clamp(log_ratio, -clip_low, clip_high)  # [N, T]
    sign = torch.sign(advantages)
    sign = sign.expand_as(log_ratio) if sign.shape != log_ratio.shape else sign  # [N, T]
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)  # [N, T]
    count = mask.sum(dim=-1)  # [N]
    seq_ratio = torch.exp((kept * mask).sum(dim=-1) / (count + 1e-8))  # [N]
    seq_advantage = (advantages.expand_as(log_ratio) * mask).sum(dim=-1) / (count + 1e-8)  # [N]
    seq_losses = -seq_advantage * seq_ratio  # [N]
    pg_losses = seq_losses.unsqueeze(-1).expand_as(log_ratio)  # [N, T]
    clipped = clamped != log_ratio
    return pg_losses, clip_metrics(log_ratio, loss_mask, clipped & (sign > 0), clipped & (sign < 0))
