"""Straightforward per-element reference implementations of the verl conventions.

Written independently of src/grouprl/algorithms: python loops over samples and tokens,
python `if` for every max/min/clamp/where, python floats (math, statistics) where no
gradient is needed and 0-d tensor arithmetic where one is. Slow on purpose; only for
small test tensors. The vectorised functions are checked against these.
"""

from __future__ import annotations

import math
import statistics

import torch


def _val(x) -> float:
    """A python float from a number or a 0-d tensor (detached: only used for branching/constants)."""
    return x.detach().item() if isinstance(x, torch.Tensor) else float(x)


# ----------------------------------------------------------------------------- advantages


def ref_advantages(
    estimator: str, rewards: list[float], group_ids: list, norm_by_std: bool, epsilon: float
) -> list[float]:
    if estimator == "grpo_batch":
        group_ids = [0] * len(rewards)
    members: dict = {}
    for i, group_id in enumerate(group_ids):
        members.setdefault(group_id, []).append(i)
    out = [0.0] * len(rewards)
    for indices in members.values():
        scores = [rewards[i] for i in indices]
        n = len(scores)
        for i in indices:
            if estimator in ("grpo", "grpo_batch"):
                if n == 1:
                    mean, std = 0.0, 1.0
                else:
                    mean, std = statistics.fmean(scores), statistics.stdev(scores)  # stdev: n - 1
                out[i] = (rewards[i] - mean) / (std + epsilon) if norm_by_std else rewards[i] - mean
            elif estimator == "rloo":
                if n == 1:
                    out[i] = rewards[i]
                else:
                    others = [rewards[j] for j in indices if j != i]
                    out[i] = rewards[i] - sum(others) / len(others)
            else:
                raise AssertionError(estimator)
    return out


# ----------------------------------------------------------------------------- aggregation


def ref_aggregate(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    n_rows, n_cols = loss_mat.shape
    total = torch.zeros((), dtype=loss_mat.dtype)
    total_tokens = 0.0
    seq_values = []
    for i in range(n_rows):
        row_sum = torch.zeros((), dtype=loss_mat.dtype)
        row_tokens = 0.0
        for t in range(n_cols):
            if _val(loss_mask[i, t]) != 0.0:
                row_sum = row_sum + loss_mat[i, t] * _val(loss_mask[i, t])
                row_tokens += _val(loss_mask[i, t])
        total = total + row_sum
        total_tokens += row_tokens
        if row_tokens > 0:
            seq_values.append(row_sum / row_tokens if mode == "seq-mean-token-mean" else row_sum)
    if mode == "token-mean":
        return total / total_tokens if total_tokens > 0 else total
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        if not seq_values:
            return total
        acc = seq_values[0]
        for value in seq_values[1:]:
            acc = acc + value
        return acc / len(seq_values)
    if mode == "seq-mean-token-sum-norm":
        return total / n_cols
    raise AssertionError(mode)


# ----------------------------------------------------------------------------- policy losses


def _clamp(x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    # constant outside the range (zero gradient), identity inside
    if low is not None and _val(x) < low:
        return torch.tensor(low, dtype=x.dtype)
    if high is not None and _val(x) > high:
        return torch.tensor(high, dtype=x.dtype)
    return x


def _ppo_token(lp, old, adv: float, clip_low, clip_high, dual_clip):
    log_ratio = _clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * _clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = _val(loss2) > _val(loss1)
    loss = loss2 if clipped else loss1
    lower = False
    if dual_clip is not None and adv < 0:
        bound = -adv * dual_clip
        if _val(loss) > bound:
            loss = torch.tensor(bound, dtype=lp.dtype)
            lower = True
    return loss, clipped, lower, -_val(log_ratio)


def _adv_at(advantages: torch.Tensor, i: int, t: int) -> float:
    return _val(advantages[i]) if advantages.dim() == 1 else _val(advantages[i, t])


def ref_policy_loss(
    mode, log_probs, old_log_probs, advantages, loss_mask, clip_low, clip_high, dual_clip, agg_mode
):
    """Returns (loss, {"clipfrac", "clipfrac_lower", "ppo_kl"}) like the public policy_loss."""
    n_rows, n_cols = log_probs.shape
    rows = []
    clip_count = lower_count = kl_sum = valid = 0.0
    for i in range(n_rows):
        row = []
        if mode == "gspo":
            length = sum(_val(loss_mask[i, t]) for t in range(n_cols))
            seq_log_ratio = sum(
                (_val(log_probs[i, t]) - _val(old_log_probs[i, t])) * _val(loss_mask[i, t])
                for t in range(n_cols)
                if _val(loss_mask[i, t]) != 0.0
            ) / max(length, 1.0)
        for t in range(n_cols):
            lp, old, adv = log_probs[i, t], _val(old_log_probs[i, t]), _adv_at(advantages, i, t)
            if mode == "ppo":
                loss, clipped, lower, kl = _ppo_token(lp, old, adv, clip_low, clip_high, dual_clip)
            else:
                # value s_i, gradient s_i * d lp
                ratio = torch.exp(_clamp(lp - _val(lp) + seq_log_ratio, None, 10.0))
                loss1 = -adv * ratio
                loss2 = -adv * _clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
                clipped = _val(loss2) > _val(loss1)
                loss, lower, kl = (loss2 if clipped else loss1), False, old - _val(lp)
            row.append(loss)
            if _val(loss_mask[i, t]) != 0.0:
                clip_count += clipped
                lower_count += lower
                kl_sum += kl
                valid += 1.0
        rows.append(torch.stack(row))
    loss = ref_aggregate(torch.stack(rows), loss_mask, agg_mode)
    denominator = max(valid, 1.0)
    metrics = {
        "clipfrac": clip_count / denominator,
        "clipfrac_lower": lower_count / denominator,
        "ppo_kl": kl_sum / denominator,
    }
    return loss, metrics


def ref_verl_loss(mode, log_probs, old_log_probs, advantages, loss_mask, clip_low, clip_high, agg_mode="token-mean",
                  tau_pos=1.0, tau_neg=1.05):  # fmt: skip
    """verl's `compute_policy_loss_{cispo,sapo,geo_mean}` element by element, with verl's own
    reductions (cispo: `agg_mode`; sapo: seq-mean-token-mean always; geo_mean: the mean over every
    row). Returns (loss, {"clipfrac", "clipfrac_lower", "ppo_kl"})."""
    n_rows, n_cols = log_probs.shape
    rows, seq_losses = [], []
    clip_count = lower_count = kl_sum = valid = 0.0
    for i in range(n_rows):
        row, kept, adv_sum, count = [], [], 0.0, 0.0
        for t in range(n_cols):
            lp, old, adv = log_probs[i, t], _val(old_log_probs[i, t]), _adv_at(advantages, i, t)
            on = _val(loss_mask[i, t]) != 0.0
            if mode in ("cispo", "sapo"):
                log_ratio = _clamp(lp - old, -20.0, 20.0)
                ratio = torch.exp(log_ratio)
                kl = -_val(log_ratio)
                if mode == "cispo":
                    weight = min(max(_val(ratio), 1.0 - clip_low), 1.0 + clip_high)  # a constant (sg)
                    loss, clipped = -weight * adv * lp, weight != _val(ratio)
                else:
                    tau = tau_pos if adv > 0 else tau_neg
                    loss, clipped = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, False
                row.append(loss)
                lower = False
            else:  # geo_mean
                delta = lp - old
                bounded = _clamp(delta, -clip_low, clip_high)
                sign = (adv > 0) - (adv < 0)
                chosen = delta if sign * _val(delta) <= sign * _val(bounded) else bounded
                kept.append(chosen * sign * sign if on else None)
                clipped, lower = (_val(bounded) != _val(delta)) and adv > 0, (_val(bounded) != _val(delta)) and adv < 0
                kl = -_val(delta)
                if on:
                    adv_sum += adv
                    count += 1.0
            if on:
                clip_count += clipped
                lower_count += lower
                kl_sum += kl
                valid += 1.0
        if mode == "geo_mean":
            terms = [k for k in kept if k is not None]
            mean_log = (torch.stack(terms).sum() if terms else torch.zeros((), dtype=log_probs.dtype)) / (count + 1e-8)
            seq_losses.append(-(adv_sum / (count + 1e-8)) * torch.exp(mean_log))
        else:
            rows.append(torch.stack(row))
    if mode == "geo_mean":
        loss = torch.stack(seq_losses).mean()
    else:
        loss = ref_aggregate(torch.stack(rows), loss_mask, "seq-mean-token-mean" if mode == "sapo" else agg_mode)
    denominator = max(valid, 1.0)
    metrics = {
        "clipfrac": clip_count / denominator,
        "clipfrac_lower": lower_count / denominator,
        "ppo_kl": kl_sum / denominator,
    }
    return loss, metrics


# ----------------------------------------------------------------------------- KL, entropy, returns


def ref_kl(lp: torch.Tensor, ref: float, kind: str) -> torch.Tensor:
    """One token; lp is a 0-d tensor (for gradients), ref a float."""
    base = kind.rstrip("+")
    x = lp - ref
    if base in ("k1", "kl"):
        value = x
    elif base == "abs":
        value = x if _val(x) >= 0 else -x
    elif base in ("k2", "mse"):
        value = 0.5 * x * x
    elif base in ("k3", "low_var_kl"):
        d = _clamp(ref - lp, -20.0, 20.0)
        value = _clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
    else:
        raise AssertionError(kind)
    if kind.endswith("+"):
        k2 = 0.5 * x * x
        return k2 - _val(k2) + _val(value)
    return value


def ref_entropy_row(logits_row: list[float]) -> float:
    top = max(logits_row)
    normaliser = sum(math.exp(z - top) for z in logits_row)
    probs = [math.exp(z - top) / normaliser for z in logits_row]
    return -sum(p * math.log(p) for p in probs if p > 0.0)


def ref_discounted_returns(
    rewards: list[list[float]], gamma: float, mask: list[list[float]]
) -> list[list[float]]:
    """Drop masked steps, discount what is left, put zeros back at the masked steps."""
    out = []
    for row_rewards, row_mask in zip(rewards, mask):
        kept = [k for k, m in enumerate(row_mask) if m]
        returns = [0.0] * len(row_rewards)
        future = 0.0
        for k in reversed(kept):
            future = row_rewards[k] + gamma * future
            returns[k] = future
        out.append(returns)
    return out
