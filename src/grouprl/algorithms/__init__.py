"""Pure tensor RL algorithms: advantages, clipped policy losses, loss aggregation, KL
estimators, entropy and discounted returns.

No models, no I/O, no config objects: tensors in, tensors out. Every algorithm is
registered by name in `registry` (plain dicts); callers pick one by name and an unknown
name raises ValueError listing the allowed names (`available(kind)` gives them).
"""

from .api import aggregate_loss, compute_advantages, kl_estimate, policy_loss
from .entropy import entropy_from_logits
from .registry import ADVANTAGE_ESTIMATORS, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES, available
from .returns import discounted_returns

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "aggregate_loss",
    "available",
    "compute_advantages",
    "discounted_returns",
    "entropy_from_logits",
    "kl_estimate",
    "policy_loss",
]
