"""The LM head applied at response positions only: per-token log-probabilities and entropies in
chunks, the [tokens, vocab] float tensor never whole. A plain linear head runs as one autograd
function that recomputes each chunk's logits in backward (`_LinearHeadStats`); other heads run
each chunk under activation checkpointing."""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint


def _without(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """Logits with the `banned` token ids (never sampled) at the dtype's lowest value: a
    probability of exactly 0, and 0 * logit stays finite in the entropy."""
    if banned is None or not banned.numel():
        return logits
    return logits.index_fill(-1, banned.to(logits.device), torch.finfo(logits.dtype).min)


def _token_stats(
    hidden: torch.Tensor, targets: torch.Tensor, head, temperature: float, with_entropy: bool, banned=None
):
    """hidden [M, H], targets [M] -> log_probs [M] (and entropy [M])."""
    logits = head(hidden)  # [M, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
    if temperature != 1.0:
        logits = logits / temperature
    logits = _without(logits, banned)
    log_z = torch.logsumexp(logits, dim=-1)  # [M]
    log_probs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    if not with_entropy:
        return log_probs, torch.zeros_like(log_probs)
    probs = torch.softmax(logits, dim=-1)
    entropy = log_z - (probs * logits).sum(-1)
    return log_probs, entropy


def _plain_linear(head) -> bool:
    return type(head) is torch.nn.Linear and not (head._forward_hooks or head._forward_pre_hooks)


class _HeadGradInPlace:
    """Set by `head_grad_into_param()`: the head's weight gradient is added straight into the
    parameter's `.grad` instead of being returned to autograd."""

    active = False


@contextlib.contextmanager
def head_grad_into_param():
    """Within the block, `_LinearHeadStats` adds its weight gradient into `weight.grad` itself
    (creating it when None) and returns none to autograd, where the weight is a leaf without
    hooks in float32 or wider. Autograd would hold that [vocab, hidden] gradient until every
    other use of the weight had been reached, which for tied embeddings is the embedding lookup
    at the very end of backward: one more [vocab, hidden] buffer through the whole backward.
    Only for `.backward()`-style accumulation (the update's), not for `torch.autograd.grad`."""
    before = _HeadGradInPlace.active
    _HeadGradInPlace.active = True
    try:
        yield
    finally:
        _HeadGradInPlace.active = before


def _into_param(weight: torch.Tensor) -> bool:
    return (
        _HeadGradInPlace.active
        and weight.is_leaf
        and weight.requires_grad
        and weight.dtype == torch.promote_types(weight.dtype, torch.float32)
        and not getattr(weight, "_backward_hooks", None)
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
    )


class _LinearHeadStats(torch.autograd.Function):
    """Log-probs and entropies through a plain linear LM head, chunk by chunk, with the backward
    written out: for z = logits / T, d log p_t / dz = onehot(t) - p and dH/dz = -p (log p + H).
    The backward recomputes one chunk's logits at a time and accumulates the head's weight
    gradient into one buffer (no per-chunk [V, H] gradient, no autograd graph over [chunk, V]
    tensors). Under autocast the head's matmuls run in the autocast dtype, as autograd would."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, chunk_size, banned=None):
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type), autocast)
        ctx.temperature, ctx.with_entropy, ctx.chunk_size = temperature, with_entropy, chunk_size
        ctx.banned = banned
        lps, ents, log_zs = [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            z = _scaled_logits(hidden[start : start + chunk_size], weight, bias, temperature, banned)
            log_z = torch.logsumexp(z, dim=-1)
            lps.append(z.gather(-1, targets[start : start + chunk_size, None]).squeeze(-1) - log_z)
            if with_entropy:
                ents.append(log_z - (torch.softmax(z, dim=-1) * z).sum(-1))
            log_zs.append(log_z)
        lp, log_z = torch.cat(lps), torch.cat(log_zs)
        ent = torch.cat(ents) if with_entropy else torch.zeros_like(lp)
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, ent)
        ctx.param = weight if _into_param(weight) else None  # the leaf itself, to reach its .grad
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, bias, targets, log_z, ent = ctx.saved_tensors
        device_type, dtype, autocast = ctx.autocast
        mm_dtype = dtype if autocast else weight.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)  # bf16 weights accumulate in fp32
        grad_w = None
        if need_w and ctx.param is not None:  # see head_grad_into_param
            if ctx.param.grad is None:
                ctx.param.grad = torch.zeros_like(ctx.param)
            grad_w = ctx.param.grad
        elif need_w:
            grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
        grad_b = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        w = weight.to(mm_dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end]
            with torch.autocast(device_type, dtype=dtype, enabled=autocast):
                z = _scaled_logits(h, weight, bias, ctx.temperature, ctx.banned)
            # in place: one [chunk, V] buffer (two with the entropy's gradient) at a time
            log_p = z.sub_(log_z[start:end, None])
            g_lp = grad_lp[start:end, None]
            if ctx.with_entropy and grad_ent is not None:
                # g = -p * (g_lp + g_ent * (log p + H))
                g = log_p.exp()
                g.mul_(log_p.add_(ent[start:end, None]).mul_(grad_ent[start:end, None]).add_(g_lp)).neg_()
            else:
                g = log_p.exp_().mul_(-g_lp)
            g.scatter_add_(-1, targets[start:end, None], g_lp)
            if ctx.temperature != 1.0:
                g /= ctx.temperature
            g = g.to(mm_dtype)
            if need_h:
                grad_h[start:end] = (g @ w).to(hidden.dtype)
            if need_w and mm_dtype == acc_dtype:
                grad_w.addmm_(g.t(), h.to(mm_dtype))  # in place: one [V, H] buffer for all chunks
            elif need_w:
                grad_w += (g.t() @ h.to(mm_dtype)).to(acc_dtype)
            if need_b:
                grad_b += g.sum(0).to(grad_b.dtype)
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w and ctx.param is None else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
        )


def _scaled_logits(hidden, weight, bias, temperature, banned=None):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
    return _without(logits / temperature if temperature != 1.0 else logits, banned)


def chunked_token_stats(
    hidden, targets, head, *, temperature=1.0, with_entropy=False, chunk_size=256, banned=None
):
    """Apply the LM head in chunks of positions; each chunk is recomputed in backward instead of
    keeping its [chunk, V] logits alive. hidden [M, H], targets [M] -> ([M], [M]). `banned`
    token ids (never sampled) get probability 0: the distribution is the sampler's."""
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    if needs_grad and hidden.shape[0] and _plain_linear(head):
        return _LinearHeadStats.apply(
            hidden, head.weight, head.bias, targets, temperature, with_entropy, chunk_size, banned
        )
    outs_lp, outs_ent = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(
                _token_stats, h, t, head, temperature, with_entropy, banned, use_reentrant=False
            )
        else:
            lp, ent = _token_stats(h, t, head, temperature, with_entropy, banned)
        outs_lp.append(lp)
        outs_ent.append(ent)
    if not outs_lp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(outs_lp), torch.cat(outs_ent)
