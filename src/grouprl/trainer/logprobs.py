"""Per-token log-probabilities of responses under a causal LM, lean and group-aware.

Two paths give the same numbers and gradients:
- full sequences: every row runs prompt + response through the model (what most trainers do);
- shared prefix: the rows of a micro-batch that share a prompt (a GRPO group) run that prompt
  once; its KV cache is index-expanded to the rows, and only the responses run on top of it.
  Gradients flow back through the cache into the single prefix computation.
Either way the LM head is applied only at response positions, in chunks under activation
checkpointing, so the [tokens, vocab] float tensor never exists whole.

The prefix pass can also be run on its own (`prefix_forward`) and its output reused by several
micro-batches of one group: `Prefix.detached()` gives leaves the micro-batches backpropagate
into, and `Prefix.backward_from(leaves)` then runs the prefix's backward once with the summed
gradient. Both passes work under the model's gradient checkpointing: their KV caches are
replay-safe (a recomputed layer overwrites or re-reads the same states instead of appending).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grouprl.rollout.hf_engine import left_pad


@dataclass
class ResponseBatch:
    """Rows to score. Responses are right-padded to a common width R."""

    prompt_ids: list[list[int]]  # N prompts (rows of a group share an identical list)
    response_ids: torch.Tensor  # [N, R] long, padded with anything
    response_mask: torch.Tensor  # [N, R] 1 on real response tokens (observations included)


def _decoder_and_head(model):
    """The transformer body (returns hidden states) and the LM head, through a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def _token_stats(hidden: torch.Tensor, targets: torch.Tensor, head, temperature: float, with_entropy: bool):
    """hidden [M, H], targets [M] -> log_probs [M] (and entropy [M])."""
    logits = head(hidden)  # [M, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
    if temperature != 1.0:
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)  # [M]
    log_probs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    if not with_entropy:
        return log_probs, torch.zeros_like(log_probs)
    probs = torch.softmax(logits, dim=-1)
    entropy = log_z - (probs * logits).sum(-1)
    return log_probs, entropy


def chunked_token_stats(hidden, targets, head, *, temperature=1.0, with_entropy=False, chunk_size=256):
    """Apply the LM head in chunks of positions; each chunk is recomputed in backward instead of
    keeping its [chunk, V] logits alive. hidden [M, H], targets [M] -> ([M], [M])."""
    outs_lp, outs_ent = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_token_stats, h, t, head, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _token_stats(h, t, head, temperature, with_entropy)
        outs_lp.append(lp)
        outs_ent.append(ent)
    if not outs_lp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(outs_lp), torch.cat(outs_ent)


def _scatter_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place flat per-token values [M] back at the mask's 1-positions of a zero [N, R] tensor."""
    out = values.new_zeros(mask.shape)
    return out.masked_scatter(mask.bool(), values)


@dataclass
class Prefix:
    """The KV cache and last hidden state of U left-padded prompts (one per group)."""

    keys: list[torch.Tensor]  # per layer [U, kv_heads, L, head_dim]
    values: list[torch.Tensor]  # per layer [U, kv_heads, L, head_dim]
    last_hidden: torch.Tensor  # [U, H] predicts each prompt's first response token
    mask: torch.Tensor  # [U, L] attention mask (0 on left padding)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values, self.last_hidden]

    def detached(self) -> Prefix:
        """Leaves that gather the gradient of several micro-batches before one prefix backward."""
        leaf = lambda t: t.detach().requires_grad_(t.requires_grad)  # noqa: E731
        return Prefix(
            [leaf(k) for k in self.keys], [leaf(v) for v in self.values], leaf(self.last_hidden), self.mask
        )

    def backward_from(self, leaves: Prefix) -> None:
        """Backpropagate the gradient accumulated on `leaves` through the prefix pass (once)."""
        pairs = [(t, leaf.grad) for t, leaf in zip(self.tensors(), leaves.tensors()) if leaf.grad is not None]
        if pairs and pairs[0][0].requires_grad:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


class _RecordLayer(DynamicLayer):
    """Prefix pass: keeps the layer's keys/values; a replayed (checkpointed) layer overwrites them."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _ReadOnlyLayer(DynamicLayer):
    """Response pass: attends to the prefix plus the new states without storing them, so a replayed
    (checkpointed) layer sees exactly what the first pass saw."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def _cache_of(layers: list[DynamicLayer]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = layers
    return cache


@contextlib.contextmanager
def _cache_under_checkpointing(decoder):
    """Our caches are replay-safe, so checkpointed layers may keep them (HF drops caches otherwise)."""
    layers = [m for m in decoder.modules() if hasattr(type(m), "_can_checkpoint_with_cache")]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m in layers:
            del m._can_checkpoint_with_cache


def _num_layers(decoder) -> int:
    return len(decoder.layers)


def unique_prompts(prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Distinct prompts in first-seen order and, per row, the index of its prompt."""
    unique: dict[tuple[int, ...], int] = {}
    index = [unique.setdefault(tuple(p), len(unique)) for p in prompt_ids]
    return [list(p) for p in unique], index


def prefix_forward(model, prompts: list[list[int]], pad_token_id: int = 0) -> Prefix:
    """Run U prompts (left-padded) once; differentiable when grad is enabled."""
    decoder, _ = _decoder_and_head(model)
    device = next(model.parameters()).device
    prefix_ids, prefix_mask = left_pad(prompts, pad_token_id, device)  # [U, L]
    prefix_pos = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    cache = _cache_of([_RecordLayer() for _ in range(_num_layers(decoder))])
    with _cache_under_checkpointing(decoder):
        hidden = decoder(
            input_ids=prefix_ids,
            attention_mask=prefix_mask,
            position_ids=prefix_pos,
            past_key_values=cache,
            use_cache=False,  # our cache object is passed and filled all the same; True only warns under checkpointing
        ).last_hidden_state  # [U, L, H]
    return Prefix(
        keys=[layer.keys for layer in cache.layers],
        values=[layer.values for layer in cache.layers],
        last_hidden=hidden[:, -1],
        mask=prefix_mask,
    )


def response_log_probs(
    model,
    batch: ResponseBatch,
    *,
    shared_prefix: bool = True,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 256,
    pad_token_id: int = 0,
    prefix: Prefix | None = None,
    prefix_index: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(response_t | prompt, response_<t) and the entropy of that distribution,
    both [N, R] (zero at padding). Differentiable when grad is enabled.

    With `prefix` (from `prefix_forward`), row i continues prompt `prefix_index[i]` of it and
    `batch.prompt_ids` is not read."""
    decoder, head = _decoder_and_head(model)
    if prefix is not None:
        hidden_at, targets, mask = _hidden_on_prefix(decoder, prefix, prefix_index, batch)
    elif shared_prefix:
        prompts, index = unique_prompts(batch.prompt_ids)
        hidden_at, targets, mask = _hidden_on_prefix(
            decoder, prefix_forward(model, prompts, pad_token_id), index, batch
        )
    else:
        hidden_at, targets, mask = _full_sequence_hidden(decoder, batch, pad_token_id)
    lp, ent = chunked_token_stats(
        hidden_at, targets, head, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size
    )
    return _scatter_rows(lp, mask), _scatter_rows(ent, mask)


def _full_sequence_hidden(decoder, batch: ResponseBatch, pad_token_id: int):
    """Each row runs prompt + response: hidden states at the positions that predict response tokens."""
    device = batch.response_ids.device
    n, r = batch.response_ids.shape
    lengths = batch.response_mask.sum(-1).tolist()
    rows = [p + batch.response_ids[i, : int(lengths[i])].tolist() for i, p in enumerate(batch.prompt_ids)]
    width = max(len(x) for x in rows)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, x in enumerate(rows):  # right padding; positions are plain 0..len-1
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        attn[i, : len(x)] = 1
    ids, attn = ids.to(device), attn.to(device)
    hidden = decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # [N, W, H]
    # response token t of row i sits at P_i + t and is predicted by position P_i + t - 1
    prompt_len = torch.tensor([len(p) for p in batch.prompt_ids], device=device)
    pos = prompt_len[:, None] - 1 + torch.arange(r, device=device)[None, :]  # [N, R]
    mask = batch.response_mask.bool()
    pos = pos.clamp(max=width - 1)
    gathered = hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [N, R, H]
    return gathered[mask], batch.response_ids[mask], mask


def _hidden_on_prefix(decoder, prefix: Prefix, prefix_index: list[int], batch: ResponseBatch):
    """Responses run on their prompt's cache, index-expanded to the rows (the graph is kept)."""
    device = batch.response_ids.device
    n, r = batch.response_ids.shape
    index = torch.tensor(prefix_index, device=device)  # [N]
    cache = _cache_of(
        [
            _ReadOnlyLayer(k.index_select(0, index), v.index_select(0, index))
            for k, v in zip(prefix.keys, prefix.values)
        ]
    )
    row_prefix_mask = prefix.mask.index_select(0, index)  # [N, L]
    attn = torch.cat([row_prefix_mask, batch.response_mask.long()], dim=-1)  # [N, L + R]
    start = row_prefix_mask.sum(-1)  # [N] first response position
    resp_pos = start[:, None] + torch.arange(r, device=device)[None, :]
    with _cache_under_checkpointing(decoder):
        resp_hidden = decoder(
            input_ids=batch.response_ids,
            attention_mask=attn,
            position_ids=resp_pos,
            past_key_values=cache,
            use_cache=False,
        ).last_hidden_state  # [N, R, H]
    # token 0 is predicted by the prefix's last position, token t > 0 by response position t - 1
    first = prefix.last_hidden.index_select(0, index).unsqueeze(1)  # [N, 1, H]
    predictors = torch.cat([first, resp_hidden[:, :-1]], dim=1)  # [N, R, H]
    mask = batch.response_mask.bool()
    return predictors[mask], batch.response_ids[mask], mask
