"""Reduce a per-token loss matrix [N, T] to a scalar (verl `agg_loss` conventions).

The choice of reduction is a real algorithmic choice, not bookkeeping:
  * token-mean              every valid token weighs the same (DAPO, arXiv 2503.14476);
                            long answers get more total weight.
  * seq-mean-token-mean     every sequence weighs the same, tokens averaged inside it
                            (original GRPO, arXiv 2402.03300; recommended for GSPO,
                            arXiv 2507.18071).
  * seq-mean-token-sum      per-sequence token *sum*, averaged over sequences.
  * seq-mean-token-sum-norm total token sum divided by a constant (the configured response
                            length; the padded length T when none is given),
                            Dr. GRPO's length-unbiased form (arXiv 2503.20783).

All functions take loss_mat [N, T] and loss_mask [N, T] (bool or float) and return a
0-d tensor. Positions with mask == 0 never contribute, not even NaN/inf.
Rows whose mask is all zero ("empty rows") are left out of the sequence means.
"""

from __future__ import annotations

import torch

from .masking import as_float_mask, masked_sum, safe_count


def token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    # L = sum_{i,t} m_it * l_it / sum_{i,t} m_it ; 0 if the batch has no valid token
    # (verl divides by sum(m) unguarded, which gives NaN for an empty mask).
    mask = as_float_mask(loss_mask, loss_mat)  # [N, T]
    return masked_sum(loss_mat, mask) / safe_count(mask.sum())


def seq_mean_token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    # L = 1/|S| sum_{i in S} ( sum_t m_it * l_it / sum_t m_it ),  S = rows with sum_t m_it > 0
    mask = as_float_mask(loss_mask, loss_mat)  # [N, T]
    tokens_per_seq = mask.sum(dim=-1)  # [N]
    seq_losses = masked_sum(loss_mat, mask, dim=-1) / safe_count(tokens_per_seq)  # [N]
    non_empty = (tokens_per_seq > 0).to(loss_mat.dtype)  # [N]
    return (seq_losses * non_empty).sum() / safe_count(non_empty.sum())


def seq_mean_token_sum(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    # L = 1/|S| sum_{i in S} sum_t m_it * l_it ,  S = rows with sum_t m_it > 0
    mask = as_float_mask(loss_mask, loss_mat)  # [N, T]
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # [N]; 0 for empty rows
    non_empty = (mask.sum(dim=-1) > 0).to(loss_mat.dtype)  # [N]
    return seq_losses.sum() / safe_count(non_empty.sum())


def seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, norm_length: float | None = None
) -> torch.Tensor:
    # L = sum_{i,t} m_it * l_it / C ,  C = `norm_length`, a constant: the configured response
    # length (verl pads every response to it, so its loss_mask.shape[-1] is that constant).
    # Without it, C = T = loss_mask.shape[-1], the padded length of this batch.
    # It divides by C only, NOT by the number of sequences (verl's default), so the scale of
    # the loss grows with the batch size. A constant divisor keeps the gradient free of the
    # length bias Dr. GRPO (arXiv 2503.20783) points out; a batch's longest response is not a
    # constant (the effective learning rate would move with it).
    mask = as_float_mask(loss_mask, loss_mat)  # [N, T]
    divisor = norm_length if norm_length is not None else max(int(loss_mask.shape[-1]), 1)
    return masked_sum(loss_mat, mask) / divisor
