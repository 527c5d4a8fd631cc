"""Entropy of the categorical next-token distribution, from raw logits."""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H(p) = -sum_v p_v log p_v for p = softmax(logits) over the last dim.

    logits [N, T, V] (any leading shape) -> [N, T].

    Uses H = logsumexp(z) - sum_v p_v z_v (from log p_v = z_v - logsumexp(z); verl's
    `entropy_from_logits` formula) with two guards:
      * z is shifted by its (detached) max first. H is shift-invariant, so value and
        gradient are unchanged, but the two terms no longer cancel catastrophically for
        large logits (float32 logits near 1e3 would otherwise lose ~1e-4 absolute).
      * p_v z_v is taken as 0 where p_v == 0, so -inf logits (masked vocabulary) give
        no 0 * inf = NaN in the value or the gradient.
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()  # [N, T, V]; max 0
    probs = torch.softmax(shifted, dim=-1)  # [N, T, V]
    safe_shifted = torch.where(probs > 0, shifted, torch.zeros_like(shifted))  # [N, T, V]
    return torch.logsumexp(shifted, dim=-1) - (probs * safe_shifted).sum(dim=-1)  # [N, T]
