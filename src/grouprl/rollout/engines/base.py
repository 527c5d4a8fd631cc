"""What every rollout engine offers: token ids in, token ids out.

An engine samples n continuations of token-id prompts (`generate`), and for multi-turn agents
keeps a conversation per trajectory across turns (`open_session`). The trainer tells it when the
policy's weights changed (`weights_updated`), so an engine with its own copy of the weights (an
inference server) can take the new ones before the next rollout; an engine that runs the
trainer's own model has nothing to do. The trainer also says when a rollout begins and ends
(`begin_rollout` / `end_rollout`, or `rollout_phase(engine)` around it): a step's generation with
its refills, or an evaluation. An engine that gives the accelerator's memory back between
rollouts (vLLM's sleep mode) sleeps at the end and wakes at the beginning, never between the
turns or chunks of one rollout. Nothing is re-tokenized on the way: prompts go in as ids,
responses come back as the ids the engine sampled.

Callers ask an engine only what the interface declares: whether it reads the trainer's weights
in place (`reads_trainer_weights`), the time its pushes took (`push_seconds`), the memory its
last sleep gave back (`last_sleep_freed_bytes`), and to end what it holds (`close`). Which class
an engine is stays inside this package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from grouprl.rollout.engines.streams import Randomness, for_rows


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # sample past EOS to max_new_tokens (fixed lengths, for measurements)


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens, EOS / stop string included
    text: str  # decoded without special tokens
    finish_reason: str  # "eos" | "stop" | "length"
    log_probs: list[float] | None = None  # the engine's log-prob of each sampled token, if it reports them


GroupDone = Callable[[int, list[Generation]], None]


class Session(Protocol):
    """Rows (one per trajectory, prompt-major) whose contexts live across turns."""

    def generate(
        self,
        rows: list[int],
        new_tokens: list[list[int]],
        params: SamplingParams,
        generator: Randomness = None,
        new_images: list[list] | None = None,
    ) -> list[Generation]:
        """Append `new_tokens[i]` (holding the tokens of the images `new_images[i]`, for a VLM
        policy) to row `rows[i]`'s context and sample its continuation."""
        ...

    def release(self, row: int) -> None:
        """The row has ended: drop what it holds."""
        ...


@runtime_checkable  # isinstance(x, RolloutEngine): x has every member below (the tests check each engine)
class RolloutEngine(Protocol):
    model: torch.nn.Module  # the trainer's policy (an engine with its own copy syncs from it)
    tokenizer: Any
    eos_token_ids: list[int]
    pad_token_id: int
    prefill_tokens: int  # tokens fed to the model so far (what KV reuse / prefix caching saves)

    reads_trainer_weights: bool
    """True: the engine samples from `model` itself, the module it was given (the built-in
    engine), so its weights are read in place: nothing is pushed, and on several ranks the
    trainer's sharded weights must be whole around a rollout (the trainer's `gathered`). False:
    it holds a copy of its own (vLLM, an engine process), which `weights_updated` pushes into."""

    push_seconds: float
    """Seconds spent pushing weights into the engine's own copy since it started, in all (a
    sleeping engine pushes when it wakes, so a rollout may hold a push); 0.0 where the engine
    reads the trainer's weights. The trainer's `time/weight_push` is its growth over a step."""

    last_sleep_freed_bytes: int
    """The accelerator memory the engine's last sleep gave back (`end_rollout`), measured on
    CUDA; 0 where it does not sleep, sleeps off CUDA, or runs in another process. The trainer's
    `perf/engine_freed_gb`."""

    @property
    def device(self) -> torch.device:
        """Where the trainer's policy lives."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: Randomness = None,
        on_group_done: GroupDone | None = None,
        images: list[list] | None = None,
    ) -> list[Generation]:
        """n continuations of every prompt, prompt-major; `on_group_done(i, generations)` as soon
        as prompt i's n samples have all ended. `images[i]`: prompt i's images (VLM policies)."""
        ...

    def open_session(
        self, prompts: list[list[int]], n: int, reuse_cache: bool = True, images: list[list] | None = None
    ) -> Session:
        """A multi-turn session over the n samples of every prompt (`images[i]`: prompt i's)."""
        ...

    def weights_updated(self, model: torch.nn.Module) -> None:
        """The policy `model` has new weights: the next rollout must sample from them."""
        ...

    def begin_rollout(self) -> None:
        """A rollout starts (a step's generation and its refills, or an evaluation)."""
        ...

    def end_rollout(self) -> None:
        """The rollout is over: until the next one, the update may have the accelerator's memory."""
        ...

    def close(self) -> None:
        """The run is over: end what the engine holds outside this process (an engine process
        stops). An in-process engine has nothing of that kind, and does nothing."""
        ...


@contextlib.contextmanager
def rollout_phase(engine: RolloutEngine) -> Iterator[None]:
    """`engine.begin_rollout()` ... `engine.end_rollout()` around the block (also when it raises)."""
    engine.begin_rollout()
    try:
        yield
    finally:
        engine.end_rollout()


class ReprefillSession:
    """Turn generation through `engine.generate` alone: every turn feeds each conversation whole
    (an engine with prefix caching finds the shared part in its cache)."""

    def __init__(self, engine: RolloutEngine, prompts: list[list[int]], n: int, images: list[list] | None = None):
        self.engine, self.prompts, self.n, self.images = engine, prompts, n, images
        self.contexts = [list(prompts[k // n]) for k in range(len(prompts) * n)]
        self.context_images = [list(images[k // n]) if images else [] for k in range(len(prompts) * n)]
        self.started = False

    def generate(self, rows, new_tokens, params, generator=None, new_images=None) -> list[Generation]:
        for i, (k, ids) in enumerate(zip(rows, new_tokens)):
            self.contexts[k].extend(ids)
            self.context_images[k].extend(new_images[i] if new_images else [])
        first = not self.started and rows == list(range(len(self.contexts)))  # one prefill per group
        # images only for a VLM policy: text engines need not know the argument
        images = {} if self.images is None else {"images": self.images if first else [self.context_images[k] for k in rows]}
        if first:
            generations = self.engine.generate(self.prompts, self.n, params, generator, **images)
        else:
            generations = self.engine.generate(
                [self.contexts[k] for k in rows], 1, params, for_rows(generator, rows), **images
            )
        self.started = True
        for k, g in zip(rows, generations):
            self.contexts[k].extend(g.token_ids)
        return generations

    def release(self, row: int) -> None:
        self.contexts[row], self.context_images[row] = [], []
