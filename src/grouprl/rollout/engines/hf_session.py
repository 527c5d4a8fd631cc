"""The built-in engine's multi-turn sessions: each trajectory's KV cache kept between its turns.

`KVSession` runs a turn of several rows together (`generate`, the agent's `turn` schedule): the
rows' parked caches side by side, each row's new tokens prefilled after its own, then decoded as
`HFEngine.generate` decodes. `RunningSession` adds continuous batching (`submit` / `step`, the
`trajectory` schedule): one running batch that a row's turn joins at a decode-step boundary and
leaves as soon as it ends, without waiting for the others. A returning row's new tokens (the
tool's observation) are prefilled inside the running rows' next decode step, one forward pass
for both (`RunningBatch.forward` with `joining`: each running row's token and each joining row's
tokens side by side in one sequence, every row attending to its own cache only), so the
running rows never stop for a joining row; a VLM's rows, and every row when nothing runs, are
prefilled in a pass of their own as the turn-by-turn schedule does.

Randomness is the rows' own (`RowStreams`): a row draws one number a token from its stream,
whichever rows share its batch. The floats a row's logits come from can still depend on its
batch: a CPU BLAS may sum a product's terms in another order for another row count (on an Intel
Xeon with MKL, F.linear's rows at 1-3, 5-7 and 9-11 rows differ in the last bits from the same
rows at 4, 8 or 12 and more), and attention runs over the batch's width. So in float32 a row's
samples equal the turn-by-turn schedule's wherever its products came out the same; a flip needs
a draw within a rounding error of a boundary between two tokens, which is rare but happens
(README, "How a turn is scheduled", says how often it was measured).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grouprl import cpu
from grouprl.rollout.engines import sampling
from grouprl.rollout.engines.base import Generation, SamplingParams
from grouprl.rollout.engines.running_batch import RunningBatch, joins_in_step
from grouprl.rollout.engines.streams import Randomness, for_rows


class KVSession:
    """Rows (one per trajectory) whose KV caches live across generate calls, so that a later
    turn feeds the model only the tokens appended since the row's last turn.

    Between calls each row's cache is parked on its own, holes removed: per layer a
    ([H, L, D] keys, values) pair for its L cached tokens, whose positions are 0..L-1. A call
    lays the parked rows side by side, left-padded to the longest (the padding masked out),
    prefills each row's new tokens right-aligned after it with position_ids continuing from
    L, and decodes as `HFEngine.generate` does; a row that ends is parked again before it
    leaves the batch. The last sampled token of a turn is never fed in that turn, so it opens
    the row's next feed. Assumes full attention (no sliding window shorter than the context).
    """

    def __init__(self, engine, prompts: list[list[int]], n: int, images: list[list] | None = None):
        self.engine, self.prompts, self.n = engine, prompts, n
        self.images = images  # per prompt, for a VLM policy
        rows = len(prompts) * n
        self.parked: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * rows
        self.unfed: list[list[int]] = [list(prompts[r // n]) for r in range(rows)]  # context not in the cache
        # images whose tokens are in `unfed`, and where each row's next token sits (the cache
        # length for text; multimodal rope runs ahead of it after an image)
        self.unfed_images: list[list] = [list(images[r // n]) if images else [] for r in range(rows)]
        self.next_pos = [0] * rows
        self.started = False

    @torch.no_grad()
    def generate(
        self,
        rows: list[int],
        new_tokens: list[list[int]],
        params: SamplingParams,
        generator: Randomness = None,
        new_images: list[list] | None = None,
    ) -> list[Generation]:
        """Append `new_tokens[i]` (with the images `new_images[i]` whose tokens it holds) to row
        `rows[i]`'s context and sample its continuation (`generator`: a torch generator, or
        streams over all the session's rows)."""
        engine, model = self.engine, self.engine.model
        engine.between_turns()
        was_training = model.training
        model.eval()
        batch = self._prefill(rows, new_tokens, new_images)
        starts = batch[3].tolist()  # the position of each row's first sampled token

        def park(batch_rows, out_rows, cache, attention_mask):
            for b, i in zip(batch_rows, out_rows):
                real = attention_mask[b].nonzero().squeeze(-1)  # [L] positions of the row's real tokens
                self.parked[rows[i]] = [
                    (layer.keys[b].index_select(1, real), layer.values[b].index_select(1, real))
                    for layer in cache.layers
                ]

        lps = [[] for _ in rows] if engine.report_log_probs else None
        tokens, finish = engine._decode(*batch, params, for_rows(generator, rows), on_done=park, log_probs=lps)
        for r, t, start in zip(rows, tokens, starts):
            self.unfed[r] = t[-1:]
            self.next_pos[r] = start + len(t) - 1  # the unfed last token's position
        if was_training:
            model.train()
        return [
            engine._generation(t, f, lps[k] if lps else None) for k, (t, f) in enumerate(zip(tokens, finish))
        ]

    def _prefill(self, rows: list[int], new_tokens: list[list[int]], new_images: list[list] | None):
        """Prefill `rows`' unfed context and new tokens: every row's first turn at once is one
        prefill per group (as generate does), else each row's parked cache with its feed after it.
        -> (cache, logits [A, V], attention_mask [A, W], next_pos [A])."""
        engine = self.engine
        new_images = new_images if new_images is not None else [[] for _ in rows]
        if not self.started and rows == list(range(len(self.parked))) and not any(new_tokens):
            expand = self.n if engine.share_prompt_prefill else 1
            prompts, images = self.prompts, self.images
            if expand == 1:
                prompts = [p for p in self.prompts for _ in range(self.n)]
                images = [x for x in images for _ in range(self.n)] if images is not None else None
            batch = engine._prefill_prompts(prompts, expand, images)  # one prefill per group, as generate does
        else:
            batch = self._prefill_rows(
                rows,
                [self.unfed[r] + list(t) for r, t in zip(rows, new_tokens)],
                [self.unfed_images[r] + list(x) for r, x in zip(rows, new_images)],
            )
        self.started = True
        for r in rows:
            self.parked[r], self.unfed[r], self.unfed_images[r] = None, [], []  # now inside the batch cache
        return batch

    def _prefill_rows(self, rows: list[int], feeds: list[list[int]], feed_images: list[list]):
        engine, device = self.engine, self.engine.device
        parked = [self.parked[r] for r in rows]
        lengths = torch.tensor([p[0][0].shape[1] if p else 0 for p in parked], device=device)  # [A]
        cache = DynamicCache()
        if int(lengths.max()) > 0:
            template = next(p for p in parked if p)
            layers = []
            for j, (keys, values) in enumerate(template):
                empty_k, empty_v = keys[:, :0], values[:, :0]
                # [L, H, D] per row, left-padded to [A, W, H, D], back to [A, H, W, D]
                pad = lambda ts: torch.nn.utils.rnn.pad_sequence(  # noqa: E731
                    [t.transpose(0, 1) for t in ts], batch_first=True, padding_side="left"
                ).transpose(1, 2)
                layers.append(
                    (
                        pad([p[j][0] if p else empty_k for p in parked]),
                        pad([p[j][1] if p else empty_v for p in parked]),
                    )
                )
            cache = DynamicCache(ddp_cache_data=layers)
        width = int(lengths.max())
        past_mask = (
            torch.arange(width, device=device)[None, :] >= (width - lengths)[:, None]
        ).long()  # [A, W]
        feed_ids, feed_mask = sampling.left_pad(feeds, engine.pad_token_id, device)
        attention_mask = torch.cat([past_mask, feed_mask], dim=-1)
        inputs, position_ids, next_pos = engine._inputs(
            feed_ids, feed_mask, feed_images, [self.next_pos[r] for r in rows]
        )
        out = engine.model(
            **inputs,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        engine.prefill_tokens += sum(len(f) for f in feeds)
        return cache, out.logits[:, -1, :], attention_mask, next_pos

    def release(self, row: int) -> None:
        """Drop a finished row's cache."""
        self.parked[row] = None
        self.unfed[row], self.unfed_images[row] = [], []


ADMIT_WAIT = 3  # steps a queued turn may wait to share its prefill with turns queued after it


class _Turn:
    """A running turn: its row, settings, what it sampled so far."""

    def __init__(self, row: int, index: int, params: SamplingParams, start: int, version, lps: bool):
        self.row, self.index, self.params, self.start, self.version = row, index, params, start, version
        self.tokens: list[int] = []
        self.log_probs: list[float] | None = [] if lps else None
        self.finish = "length"


class RunningSession(KVSession):
    """A KVSession whose turns run in one batch that they join and leave one by one (`submit` /
    `step`, see the module docstring). Newer weights offered to the engine wait
    until no turn is running (turns queued meanwhile wait with them), so each turn samples from
    one version."""

    def __init__(self, engine, prompts, n, images=None):
        super().__init__(engine, prompts, n, images)
        self.queued: list[tuple[int, list[int], SamplingParams, list]] = []
        self.generator: Randomness = None
        self.batch: RunningBatch | None = None
        self.running: list[_Turn] = []  # slot i's turn
        self.logits: torch.Tensor | None = None  # [A, V] the running rows' next-token logits
        self.turns = [0] * len(self.parked)  # turns each row has started
        self.waited = 0  # steps the queued turns have waited
        self.joining: list[tuple[int, list[int], SamplingParams]] = []  # fed in the next decode step
        self.in_step = joins_in_step(engine)  # whether returning rows are prefilled inside a decode step
        self._fast: contextlib.ExitStack | None = None  # cpu.fast_decode, kept while turns run

    def submit(self, row, new_tokens, params, generator=None, new_images=None) -> None:
        if generator is not None:
            self.generator = generator
        self.queued.append((row, list(new_tokens), params, list(new_images or [])))

    @torch.no_grad()
    def step(self) -> list[tuple[int, Generation]]:
        model = self.engine.model
        was_training = model.training
        if was_training:
            model.eval()
        try:
            self._admit()
            if not self.running:
                return []
            if self._fast is None:  # entered once for a run of steps (patching every layer costs ~1 ms a step)
                self._fast = contextlib.ExitStack()
                self._fast.enter_context(cpu.fast_decode(model))
            return self._advance()
        finally:
            if self._fast is not None and (not self.running or was_training):  # left when nothing runs
                self._fast.close()
                self._fast = None
            if was_training:
                model.train()

    def release(self, row: int) -> None:
        """Drop the row: its queued turn, its running turn (it leaves the batch), its cache."""
        self.queued = [turn for turn in self.queued if turn[0] != row]
        self.joining = [turn for turn in self.joining if turn[0] != row]
        for i, turn in enumerate(self.running):
            if turn.row == row:
                self._drop(i)
                self.engine.running_turns -= 1
                break
        if self._fast is not None and not self.running:
            self._fast.close()
            self._fast = None
        super().release(row)

    def _admit(self) -> None:
        """Let the queued turns join the running batch. While rows run, a text model's queued
        turns are fed inside the next decode step (`joining`, see `RunningBatch.forward`). Otherwise
        they are prefilled together in a pass of their own: at once when nothing runs or as many
        are queued as run, else after ADMIT_WAIT steps (a prefill pass costs a decode step's read
        of every weight, whatever its rows: turns that come back a step or two apart share one)."""
        engine = self.engine
        if not self.queued or (engine.offers.pending and self.running):
            return  # nothing to admit, or newer weights wait for the running turns to end
        text = all((self.unfed[t[0]] or t[1]) and not (t[3] or self.unfed_images[t[0]]) for t in self.queued)
        if self.running and self.in_step and text:
            engine.between_turns()
            self.joining += [t[:3] for t in sorted(self.queued, key=lambda turn: turn[0])]
            self.queued, self.waited = [], 0
            return
        self.waited += 1
        if self.running and len(self.queued) < len(self.running) and self.waited <= ADMIT_WAIT:
            return
        self.waited = 0
        engine.between_turns()
        queued, self.queued = sorted(self.queued, key=lambda turn: turn[0]), []
        rows = [turn[0] for turn in queued]
        cache, logits, attention_mask, next_pos = self._prefill(rows, [t[1] for t in queued], [t[3] for t in queued])
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise ValueError("continuous batching (agent.schedule=trajectory) needs a model of full-attention layers")
        room = max(turn[2].max_new_tokens for turn in queued)
        if self.batch is None:
            self.batch = RunningBatch(cache, len(self.parked), attention_mask.shape[1] + room)
        self.batch.join(cache, attention_mask, next_pos, room)
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        for turn, start in zip(queued, next_pos.tolist()):
            row = turn[0]
            self.running.append(_Turn(row, self.turns[row], turn[2], start, engine.policy_version, engine.report_log_probs))
            self.turns[row] += 1
        engine.running_turns += len(queued)

    def _draw(self) -> torch.Tensor:
        """One token per running row, from its logits and its own stream -> [A]."""
        engine, rows = self.engine, [turn.row for turn in self.running]
        tokens = torch.empty(len(rows), dtype=torch.long, device=self.logits.device)
        for params, slots in self._by_sampling():
            index = torch.tensor(slots, device=self.logits.device)
            logits = self.logits if len(slots) == len(rows) else self.logits[index]
            draw = for_rows(self.generator, [rows[i] for i in slots])
            tokens[index] = sampling.sample_next(logits, params, draw, engine._banned(logits))
        return tokens

    def _by_sampling(self) -> list[tuple[SamplingParams, list[int]]]:
        """The running slots grouped by how they sample (temperature, top-k, top-p)."""
        groups: dict[tuple, tuple[SamplingParams, list[int]]] = {}
        for i, turn in enumerate(self.running):
            p = turn.params
            groups.setdefault((p.temperature, p.top_k, p.top_p), (p, []))[1].append(i)
        return list(groups.values())

    def _advance(self) -> list[tuple[int, Generation]]:
        """Sample every running row's next token; the rows that ended leave (parked), the others
        are fed theirs. -> the ended turns, (row, generation), by row."""
        engine = self.engine
        tokens = self._draw()
        log_probs = [0.0] * len(self.running)
        if engine.report_log_probs:
            for params, slots in self._by_sampling():
                index = torch.tensor(slots, device=tokens.device)
                for i, lp in zip(slots, engine._log_probs(self.logits[index], tokens[index], params.temperature)):
                    log_probs[i] = lp
        ended = []
        for i, (turn, token) in enumerate(zip(self.running, tokens.tolist())):
            turn.tokens.append(token)
            if turn.log_probs is not None:
                turn.log_probs.append(log_probs[i])
            if self._ends(turn, token):
                ended.append(i)
        done = []
        for i in reversed(ended):  # the last slots first: a moved row is never one that ends
            turn = self.running[i]
            self._park(i, turn)
            done.append((turn.row, engine._generation(turn.tokens, turn.finish, turn.log_probs, turn.version)))
            tokens[i] = tokens[len(self.running) - 1]
            self._drop(i)
        engine.running_turns -= len(ended)
        decoding = len(self.running)
        if self.joining:
            self._feed_joining(tokens[:decoding])
        elif self.running:
            self.logits = self.batch.forward(engine.model, tokens[:decoding])
        engine.decode_tokens += decoding
        return sorted(done, key=lambda ended_turn: ended_turn[0])

    def _feed_joining(self, tokens: torch.Tensor) -> None:
        """One pass: the running rows' next tokens and the joining turns' new tokens (their
        unfed last token and the observation after it); the joining turns then run."""
        engine, joining, self.joining = self.engine, self.joining, []
        feeds = []
        for row, new, params in joining:
            feeds.append((self.parked[row], self.unfed[row] + new, self.next_pos[row], params.max_new_tokens))
            self.parked[row], self.unfed[row] = None, []  # now inside the batch cache
        self.logits = self.batch.forward(engine.model, tokens, feeds)
        for (row, _, params), (_, fed, first, _) in zip(joining, feeds):
            self.running.append(_Turn(row, self.turns[row], params, first + len(fed), engine.policy_version, engine.report_log_probs))
            self.turns[row] += 1
        engine.running_turns += len(joining)
        engine.prefill_tokens += sum(len(fed) for _, fed, _, _ in feeds)

    def _ends(self, turn: _Turn, token: int) -> bool:
        """Whether `token` ends the turn (EOS, a stop string, or its token limit); sets its finish."""
        engine, params = self.engine, turn.params
        if token in engine.eos_token_ids and not params.ignore_eos:
            turn.finish = "eos"
        elif params.stop and engine._may_end_stop(token, {s[-1] for s in params.stop if s}):
            window = max(len(s) for s in params.stop) + 8
            tail = engine.tokenizer.decode(turn.tokens[-window:], skip_special_tokens=False)
            if any(s in tail for s in params.stop):
                turn.finish = "stop"
        return turn.finish != "length" or len(turn.tokens) >= params.max_new_tokens

    def _park(self, slot: int, turn: _Turn) -> None:
        """What the row's next turn starts from: its cache and its last token."""
        row = turn.row
        self.parked[row] = self.batch.parked(slot)
        self.unfed[row] = turn.tokens[-1:]
        self.next_pos[row] = turn.start + len(turn.tokens) - 1  # the unfed last token's position

    def _drop(self, slot: int) -> None:
        """Slot `slot` leaves the batch; the last running row takes its place."""
        last = len(self.running) - 1
        self.batch.leave(slot)
        self.running[slot] = self.running[last]
        self.running.pop()
        if self.logits is not None:
            if slot != last:
                self.logits[slot] = self.logits[last]
            self.logits = self.logits[:last] if last else None
