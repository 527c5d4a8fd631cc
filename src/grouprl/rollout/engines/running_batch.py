"""The built-in engine's running batch (`RunningSession`'s, the agent's `trajectory` schedule): a
KV cache of a slot a running row, each row writing at its own column, so rows join and leave
without moving the others; a step feeds each running row one token, and the rows that join in
it their new tokens beside them (one pass over a ragged sequence: `ragged_attention` lets each
token attend to its own row's slot)."""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from grouprl import cpu
from grouprl.cpu.lean_attention import DECODE
from grouprl.cpu.small_matmul import usual_products


class SlotLayer(DynamicLayer):
    """One layer of a `RunningBatch`'s cache, as the model sees it: a decode step writes each running
    row's key and value at that row's own next column and reads the batch's first `width` + 1
    columns (the masked ones hold zeros or an earlier row's finite numbers)."""

    def __init__(self, batch: RunningBatch, index: int):
        super().__init__()
        self.batch, self.index = batch, index
        self.dtype, self.device, self.is_initialized = batch.dtype, batch.device, True
        self._view()

    def _view(self) -> None:
        b = self.batch
        self.keys = b.keys[self.index][: b.size, :, : b.width + 1]
        self.values = b.values[self.index][: b.size, :, : b.width + 1]

    def update(self, key_states, value_states, *args, **kwargs):
        b = self.batch
        keys, values = b.keys[self.index], b.values[self.index]
        # in the cache's dtype (the prefill's: under autocast the step's may be lower, and a plain
        # cache layer's in-place write casts the same way)
        if b.ragged is not None:  # [1, H, N, D]: token i at (its row's slot, its column)
            slots, cols = b.ragged.slots, b.ragged.cols
            keys[slots, :, cols] = key_states[0].transpose(0, 1).to(keys.dtype)
            values[slots, :, cols] = value_states[0].transpose(0, 1).to(values.dtype)
            return keys, values  # read by ragged_attention, per row
        if key_states.shape[-2] != 1:
            raise ValueError("a running batch takes one token a row: rows join through their own prefill")
        slots, cols = b.slots[: b.size], b.cols[: b.size]
        keys[slots, :, cols] = key_states[:, :, 0].to(keys.dtype)  # [A, H, D] at each row's column
        values[slots, :, cols] = value_states[:, :, 0].to(values.dtype)
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.batch.width


class RunningBatch:
    """The running rows' KV cache, a slot a row: per layer [slots, H, length, D] keys and values,
    the attention mask [slots, length], each row's next column (`cols`) and next position
    (`pos`). Rows 0..size-1 run; a row that leaves is replaced by the last one (that one row's
    cache copied), a row that joins takes slot `size`. Rows write at their own columns, so
    nobody moves when another joins with a longer or shorter context; `width` is the furthest
    column any running row writes next."""

    def __init__(self, template: DynamicCache, slots: int, length: int):
        first = template.layers[0].keys
        self.device, self.dtype = first.device, first.dtype
        self.heads = [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) for layer in template.layers]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.size, self.col_list = 0, []  # running rows; their next columns on the host
        self.ragged: _Ragged | None = None  # set during a forward that prefills joining rows
        self._allocate(slots, length)
        self.cache = DynamicCache()
        self.cache.layers = [SlotLayer(self, j) for j in range(len(self.heads))]

    @property
    def width(self) -> int:
        return max(self.col_list, default=0)

    def _allocate(self, slots: int, length: int) -> None:
        """Buffers of `slots` x `length`, the running rows' part copied over."""
        old = (self.keys, self.values, getattr(self, "mask", None))
        zeros = lambda *shape, dtype=None: torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)  # noqa: E731
        self.keys = [zeros(slots, h, length, dk) for h, dk, _ in self.heads]
        self.values = [zeros(slots, h, length, dv) for h, _, dv in self.heads]
        self.mask = zeros(slots, length, dtype=torch.long)
        cols, pos = getattr(self, "cols", None), getattr(self, "pos", None)
        self.cols, self.pos = zeros(slots, dtype=torch.long), zeros(slots, dtype=torch.long)
        self.slots = torch.arange(slots, device=self.device)
        if old[2] is not None and self.size:
            a, w = self.size, self.width
            for new, was in zip(self.keys + self.values, old[0] + old[1]):
                new[:a, :, :w] = was[:a, :, :w]
            self.mask[:a, :w] = old[2][:a, :w]
            self.cols[:a], self.pos[:a] = cols[:a], pos[:a]

    def join(self, cache: DynamicCache, attention_mask: torch.Tensor, next_pos: torch.Tensor, room: int) -> None:
        """Rows prefilled in `cache` ([J, H, W, D] a layer, `attention_mask` [J, W]) take the next
        slots, with room for `room` more tokens each."""
        joining, width = attention_mask.shape
        slots, length = self.mask.shape
        if self.size + joining > slots or width + room > length:  # grown by half at least: few copies
            more_slots = slots if self.size + joining <= slots else max(self.size + joining, slots * 3 // 2)
            self._allocate(more_slots, length if width + room <= length else max(width + room, length * 3 // 2))
        a, b = self.size, self.size + joining
        for j, layer in enumerate(cache.layers):
            self.keys[j][a:b, :, :width] = layer.keys
            self.values[j][a:b, :, :width] = layer.values
        self.mask[a:b] = 0
        self.mask[a:b, :width] = attention_mask
        self.cols[a:b], self.pos[a:b] = width, next_pos
        self.size, self.col_list = b, self.col_list + [width] * joining

    def parked(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Slot `slot`'s cache, holes removed: per layer ([H, L, D] keys, values), a copy."""
        real = self.mask[slot, : self.col_list[slot]].nonzero().squeeze(-1)  # [L] its real tokens' columns
        return [(k[slot].index_select(1, real), v[slot].index_select(1, real)) for k, v in zip(self.keys, self.values)]

    def leave(self, slot: int) -> None:
        """The row in `slot` leaves; the last running row moves into its slot."""
        last = self.size - 1
        if slot != last:
            w = self.col_list[last]
            for buffer in self.keys + self.values:
                buffer[slot, :, :w] = buffer[last, :, :w]
            self.mask[slot] = self.mask[last]
            self.cols[slot], self.pos[slot] = self.cols[last], self.pos[last]
            self.col_list[slot] = self.col_list[last]
        self.col_list.pop()
        self.size = last

    def forward(self, model, tokens: torch.Tensor, joining: list[tuple] = ()) -> torch.Tensor:
        """Feed each running row its token [A] at its column -> logits [A, V]; with `joining`
        [(parked cache or None, new tokens, position of the first, room for more tokens), ...],
        those rows take the next slots and their tokens go through the same pass -> logits
        [A + J, V] (theirs after their last token)."""
        if joining:
            return self._forward_joining(model, tokens, joining)
        a = self.size
        self.mask[self.slots[:a], self.cols[:a]] = 1
        width = self.width
        for layer in self.cache.layers:
            layer._view()
        out = model(
            input_ids=tokens.unsqueeze(-1),
            attention_mask=self.mask[:a, : width + 1],
            position_ids=self.pos[:a].unsqueeze(-1),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cols[:a] += 1
        self.pos[:a] += 1
        self.col_list = [c + 1 for c in self.col_list]
        return out.logits[:, -1, :]

    def _forward_joining(self, model, tokens: torch.Tensor, joining: list[tuple]) -> torch.Tensor:
        """One pass over the running rows' tokens and the joining rows' new tokens, laid out as one
        sequence [1, A + sum T]; `ragged_attention` gives each its own row's keys."""
        a, device = self.size, self.device
        lengths = [p[0][0].shape[1] if p else 0 for p, _, _, _ in joining]  # each joining row's cached tokens
        feeds = [len(ids) for _, ids, _, _ in joining]
        need = max(n + t + room for n, t, (_, _, _, room) in zip(lengths, feeds, joining))
        slots, length = self.mask.shape
        if a + len(joining) > slots or need > length:
            more_slots = slots if a + len(joining) <= slots else max(a + len(joining), slots * 3 // 2)
            self._allocate(more_slots, length if need <= length else max(need, length * 3 // 2))
        plan = _Ragged(a)
        ids, slot_ids, col_ids, positions = [tokens], [self.slots[:a]], [self.cols[:a]], [self.pos[:a]]
        start = a
        for k, ((parked, new, first, _), cached, fed) in enumerate(zip(joining, lengths, feeds)):
            slot = a + k
            for j, (keys, values) in enumerate(parked or []):
                self.keys[j][slot, :, :cached] = keys
                self.values[j][slot, :, :cached] = values
            self.mask[slot] = 0
            self.mask[slot, : cached + fed] = 1
            columns = torch.arange(cached, cached + fed, device=device)
            ids.append(torch.tensor(new, dtype=torch.long, device=device))
            slot_ids.append(torch.full((fed,), slot, dtype=torch.long, device=device))
            col_ids.append(columns)
            positions.append(columns - cached + first)
            # causal: the feed's token i sees the row's cached tokens and the feed's first i + 1
            causal = torch.arange(cached + fed, device=device)[None, :] <= columns[:, None]  # [T, L + T]
            plan.joining.append((slot, start, fed, cached + fed, causal[None, None]))
            start += fed
        plan.slots, plan.cols = torch.cat(slot_ids), torch.cat(col_ids)
        if a:
            self.mask[self.slots[:a], self.cols[:a]] = 1
            plan.width = max(self.col_list) + 1
            plan.decode_mask = self.mask[:a, : plan.width].bool()[:, None, None, :]
        keep = torch.tensor(list(range(a)) + [s + t - 1 for _, s, t, _, _ in plan.joining], device=device)
        self.ragged = plan
        _current.batch = self
        try:
            with cpu.attention_named(model, RAGGED, SDPA), usual_products():
                out = model(
                    input_ids=torch.cat(ids)[None],
                    position_ids=torch.cat(positions)[None],
                    past_key_values=self.cache,
                    use_cache=True,
                    logits_to_keep=keep,
                )
        finally:
            self.ragged = _current.batch = None
        self.cols[:a] += 1
        self.pos[:a] += 1
        self.col_list = [c + 1 for c in self.col_list]
        for k, ((_, _, first, _), cached, fed) in enumerate(zip(joining, lengths, feeds)):
            self.cols[a + k], self.pos[a + k] = cached + fed, first + fed
            self.col_list.append(cached + fed)
        self.size = a + len(joining)
        return out.logits[0]


class _Ragged:
    """What `ragged_attention` needs for one pass: each token's slot and column, the running
    rows' count, read width and mask, and per joining row (slot, first token in the sequence,
    its tokens, columns it reads, causal mask)."""

    def __init__(self, decoding: int):
        self.decoding, self.width, self.decode_mask = decoding, 0, None
        self.slots = self.cols = None
        self.joining: list[tuple[int, int, int, int, torch.Tensor]] = []


_current = threading.local()  # the RunningBatch whose ragged pass runs on this thread
RAGGED = "grouprl_ragged"
SDPA = ("sdpa", DECODE)  # inside cpu.fast_decode a CPU model's sdpa is the latter


def ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention for `RunningBatch._forward_joining` (transformers' attention-function signature;
    query [1, H, N, D]): the running rows' tokens attend as in a decode step, each joining row's
    tokens causally over its own slot; each part through transformers' `sdpa` function.
    -> ([1, N, H, D], None)."""
    batch = _current.batch
    plan, keys, values = batch.ragged, batch.keys[module.layer_idx], batch.values[module.layer_idx]
    parts, a = [], plan.decoding
    if a:
        q = query[0, :, :a].transpose(0, 1).unsqueeze(2)  # [A, H, 1, D]
        k, v = keys[:a, :, : plan.width], values[:a, :, : plan.width]
        out, _ = sdpa_attention_forward(module, q, k, v, plan.decode_mask, dropout=dropout, scaling=scaling)
        parts.append(out.transpose(0, 1))  # [A, 1, H, D] -> [1, A, H, D]
    for slot, start, fed, width, causal in plan.joining:
        q = query[:, :, start : start + fed]
        k, v = keys[slot : slot + 1, :, :width], values[slot : slot + 1, :, :width]
        out, _ = sdpa_attention_forward(module, q, k, v, causal, dropout=dropout, scaling=scaling)
        parts.append(out)  # [1, T, H, D]
    return torch.cat(parts, dim=1), None


AttentionInterface.register(RAGGED, ragged_attention)


def joins_in_step(engine) -> bool:
    """Whether a returning row's tokens can go through the running rows' decode step: a text
    model on `sdpa` attention whose attention layers know their index (as transformers' do; its
    layers call the attention function their config names)."""
    model = engine.model
    config = getattr(model, "config", None)
    if getattr(engine, "vision", None) is not None or getattr(config, "_attn_implementation", None) not in SDPA:
        return False
    return any(hasattr(m, "layer_idx") and hasattr(m, "scaling") for m in model.modules())
