"""A multi-turn session on vLLM: each turn feeds the row's whole conversation, and vLLM's prefix
cache finds the part it has already computed.

Turns run together (`generate`, the agent's `turn` schedule: one `VLLMEngine.generate` call per
turn) or one by one (`submit` / `step`, the `trajectory` schedule): each submitted turn is a vLLM
request of its own, added to vLLM's engine, whose scheduler lets it join the running batch at its
next step (continuous batching), and a step of the session is one step of vLLM's engine. vLLM's
asynchronous engine (AsyncLLM) would drive the same scheduler from an engine core in a process of
its own, which the in-place weight push (vllm_weights.py) cannot reach; stepping the in-process
engine serves the same requests.

Randomness: a turn's request is seeded from its row's stream (`request_seeds`), one draw a
turn, as `generate` seeds a request of one row; the first turn of every row at once is seeded as
`generate` seeds a prompt's n samples (the group's first row's draw, + j for sample j: vLLM
gives a request's sample j that seed), so both schedules give a row the same seeds.
"""

from __future__ import annotations

from grouprl.rollout.engines.base import Generation, ReprefillSession, SamplingParams, rollout_phase
from grouprl.rollout.engines.sampling import request_seeds, seeded
from grouprl.rollout.engines.streams import Randomness, for_rows


class VLLMSession(ReprefillSession):
    """ReprefillSession (turns together) whose turns can also run one vLLM request each (see the
    module docstring). Newer weights offered to the engine wait until none of the session's
    requests is in vLLM (turns queued meanwhile wait with them), so each turn samples from one
    version."""

    def __init__(self, engine, prompts, n, images=None):
        super().__init__(engine, prompts, n, images)
        self.waiting: list[tuple[int, SamplingParams]] = []  # submitted, not yet in vLLM
        self.requests: dict[str, tuple[int, int | None]] = {}  # request id -> (row, version)
        self.generator: Randomness = None

    def submit(self, row, new_tokens, params, generator=None, new_images=None) -> None:
        self.contexts[row].extend(new_tokens)
        self.context_images[row].extend(new_images or [])
        if generator is not None:
            self.generator = generator
        self.waiting.append((row, params))

    def step(self) -> list[tuple[int, Generation]]:
        engine = self.engine
        with rollout_phase(engine):  # within the trainer's rollout: nothing to wake
            if self.waiting and not (engine.offers.pending and self.requests):
                self._admit()
            engine.step(seeded=self.generator is not None)
            ended = []
            for rid in [rid for rid in self.requests if rid in engine._finished]:
                (row, version), out = self.requests.pop(rid), engine._finished.pop(rid)
                generation = engine._generation(out.outputs[0], version)
                self.contexts[row].extend(generation.token_ids)
                ended.append((row, generation))
            engine.running_turns -= len(ended)
            engine.decode_tokens += sum(len(g.token_ids) for _, g in ended)
        return sorted(ended, key=lambda turn: turn[0])

    def _admit(self) -> None:
        """The waiting turns become vLLM requests (taking offered weights first, when no turn runs)."""
        engine = self.engine
        engine.between_turns()
        waiting, self.waiting = sorted(self.waiting, key=lambda turn: turn[0]), []
        rows = [row for row, _ in waiting]
        if not self.started and rows == list(range(len(self.contexts))):  # every row's first turn
            seeds = request_seeds(self.generator, len(self.prompts), self.n)
            seeds = None if seeds is None else [seeds[row // self.n] + row % self.n for row in rows]
        else:
            seeds = [request_seeds(for_rows(self.generator, [row]), 1, 1) for row in rows]
            seeds = None if seeds[0] is None else [s[0] for s in seeds]
        self.started = True
        contexts = [self.contexts[row] for row in rows]
        if engine.images is not None:
            inputs = engine.images.inputs(engine.llm, contexts, [self.context_images[row] for row in rows])
        else:
            inputs = [{"prompt_token_ids": list(c)} for c in contexts]
        for k, ((row, params), request) in enumerate(zip(waiting, inputs)):
            sampling = engine._params(1, params)
            rid = engine.add_request(request, sampling if seeds is None else seeded(sampling, seeds[k]))
            self.requests[rid] = (row, engine.policy_version)
        engine.prefill_tokens += sum(len(c) for c in contexts)
        engine.running_turns += len(rows)

    def release(self, row: int) -> None:
        """Drop the row: its waiting turn, its request in vLLM, its conversation."""
        self.waiting = [turn for turn in self.waiting if turn[0] != row]
        for rid, (owner, _) in list(self.requests.items()):
            if owner == row:
                self.engine.abort(rid)
                del self.requests[rid]
                self.engine.running_turns -= 1
        super().release(row)
