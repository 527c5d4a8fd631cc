"""Masked reductions shared by the loss aggregations and the policy-loss metrics.

Values outside the mask are replaced by 0 with `torch.where` before anything is
summed, so inf/NaN sitting in padded positions (e.g. log-probs of pad tokens)
cannot leak into a sum (0 * inf = NaN otherwise). This matches verl's
`masked_sum`. The mask may be bool or float; a float mask acts as a weight.
"""

from __future__ import annotations

import torch


def as_float_mask(loss_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Return `loss_mask` in the floating dtype/device of `like` (bool masks become 0./1.)."""
    return loss_mask.to(dtype=like.dtype, device=like.device)


def masked_sum(values: torch.Tensor, loss_mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) over `dim` (all dims when None), ignoring whatever sits under mask == 0."""
    mask = as_float_mask(loss_mask, values)
    kept = torch.where(mask != 0, values, torch.zeros_like(values)) * mask
    return kept.sum() if dim is None else kept.sum(dim=dim)


def safe_count(count: torch.Tensor) -> torch.Tensor:
    """A divisor that is `count` where positive and 1 elsewhere.

    Dividing a zero sum by it gives exactly 0 with finite gradients, which is how empty
    masks/rows are handled everywhere here. (verl adds 1e-8 to the count instead; for
    non-empty 0/1 masks the two differ by a relative 1e-8 at most.)
    """
    return torch.where(count > 0, count, torch.ones_like(count))


def masked_mean(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / sum(mask) over everything; 0 when the mask is empty."""
    mask = as_float_mask(loss_mask, values)
    return masked_sum(values, mask) / safe_count(mask.sum())
