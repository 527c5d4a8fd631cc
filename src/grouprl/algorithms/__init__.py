"""Pure tensor RL algorithms: advantages, clipped policy losses, loss aggregation, KL
estimators, entropy and discounted returns.

No models, no I/O, no config objects: tensors in, tensors out. Every algorithm is
registered by name in `registry` (plain dicts); callers pick one by name and an unknown
name raises ValueError listing the allowed names (`available(kind)` gives them).
"""

from .api import (
    aggregate_loss,
    compute_advantages,
    kl_estimate,
    policy_loss,
    rollout_correction,
    rollout_is_weights,
)
from .entropy import entropy_from_logits
from .registry import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_MODES,
    ROLLOUT_CORRECTIONS,
    available,
)
from .returns import discounted_returns
from .rollout_correction import TURN_SUMS, logprob_mismatch, turn_index, turn_mismatch_sums

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "ROLLOUT_CORRECTION_MODES",
    "aggregate_loss",
    "available",
    "compute_advantages",
    "discounted_returns",
    "entropy_from_logits",
    "kl_estimate",
    "logprob_mismatch",
    "policy_loss",
    "rollout_correction",
    "rollout_is_weights",
    "turn_index",
    "turn_mismatch_sums",
    "TURN_SUMS",
]
