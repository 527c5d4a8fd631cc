"""The built-in engine: batched sampling with a Hugging Face causal LM: KV cache, temperature / top-k / top-p,
EOS and stop strings, continuing from any token prefix.

A group's n samples share one prompt, so the prompt is prefilled once and its KV cache is
expanded n times (`share_prompt_prefill`); finished sequences leave the batch, so they stop
costing compute.

Multi-turn agents use `open_session`: a session (hf_session.py) keeps every trajectory's KV cache
between turns, so each turn prefills only the tokens appended since the last one, and runs the
turns either together (`generate`) or in one batch they join and leave one by one (`submit` /
`step`: continuous batching).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grouprl import cpu
from grouprl.rollout.engines.base import Generation, GroupDone, ReprefillSession, SamplingParams, WeightOffers
from grouprl.rollout.engines.sampling import left_pad, sample_next
from grouprl.rollout.engines.streams import Randomness, for_rows


def _common_prefix_length(rows: list[list[int]]) -> int:
    first, length = rows[0], min(len(r) for r in rows)
    for row in rows[1:]:
        k = 0
        while k < length and row[k] == first[k]:
            k += 1
        length = k
    return length


def _first(ids: list[int], token: int) -> int:
    """Index of `token`'s first occurrence in `ids`, or len(ids)."""
    return next((i for i, t in enumerate(ids) if t == token), len(ids))


class _RoomyLayer(DynamicLayer):
    """A full-attention cache layer with room reserved for the tokens still to come: a decode step
    writes its keys and values in place instead of concatenating the whole cache anew (a copy of
    every row's cache per layer and token). `keys` / `values` are views of the filled part."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self._store(keys, values, room)

    def _store(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        b, h, length, d = keys.shape
        self._k = keys.new_empty((b, h, length + room, d))
        self._v = values.new_empty((b, values.shape[1], length + room, values.shape[-1]))
        self._k[:, :, :length], self._v[:, :, :length] = keys, values
        self._view(length)

    def _view(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self._k[:, :, :length], self._v[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        new = key_states.shape[-2]
        if self.length + new > self._k.shape[-2]:  # out of room: move to a larger buffer
            self._store(self.keys, self.values, max(new, self._k.shape[-2]))
        self._k[:, :, self.length : self.length + new] = key_states
        self._v[:, :, self.length : self.length + new] = value_states
        self._view(self.length + new)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            self._view(max(0, self.length + tokens_to_remove))
        elif tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k, self._v = self._k.repeat_interleave(repeats, 0), self._v.repeat_interleave(repeats, 0)
        self._view(self.length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k.index_select(0, indices), self._v.index_select(0, indices)
        self._view(self.length)


def _reserve_room(cache: DynamicCache, room: int) -> None:
    """Give the plain full-attention layers of `cache` room for `room` more tokens (others stay)."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            cache.layers[i] = _RoomyLayer(layer.keys, layer.values, room)


class HFEngine:
    """RolloutEngine over the trainer's own transformers model (CPU and GPU): nothing to sync
    after an update, the next rollout runs on the weights the update left."""

    reads_trainer_weights = True  # RolloutEngine: it generates with `model` itself
    push_seconds = 0.0  # nothing is ever pushed
    last_sleep_freed_bytes = 0  # it never sleeps

    def __init__(
        self,
        model,
        tokenizer,
        *,
        share_prompt_prefill: bool = True,
        max_batch: int = 0,
        min_common_prefix: int = 16,
        vision=None,
        report_log_probs: bool = False,
    ):
        """`vision`: the policy's VLM family (grouprl.vision.families) when it reads images:
        prompts then come with their images, and image tokens are never sampled.
        `report_log_probs`: each Generation carries the log-prob of every sampled token under
        the sampling distribution at the temperature (before top-k / top-p), as the update
        computes it (the trainer turns it on wherever the two can differ: bf16)."""
        self.model = model
        self.report_log_probs = report_log_probs
        self.vision = vision
        self.banned = (
            torch.tensor(vision.never_sampled(), dtype=torch.long) if vision is not None else None
        )
        self.min_common_prefix = min_common_prefix
        self.tokenizer = tokenizer
        self.share_prompt_prefill = share_prompt_prefill
        self.max_batch = max_batch
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        eos_ids = set([eos] if isinstance(eos, int) else list(eos or []))
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos_ids)
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        )
        # tokens fed to the model so far (real tokens, padding not counted): what KV reuse saves
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.policy_version: int | None = None  # RolloutEngine: the version weights_updated named
        self.offers = WeightOffers()  # newer weights offered between turns
        self.running_turns = 0  # turns in a session's running batch (RunningSession): offers wait for them

    def _may_end_stop(self, token_id: int, stop_ends: set[str]) -> bool:
        """Cheap filter before decoding a tail: can this token's text end a stop string? Printable
        ASCII other than spaces survives byte-level BPE / SentencePiece token spelling unchanged;
        anything else is always checked."""
        if any(c.isspace() or not (c.isascii() and c.isprintable()) for c in stop_ends):
            return True
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        return piece is None or any(c in piece for c in stop_ends)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: Randomness = None,
        on_group_done: GroupDone | None = None,
        images: list[list] | None = None,
    ) -> list[Generation]:
        """Sample n continuations of every prompt (`generator`: a torch generator, or one
        stream per output row); output order is prompt-major
        (prompt 0 samples 0..n-1, prompt 1 ...). `on_group_done(i, generations)` is called as
        soon as prompt i's n samples have all ended (e.g. to start scoring them) while the
        other prompts are still decoding. `images[i]`: prompt i's images (`ImageInput`s, in
        the order of their tokens), for a VLM policy."""
        if not prompts:
            return []
        self.between_turns()
        per_call = max(1, self.max_batch // n) if self.max_batch else len(prompts)
        out: list[Generation] = []
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start : start + per_call]
            chunk_images = images[start : start + per_call] if images is not None else None
            rows = range(start * n, (start + len(chunk)) * n)
            out.extend(
                self._generate_chunk(chunk, n, params, for_rows(generator, rows), on_group_done, start, chunk_images)
            )
        return out

    def _generation(self, token_ids: list[int], finish_reason: str, log_probs=None, version=-1) -> Generation:
        """`version`: the policy version the turn sampled from (-1: the engine's now)."""
        return Generation(
            token_ids=token_ids,
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
            finish_reason=finish_reason,
            log_probs=log_probs,
            version=self.policy_version if version == -1 else version,
        )

    def _generate_chunk(
        self, prompts, n, params, generator, on_group_done=None, group_offset=0, images=None
    ) -> list[Generation]:
        model = self.model
        was_training = model.training
        model.eval()
        if not self.share_prompt_prefill and n > 1:
            prompts = [p for p in prompts for _ in range(n)]
            images = [x for x in images for _ in range(n)] if images is not None else None
            expand = 1
        else:
            expand = n
        cache, logits, attention_mask, next_pos = self._prefill_prompts(prompts, expand, images)
        total = logits.shape[0]  # rows are prompt-major either way: row r belongs to group r // n
        tokens: list[list[int]] = [[] for _ in range(total)]
        finish = ["length"] * total
        lps = [[] for _ in range(total)] if self.report_log_probs else None
        done: dict[int, Generation] = {}
        on_done = None
        if on_group_done is not None:
            remaining = [n] * (total // n)

            def on_done(batch_rows, out_rows, cache, attention_mask):
                for r in out_rows:
                    done[r] = self._generation(tokens[r], finish[r], lps[r] if lps else None)
                    remaining[r // n] -= 1
                    if remaining[r // n] == 0:
                        g = r // n
                        on_group_done(group_offset + g, [done[k] for k in range(g * n, (g + 1) * n)])

        self._decode(cache, logits, attention_mask, next_pos, params, generator, on_done, tokens, finish, lps)
        if was_training:
            model.train()
        return [
            done.get(r) or self._generation(t, f, lps[r] if lps else None)
            for r, (t, f) in enumerate(zip(tokens, finish))
        ]

    def _prefill_prompts(self, prompts: list[list[int]], expand: int, images: list[list] | None = None):
        """Prefill `prompts` (each then repeated `expand` times; `images[i]`: prompt i's images)
        into a fresh cache.
        -> (cache, logits [B*expand, V], attention_mask [B*expand, W], next_pos [B*expand])."""
        model, device = self.model, self.device
        cache = DynamicCache()
        # Prompts of a batch often open alike (system prompt, worked example): that common
        # prefix is computed once and its cache shared by every row before the rest is prefilled.
        common = _common_prefix_length(prompts) if self.share_prompt_prefill and len(prompts) > 1 else 0
        common = min(common, min(len(p) for p in prompts) - 1)  # every row keeps >= 1 token to prefill
        if self.vision is not None:  # the shared opening is text only: it ends before any image
            common = min([common] + [_first(p, self.vision.image_token_id) for p in prompts])
        if common >= self.min_common_prefix:
            model(
                input_ids=torch.tensor([prompts[0][:common]], device=device),
                position_ids=torch.arange(common, device=device)[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache.batch_repeat_interleave(len(prompts))
        else:
            common = 0
        suffix_ids, suffix_mask = left_pad([p[common:] for p in prompts], self.pad_token_id, device)
        # the padding sits between the shared prefix and each row's own tokens; it is masked out
        attention_mask = torch.cat([suffix_mask.new_ones((len(prompts), common)), suffix_mask], dim=-1)
        inputs, position_ids, next_pos = self._inputs(suffix_ids, suffix_mask, images, [common] * len(prompts))
        out = model(
            **inputs,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.prefill_tokens += common + sum(len(p) - common for p in prompts)
        logits = out.logits[:, -1, :]  # [B, V]
        if expand > 1:  # one prefill per group, the cache expanded to the n samples
            cache.batch_repeat_interleave(expand)
            logits = logits.repeat_interleave(expand, 0)
            attention_mask = attention_mask.repeat_interleave(expand, 0)
            next_pos = next_pos.repeat_interleave(expand, 0)
        return cache, logits, attention_mask, next_pos

    def _inputs(self, ids: torch.Tensor, mask: torch.Tensor, images: list[list] | None, starts: list[int]):
        """Model inputs of left-padded rows ids/mask [B, L] whose first token sits at
        `starts[b]`: ({input_ids} or {inputs_embeds} with the rows' images), position ids
        ([B, L], or [3, B, L] for multimodal rope), and the next position of each row [B]."""
        if self.vision is None:
            start = torch.tensor(starts, device=ids.device)[:, None]
            position_ids = start + (mask.cumsum(-1) - 1).clamp(min=0)
            return {"input_ids": ids}, position_ids, position_ids[:, -1] + 1
        images = images if images is not None else [[] for _ in range(len(ids))]
        flat = [image for row in images for image in row]
        embeds = self.vision.embed(self.model, ids, flat)
        position_ids = self.vision.batch_positions(ids, mask, images, starts)
        rows = position_ids if position_ids.dim() == 2 else position_ids.amax(0)  # [B, L]
        next_pos = rows.masked_fill(mask == 0, -1).amax(-1) + 1
        return {"inputs_embeds": embeds}, position_ids, next_pos

    def _decode(self, cache, logits, attention_mask, next_pos, params, *args, **kwargs):
        """`_decode_steps` (same arguments) on a cache with room for `max_new_tokens` more tokens,
        with the few-row products in their faster form on a CPU (see grouprl.cpu)."""
        _reserve_room(cache, params.max_new_tokens)
        with cpu.fast_decode(self.model):
            return self._decode_steps(cache, logits, attention_mask, next_pos, params, *args, **kwargs)

    def _decode_steps(
        self,
        cache,
        logits,
        attention_mask,
        next_pos,
        params,
        generator,
        on_done=None,
        tokens=None,
        finish=None,
        log_probs=None,
    ):
        """Sample until every row has ended; rows that end leave the batch.

        on_done(batch_rows, out_rows, cache, attention_mask), when given, is called with the rows
        that have just ended (their positions in the current batch and in the output) while
        their KV is still in `cache`; the cache then covers every token but each row's last.
        `tokens` / `finish` (and `log_probs`, which only then are computed), when given, are
        filled in place (so on_done can read them).
        -> (tokens per row, finish reason per row)."""
        device = self.device
        total = logits.shape[0]
        tokens = [[] for _ in range(total)] if tokens is None else tokens
        finish = ["length"] * total if finish is None else finish
        active = torch.arange(total, device=device)  # rows of the full batch still generating
        stop_window = max((len(s) for s in params.stop), default=0) + 8
        stop_ends = {s[-1] for s in params.stop if s}

        for step in range(params.max_new_tokens):
            rows = active.tolist()  # one copy to the host a step, not one a row (a GPU sync each)
            draw = for_rows(generator, rows)  # the active rows' own streams, if given
            next_tokens = sample_next(logits, params, draw, self._banned(logits))  # [A]
            if log_probs is not None:
                step_lp = self._log_probs(logits, next_tokens, params.temperature)
            done_rows: list[int] = []
            for row, tok in enumerate(next_tokens.tolist()):
                idx = rows[row]
                tokens[idx].append(tok)
                if log_probs is not None:
                    log_probs[idx].append(step_lp[row])
                if tok in self.eos_token_ids and not params.ignore_eos:
                    finish[idx] = "eos"
                    done_rows.append(row)
                elif params.stop and self._may_end_stop(tok, stop_ends):
                    tail = self.tokenizer.decode(tokens[idx][-stop_window:], skip_special_tokens=False)
                    if any(s in tail for s in params.stop):
                        finish[idx] = "stop"
                        done_rows.append(row)
            last_step = step == params.max_new_tokens - 1
            if on_done is not None and (done_rows or last_step):
                ending = list(range(len(active))) if last_step else done_rows
                on_done(ending, [rows[r] for r in ending], cache, attention_mask)
            if last_step:
                break
            if done_rows:
                done = set(done_rows)
                keep = torch.tensor(
                    [r for r in range(len(active)) if r not in done], dtype=torch.long, device=device
                )
                if keep.numel() == 0:
                    break
                active, next_tokens = active[keep], next_tokens[keep]
                attention_mask, next_pos = attention_mask[keep], next_pos[keep]
                cache.batch_select_indices(keep)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=-1)
            out = self.model(
                input_ids=next_tokens.unsqueeze(-1),
                attention_mask=attention_mask,
                position_ids=next_pos.unsqueeze(-1),
                past_key_values=cache,
                use_cache=True,
            )
            self.decode_tokens += len(active)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        return tokens, finish

    def _log_probs(self, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> list[float]:
        """log softmax(logits / T)[token] per row, as the update computes it (before top-k /
        top-p; image tokens excluded): the token's scaled logit minus the rows' logsumexp, with
        no [rows, vocab] log-probabilities materialised."""
        scaled = logits.float() / (temperature or 1.0)
        banned = self._banned(logits)
        if banned is not None and banned.numel():
            scaled = scaled.index_fill(-1, banned, float("-inf"))
        picked = scaled.gather(-1, tokens[:, None]).squeeze(-1)  # [A]
        return (picked - torch.logsumexp(scaled, -1)).tolist()

    def _banned(self, logits: torch.Tensor) -> torch.Tensor | None:
        if self.banned is not None and self.banned.device != logits.device:
            self.banned = self.banned.to(logits.device)
        return self.banned

    def open_session(self, prompts: list[list[int]], n: int, reuse_cache: bool = True, images=None):
        """A multi-turn session over the n samples of every prompt (rows prompt-major): each row
        keeps its KV cache between turns (`RunningSession`: turns together, or one by one in a
        running batch), or, without `reuse_cache`, every turn feeds the conversation whole (and
        turns submitted one by one run together at the next step)."""
        if reuse_cache:
            from grouprl.rollout.engines.hf_session import RunningSession

            return RunningSession(self, prompts, n, images)
        return ReprefillSession(self, prompts, n, images)

    def weights_updated(self, model, version: int | None = None) -> None:
        """The engine runs `model` itself: its next rollout already uses the new weights."""
        self.policy_version = version

    def offer_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Taken into `model` where no turn runs (`between_turns`)."""
        self.offers.put(version, weights)

    def between_turns(self) -> None:
        """No turn of this call runs yet: offered weights are taken unless a session's running
        batch still has turns (they wait for its drain)."""
        if self.offers.pending and self.running_turns == 0:
            self.offers.take(self)

    def begin_rollout(self) -> None:
        """Nothing to take back: the engine holds no memory of its own between rollouts."""

    def end_rollout(self) -> None:
        """Nothing to give back."""

    def close(self) -> None:
        """Nothing to end: the model is the trainer's."""
