"""Sampling shared by the engines and their sessions: the built-in engine's next-token draw
(`sample_next`) and left padding, and vLLM's per-request seeds drawn from the rows' streams
(`request_seeds`, `seeded`)."""

from __future__ import annotations

import copy

import torch

from grouprl.rollout.engines.base import SamplingParams
from grouprl.rollout.engines.streams import Randomness, RowStreams


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: Randomness,
    banned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row from logits [A, V] -> [A], with one uniform per row from
    `generator` (a torch generator, or the rows' own streams); `banned` token ids are never drawn
    (a VLM's image tokens: the distribution is renormalised over the others, as the update's
    log-probs are)."""
    if banned is not None and banned.numel():
        logits = logits.index_fill(-1, banned, float("-inf"))
    if params.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop tokens whose preceding mass already exceeds top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return _inverse_cdf_sample(logits.softmax(-1), generator)


def _inverse_cdf_sample(probs: torch.Tensor, generator: Randomness) -> torch.Tensor:
    """One draw per row of probs [A, V]: the first token whose cumulative probability exceeds
    u ~ U(0, total). Exact like torch.multinomial (a token of probability 0 is never drawn), and
    on a CPU several times faster, which matters at every decode step over a 50k vocabulary."""
    cdf = probs.cumsum(-1)
    if isinstance(generator, RowStreams):
        u = generator.uniform(probs.device, cdf.dtype)[:, None]
    else:
        u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding puts every row's last token at the end: [B, W] ids and attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def request_seeds(generator: Randomness, prompts: int, n: int) -> list[int] | None:
    """vLLM's seed for each of `prompts` requests of n samples (vLLM seeds a request's sample j
    with seed + j). From row streams: one draw of each request's first row, so a group's samples
    depend on its rows' keys alone, not on the call's other requests, its batching or the rank
    that runs it. From a torch generator: drawn in order. None: vLLM's own randomness."""
    if isinstance(generator, RowStreams):
        if len(generator) != prompts * n:
            raise ValueError(f"{len(generator)} row streams for {prompts} prompts x {n} samples")
        draws = generator.select([i * n for i in range(prompts)]).uniform(dtype=torch.float64)
        return [int(u * (2**31 - 1)) for u in draws.tolist()]
    if generator is not None:
        return torch.randint(0, 2**31 - 1, (prompts,), generator=generator).tolist()
    return None


def seeded(sampling, seed: int):
    """`sampling` for one request seeded with `seed` (a shallow copy, as vLLM's own `clone`
    makes where it may)."""
    params = copy.copy(sampling)
    params.seed = seed
    return params
