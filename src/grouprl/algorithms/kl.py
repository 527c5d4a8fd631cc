"""Per-token KL(pi || pi_ref) estimators from sampled log-probs (verl `kl_penalty` conventions).

Estimators from J. Schulman, "Approximating KL Divergence" (2020),
http://joschu.net/blog/kl-approx.html. With x = log pi(y_t) - log pi_ref(y_t) for
y_t ~ pi:
    k1 = x                       unbiased, high variance, can be negative
    k2 = x^2 / 2                 biased, low variance; its gradient is the unbiased
                                 gradient of KL(pi || pi_ref)
    k3 = e^{-x} - 1 + x          unbiased, low variance, always >= 0 ("low_var_kl", used
                                 by GRPO, arXiv 2402.03300 eq. 4)
    abs = |x|
Every function maps log_probs [N, T], ref_log_probs [N, T] -> [N, T] (no reduction).
"""

from __future__ import annotations

import torch

# verl's numerical guards for k3: bound the log-ratio before exp() and the result.
K3_LOG_RATIO_BOUND = 20.0
K3_VALUE_BOUND = 10.0


def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs  # [N, T]


def kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - ref_log_probs).abs()  # [N, T]


def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()  # [N, T]


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    # d = clamp(ref - lp, -20, 20);  k3 = clamp(e^d - d - 1, -10, 10)
    # (k3 >= 0 mathematically, so only the upper bound ever acts.)
    log_ratio = torch.clamp(
        ref_log_probs - log_probs, min=-K3_LOG_RATIO_BOUND, max=K3_LOG_RATIO_BOUND
    )  # [N, T]
    k3 = torch.exp(log_ratio) - log_ratio - 1.0  # [N, T]
    return torch.clamp(k3, min=-K3_VALUE_BOUND, max=K3_VALUE_BOUND)


def _straight_through_k2(value_estimator):
    """Value of `value_estimator`, gradient of k2 (verl's "<name>+" variants).

    k1/k3 have the right expected *value* but not the right expected *gradient* of
    KL(pi || pi_ref) when used as a loss; k2 has the right gradient. out = k2 - sg[k2] + sg[value].
    """

    def estimator(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
        value = value_estimator(log_probs, ref_log_probs)  # [N, T]
        grad_source = kl_k2(log_probs, ref_log_probs)  # [N, T]
        return grad_source - grad_source.detach() + value.detach()

    estimator.__name__ = f"{value_estimator.__name__}_straight_through_k2"
    estimator.__doc__ = f"Value of {value_estimator.__name__}, gradient of kl_k2."
    return estimator


kl_k1_plus = _straight_through_k2(kl_k1)
kl_abs_plus = _straight_through_k2(kl_abs)
kl_k3_plus = _straight_through_k2(kl_k3)
