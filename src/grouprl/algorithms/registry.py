"""The one place where algorithm names map to functions.

Every caller (the public API, the trainer, the config validator) resolves names through
these plain dicts, so adding an algorithm means adding one line here, and the list of
allowed names in error messages and config validation can never drift from the code.
"""

from __future__ import annotations

from collections.abc import Callable

from . import advantages, aggregation, kl, policy_losses, rollout_correction

# name -> fn(rewards [N], group_index [N], *, norm_by_std, epsilon) -> advantages [N]
ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "grpo": advantages.grpo_advantages,
    "grpo_batch": advantages.grpo_batch_advantages,
    "rloo": advantages.rloo_advantages,
}

# name -> fn(log_probs, old_log_probs, advantages, loss_mask, *, clip_low, clip_high, dual_clip)
#         -> (pg_losses [N, T], metrics)
POLICY_LOSSES: dict[str, Callable] = {
    "ppo": policy_losses.ppo_token_losses,
    "vanilla": policy_losses.ppo_token_losses,  # verl's name for PPO's clipped surrogate
    "gspo": policy_losses.gspo_token_losses,
    "cispo": policy_losses.cispo_token_losses,
    "sapo": policy_losses.sapo_token_losses,
    "gmpo": policy_losses.gmpo_token_losses,
    "geo_mean": policy_losses.gmpo_token_losses,  # verl's name
}

# name -> fn(loss_mat [N, T], loss_mask [N, T]) -> scalar
AGG_MODES: dict[str, Callable] = {
    "token-mean": aggregation.token_mean,
    "seq-mean-token-mean": aggregation.seq_mean_token_mean,
    "seq-mean-token-sum": aggregation.seq_mean_token_sum,
    "seq-mean-token-sum-norm": aggregation.seq_mean_token_sum_norm,
}

# name -> fn(log_probs [N, T], ref_log_probs [N, T]) -> [N, T]. Aliases are verl's names.
# "<name>+" = value of <name>, gradient of k2 (straight-through; see kl.py).
KL_ESTIMATORS: dict[str, Callable] = {
    "k1": kl.kl_k1,
    "kl": kl.kl_k1,
    "abs": kl.kl_abs,
    "k2": kl.kl_k2,
    "mse": kl.kl_k2,
    "k3": kl.kl_k3,
    "low_var_kl": kl.kl_k3,
    "k1+": kl.kl_k1_plus,
    "kl+": kl.kl_k1_plus,
    "abs+": kl.kl_abs_plus,
    "k3+": kl.kl_k3_plus,
    "low_var_kl+": kl.kl_k3_plus,
}

# Importance correction of engine samples (rollout_correction.py).
# level -> fn(old_log_probs [N, T], rollout_log_probs [N, T], loss_mask [N, T]) -> log-ratio [N, T]
ROLLOUT_CORRECTIONS: dict[str, Callable] = {
    "token": rollout_correction.token_log_ratio,
    "sequence": rollout_correction.sequence_log_ratio,
    "geometric": rollout_correction.geometric_log_ratio,
}
# mode -> fn(log_ratio [N, T], loss_mask [N, T], *, upper, lower, per_sequence)
#         -> (weights [N, T], keep [N, T], metrics)
ROLLOUT_CORRECTION_MODES: dict[str, Callable] = {
    "truncate": rollout_correction.truncate,
    "mask": rollout_correction.mask_out,
}

# kind -> (registry, how the kind reads in an error message)
REGISTRIES: dict[str, tuple[dict[str, Callable], str]] = {
    "advantage_estimator": (ADVANTAGE_ESTIMATORS, "advantage estimator"),
    "policy_loss": (POLICY_LOSSES, "policy loss"),
    "agg_mode": (AGG_MODES, "loss aggregation mode"),
    "kl_estimator": (KL_ESTIMATORS, "KL estimator"),
    "rollout_correction": (ROLLOUT_CORRECTIONS, "rollout correction level"),
    "rollout_correction_mode": (ROLLOUT_CORRECTION_MODES, "rollout correction mode"),
}


def _registry(kind: str) -> tuple[dict[str, Callable], str]:
    if kind not in REGISTRIES:
        raise ValueError(f"unknown algorithm kind {kind!r}; allowed: {', '.join(sorted(REGISTRIES))}")
    return REGISTRIES[kind]


def available(kind: str) -> list[str]:
    """Sorted names registered for `kind` ("advantage_estimator", "policy_loss", "agg_mode",
    "kl_estimator", "rollout_correction", "rollout_correction_mode")."""
    table, _ = _registry(kind)
    return sorted(table)


def lookup(kind: str, name: str) -> Callable:
    """The function registered as `name` under `kind`; ValueError listing the allowed names otherwise."""
    table, label = _registry(kind)
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"unknown {label} {name!r}; allowed: {', '.join(sorted(table))}")
    return table[name]
