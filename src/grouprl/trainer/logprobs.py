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
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grouprl.rollout.engines.sampling import left_pad
from grouprl.trainer.head_stats import chunked_token_stats


@dataclass
class ResponseBatch:
    """Rows to score. Responses are right-padded to a common width R."""

    prompt_ids: list[list[int]]  # N prompts (rows of a group share an identical list)
    response_ids: torch.Tensor  # [N, R] long, padded with anything
    response_mask: torch.Tensor  # [N, R] 1 on real response tokens (observations included)
    # VLM policies: each row's images (grouprl.vision ImageInput), in the order of their tokens,
    # in the prompt and in the response (image observations of multi-turn agents)
    prompt_images: list[list] | None = None
    response_images: list[list] | None = None

    def prompt_keys(self) -> list | None:
        return prompt_keys(self.prompt_ids, self.prompt_images)


def prompt_keys(prompt_ids: list[list[int]], prompt_images: list[list] | None) -> list | None:
    """Per row, what makes two prompts the same prompt: their token ids and, for a VLM, their
    images (equal ids with other images are another prompt); None for text (the ids do)."""
    if not prompt_images:
        return None
    return [(tuple(p), tuple(im.key for im in images)) for p, images in zip(prompt_ids, prompt_images)]


@contextlib.contextmanager
def block_masks(model, enabled: bool = True):
    """Within the block, a model whose attention takes padding masks only (flash-attention's
    kernels: `model.attn_implementation=flash_attention_2`) attends through `sdpa`, which takes
    the shared-prefix path's block masks ([rows, 1, queries, keys]: each packed response sees
    its prompt and itself); a flash kernel given one would read it as a padding mask. Covers
    backward too (checkpointed layers recompute inside it). Yields the configs switched."""
    configs = []
    if enabled:
        seen = set()
        for module in model.modules():
            config = getattr(module, "config", None)
            name = getattr(config, "_attn_implementation", None) or ""
            if id(config) not in seen and "flash" in name:
                seen.add(id(config))
                configs.append((config, name))
    for config, _ in configs:
        config._attn_implementation_internal = "sdpa"
    try:
        yield [name for _, name in configs]
    finally:
        for config, name in configs:
            config._attn_implementation_internal = name


def _decoder_and_head(model):
    """The transformer body (returns hidden states) and the LM head, through a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


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
    next_pos: list[int] | None = None  # [U] position of each prompt's first response token (VLMs)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values, self.last_hidden]

    def detached(self) -> Prefix:
        """Leaves that gather the gradient of several micro-batches before one prefix backward."""
        leaf = lambda t: t.detach().requires_grad_(t.requires_grad)  # noqa: E731
        return Prefix(
            [leaf(k) for k in self.keys],
            [leaf(v) for v in self.values],
            leaf(self.last_hidden),
            self.mask,
            self.next_pos,
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


class _OpenedRecordLayer(DynamicLayer):
    """Prefix pass on top of a shared opening: attends to the opening's keys/values (one row,
    broadcast to the prompts) plus the new states, and keeps the joined keys/values."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.opening = (keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1))
        self.keys, self.values = self.opening

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys = torch.cat([self.opening[0], key_states], dim=-2)
        self.values = torch.cat([self.opening[1], value_states], dim=-2)
        return self.keys, self.values


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


def unique_prompts(
    prompt_ids: list[list[int]], keys: list | None = None
) -> tuple[list[list[int]], list[int]]:
    """Distinct prompts in first-seen order and, per row, the index of its prompt (prompts are
    the same when their `keys` are, default their token ids)."""
    keys = keys if keys is not None else [tuple(p) for p in prompt_ids]
    unique: dict = {}
    first: list[int] = []
    index = []
    for r, k in enumerate(keys):
        if k not in unique:
            unique[k] = len(unique)
            first.append(r)
        index.append(unique[k])
    return [list(prompt_ids[r]) for r in first], index


OPENING_MIN_TOKENS = 16
"""A batch's prompts share an opening (system prompt, example turns) worth running once when it
is at least this long."""


def shared_opening(prompts: list[list[int]], min_tokens: int = OPENING_MIN_TOKENS) -> list[int]:
    """The longest opening that two or more distinct prompts all start with, leaving each at
    least one token of its own; [] when shorter than `min_tokens` or fewer than two prompts."""
    distinct = {tuple(p) for p in prompts}
    if len(distinct) < 2:
        return []
    first, n = prompts[0], min(len(p) for p in distinct) - 1
    for p in distinct:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return list(first[:n]) if n >= min_tokens else []


def prefix_forward(
    model,
    prompts: list[list[int]],
    pad_token_id: int = 0,
    opening: Prefix | None = None,
    vision=None,
    images: list[list] | None = None,
) -> Prefix:
    """Run U prompts (left-padded) once; differentiable when grad is enabled. With `opening`
    (this function's result for one prompt that every prompt starts with, without padding) only
    the rest of each prompt runs, on the opening's keys/values; the result is the same Prefix.
    With `vision` (a VLM family) the prompts' `images` enter as embeddings (the opening holds
    none), at the family's positions."""
    decoder, _ = _decoder_and_head(model)
    device = next(model.parameters()).device
    start = 0 if opening is None else opening.mask.shape[1]
    prefix_ids, prefix_mask = left_pad([p[start:] for p in prompts], pad_token_id, device)  # [U, L]
    next_pos = None
    if vision is None:
        inputs = {"input_ids": prefix_ids}
        prefix_pos = start + (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    else:
        images = images if images is not None else [[] for _ in prompts]
        inputs = {"inputs_embeds": vision.embed(model, prefix_ids, [im for row in images for im in row])}
        prefix_pos = vision.batch_positions(prefix_ids, prefix_mask, images, [start] * len(prompts))
        rows = prefix_pos if prefix_pos.dim() == 2 else prefix_pos.amax(0)
        next_pos = (rows.masked_fill(prefix_mask == 0, -1).amax(-1) + 1).tolist()
    if opening is None:
        cache = _cache_of([_RecordLayer() for _ in range(_num_layers(decoder))])
    else:
        rows = len(prompts)
        cache = _cache_of([_OpenedRecordLayer(k, v, rows) for k, v in zip(opening.keys, opening.values)])
        prefix_mask = torch.cat([opening.mask.expand(rows, -1), prefix_mask], -1)  # [U, start + L]
    with _cache_under_checkpointing(decoder):
        hidden = decoder(
            **inputs,
            attention_mask=prefix_mask,
            position_ids=prefix_pos,
            past_key_values=cache,
            use_cache=False,  # our cache object is passed and filled all the same; True only warns under checkpointing
        ).last_hidden_state  # [U, L, H]
    keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    _gather_for_backward(decoder, keys, values)
    return Prefix(keys=keys, values=values, last_hidden=hidden[:, -1], mask=prefix_mask, next_pos=next_pos)


def _gather_for_backward(decoder, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """A layer FSDP shards gathers its weights for backward when the gradient reaches its output;
    a prefix's keys and values leave the layer another way (its cache), and the last layer's
    output has no gradient at all in a prefix's backward (`Prefix.backward_from`), so each layer
    is gathered too when the gradient reaches its keys or values (nothing if it is whole)."""
    if not torch.is_grad_enabled():
        return
    for layer, k, v in zip(decoder.layers, keys, values):
        if hasattr(layer, "unshard"):  # an FSDP2 module
            for t in (k, v):
                if t.requires_grad:
                    t.register_hook(lambda grad, layer=layer: layer.unshard())


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
    opening: Prefix | None = None,
    vision=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(response_t | prompt, response_<t) and the entropy of that distribution,
    both [N, R] (zero at padding). Differentiable when grad is enabled.

    With `prefix` (from `prefix_forward`), row i continues prompt `prefix_index[i]` of it and
    `batch.prompt_ids` is not read. With `opening` (shared prefix only), the prompts' common
    opening has been run already (see `prefix_forward`). With `vision` (the VLM family of the
    policy) the batch's images enter every pass as generation fed them, and the tokens the
    sampler never draws (image tokens) have probability 0 here too."""
    decoder, head = _decoder_and_head(model)
    banned = torch.tensor(vision.never_sampled(), dtype=torch.long) if vision is not None else None
    if prefix is not None:
        hidden_at, targets, mask = _hidden_on_prefix(decoder, prefix, prefix_index, batch, vision, model)
    elif shared_prefix:
        prompts, index = unique_prompts(batch.prompt_ids, batch.prompt_keys())
        images = None
        if vision is not None:
            first_row = {u: i for i, u in reversed(list(enumerate(index)))}
            images = [
                batch.prompt_images[first_row[u]] if batch.prompt_images else [] for u in range(len(prompts))
            ]
        prefix = prefix_forward(model, prompts, pad_token_id, opening, vision, images)
        hidden_at, targets, mask = _hidden_on_prefix(decoder, prefix, index, batch, vision, model)
    else:
        hidden_at, targets, mask = _full_sequence_hidden(decoder, batch, pad_token_id, vision, model)
    lp, ent = chunked_token_stats(
        hidden_at,
        targets,
        head,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
        banned=banned,
    )
    return _scatter_rows(lp, mask), _scatter_rows(ent, mask)


def _row_images(batch: ResponseBatch, i: int) -> list:
    """Row i's images in the order of its tokens: the prompt's, then the response's."""
    return (batch.prompt_images[i] if batch.prompt_images else []) + (
        batch.response_images[i] if batch.response_images else []
    )


def _full_sequence_hidden(decoder, batch: ResponseBatch, pad_token_id: int, vision=None, model=None):
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
    if vision is None:
        hidden = decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # [N, W, H]
    else:
        images = [_row_images(batch, i) for i in range(n)]
        hidden = decoder(
            inputs_embeds=vision.embed(model, ids, [im for row in images for im in row]),
            attention_mask=attn,
            position_ids=vision.batch_positions(ids, attn, images),
            use_cache=False,
        ).last_hidden_state
    # response token t of row i sits at P_i + t and is predicted by position P_i + t - 1
    prompt_len = torch.tensor([len(p) for p in batch.prompt_ids], device=device)
    pos = prompt_len[:, None] - 1 + torch.arange(r, device=device)[None, :]  # [N, R]
    mask = batch.response_mask.bool()
    pos = pos.clamp(max=width - 1)
    gathered = hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [N, R, H]
    return gathered[mask], batch.response_ids[mask], mask


PACK_TOKENS = 512
"""A packed row holds responses of one prompt up to max(this, the longest response) tokens: the
padding of unequal responses goes away, while a query attends to at most prompt + 512 keys
(attention stays small next to the MLPs at that length). 0: one response per row, padded."""


def _pack(lengths: list[int], prefix_of_row: list[int], capacity: int) -> list[tuple[int, list[int]]]:
    """Rows into bins of one prefix each, first-fit by decreasing length: [(prefix, [rows])].
    capacity 0: a bin per row, in row order."""
    if capacity <= 0:
        return [(u, [i]) for i, u in enumerate(prefix_of_row)]
    bins: list[tuple[int, list[int]]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, (u, rows) in enumerate(bins):
            if u == prefix_of_row[i] and room[b] >= lengths[i]:
                rows.append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append((prefix_of_row[i], [i]))
            room.append(capacity - lengths[i])
    return bins


def _hidden_on_prefix(
    decoder, prefix: Prefix, prefix_index: list[int], batch: ResponseBatch, vision=None, model=None
):
    """Responses run on their prompt's cache, packed: the responses of one prompt are laid end to
    end in one row (several rows when long), each attending to the prompt and causally to itself
    only, so no padding is computed and the prompt's cache is repeated per packed row, not per
    response. The graph through the cache is kept. With `vision`, a response's positions follow
    its prompt's (multimodal rope runs ahead of the token count after an image) and its image
    observations enter as embeddings."""
    device = batch.response_ids.device
    mask = batch.response_mask.bool()
    lengths = mask.sum(-1).tolist()
    bins = _pack(lengths, prefix_index, PACK_TOKENS and max(PACK_TOKENS, max(lengths, default=1)))
    width = max(1, max(sum(lengths[i] for i in rows) for _, rows in bins))
    n_bins, n_prefix = len(bins), prefix.last_hidden.shape[0]
    ids = torch.zeros((n_bins, width), dtype=torch.long, device=device)
    dims = vision.position_dims if vision is not None else 1
    pos = torch.zeros((dims, n_bins, width) if dims > 1 else (n_bins, width), dtype=torch.long, device=device)
    bin_images: list = []  # response images in the order of their tokens in the packed rows
    segment = torch.full((n_bins, width), -1, dtype=torch.long, device=device)
    start = prefix.next_pos or prefix.mask.sum(-1).tolist()  # [U] first response position of each prompt
    predictor = []  # per row, where the hidden states predicting its tokens sit (see below)
    where = [None] * len(lengths)
    for b, (u, rows) in enumerate(bins):
        offset = 0
        for i in rows:
            n = lengths[i]
            ids[b, offset : offset + n] = batch.response_ids[i, :n]
            if vision is None:
                pos[b, offset : offset + n] = torch.arange(start[u], start[u] + n, device=device)
            else:
                images = batch.response_images[i] if batch.response_images else []
                row = vision.row_positions(batch.response_ids[i, :n].tolist(), images, start[u]).to(device)
                pos[..., b, offset : offset + n] = row
                bin_images.extend(images)
            segment[b, offset : offset + n] = i
            where[i] = (u, b * width + offset)
            offset += n
    for i, n in enumerate(lengths):
        if n:  # token 0 is predicted by the prompt's last position, token t > 0 by packed slot t - 1
            u, flat = where[i]
            predictor.append(torch.tensor([u], device=device))
            predictor.append(n_prefix + flat + torch.arange(n - 1, device=device))
    used = torch.tensor([u for u, _ in bins], device=device)
    keys = [k.index_select(0, used) for k in prefix.keys]
    values = [v.index_select(0, used) for v in prefix.values]
    # [bins, 1, width, L + width]: the bin's prompt (its real tokens), then its own segment, causally;
    # a padding slot sees itself only (its output is never read)
    same = (segment[:, :, None] == segment[:, None, :]) & torch.ones(
        (width, width), dtype=torch.bool, device=device
    ).tril()
    same |= torch.eye(width, dtype=torch.bool, device=device) & (segment < 0)[:, :, None]
    attn = torch.cat([prefix.mask.bool().index_select(0, used)[:, None, :].expand(-1, width, -1), same], -1)
    inputs = {"input_ids": ids} if vision is None else {"inputs_embeds": vision.embed(model, ids, bin_images)}
    with _cache_under_checkpointing(decoder):
        hidden = decoder(
            **inputs,
            attention_mask=attn[:, None],
            position_ids=pos,
            past_key_values=_cache_of([_ReadOnlyLayer(k, v) for k, v in zip(keys, values)]),
            use_cache=False,
        ).last_hidden_state  # [bins, width, H]
    flat = torch.cat([prefix.last_hidden, hidden.reshape(n_bins * width, -1)])
    index = torch.cat(predictor) if predictor else torch.zeros(0, dtype=torch.long, device=device)
    return flat.index_select(0, index), batch.response_ids[mask], mask
