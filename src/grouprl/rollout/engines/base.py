"""What every rollout engine offers: token ids in, token ids out.

An engine samples n continuations of token-id prompts (`generate`), and for multi-turn agents
keeps a conversation per trajectory across turns (`open_session`). The trainer tells it when the
policy's weights changed (`weights_updated`), so an engine with its own copy of the weights (an
inference server) can take the new ones before the next rollout; an engine that runs the
trainer's own model has nothing to do; `version` names them (the policy version, asynchronous
training), and every turn says which version it sampled from (`Generation.version`). Newer
weights offered while a rollout runs (`offer_weights`, from another thread) are taken where no
turn runs, so no turn mixes two versions. The trainer also says when a rollout begins and ends
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
import threading
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
    version: int | None = None  # the policy version the engine sampled it from (None: never told one)


GroupDone = Callable[[int, list[Generation]], None]


class Session(Protocol):
    """Rows (one per trajectory, prompt-major) whose contexts live across turns.

    Two ways to run turns: `generate` takes a turn of several rows together and returns when all
    have ended (the agent's `turn` schedule); `submit` queues one row's turn and `step` advances
    the running batch, each queued turn joining it at a step boundary, each ended one handed back
    as it ends (the `trajectory` schedule: no turn waits for another)."""

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

    def submit(
        self,
        row: int,
        new_tokens: list[int],
        params: SamplingParams,
        generator: Randomness = None,
        new_images: list | None = None,
    ) -> None:
        """Queue row `row`'s next turn: `new_tokens` (with the images `new_images`) appended to its
        context, then its continuation sampled. `generator`: the randomness of every row of the
        session (the same object on every call: a row draws from its own stream)."""
        ...

    def step(self) -> list[tuple[int, Generation]]:
        """Advance the running batch by one step (queued turns join first, where the engine
        admits them); the turns that ended in it, as (row, generation). Nothing queued or
        running: nothing to do, []."""
        ...

    def release(self, row: int) -> None:
        """The row has ended (or is given up): drop what it holds, a queued or running turn too."""
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

    policy_version: int | None
    """The policy version of the weights the engine samples from: what the last `weights_updated`
    (or a taken offer) said; None when never told one (a synchronous run)."""

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

    def weights_updated(self, model: torch.nn.Module, version: int | None = None) -> None:
        """The policy `model` has new weights (`version`: their policy version, None: unnamed): the
        next rollout, or turn, samples from them."""
        ...

    def offer_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Newer weights for `model`'s parameters (by name: the trainable ones), policy version
        `version`, offered from any thread while a rollout may be running (asynchronous training,
        newest weights): the engine loads them into `model` and samples from them from its next
        point where no turn is running on (`WeightOffers`). An older offer than what the engine
        holds is dropped."""
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


class WeightOffers:
    """The newest weights offered to an engine (`RolloutEngine.offer_weights`, from any thread),
    kept until the engine takes them at a point where none of its turns is running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offer: tuple[int, dict[str, torch.Tensor]] | None = None

    def put(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with self._lock:
            if self._offer is None or version > self._offer[0]:
                self._offer = (version, weights)

    @property
    def pending(self) -> bool:
        return self._offer is not None

    def take(self, engine: RolloutEngine) -> bool:
        """Load the offer into `engine.model` and tell the engine (`weights_updated` with its
        version); False when none was waiting or it is not newer than what the engine holds."""
        with self._lock:
            offer, self._offer = self._offer, None
        if offer is None or (engine.policy_version is not None and offer[0] <= engine.policy_version):
            return False
        version, weights = offer
        params = dict(engine.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
        engine.weights_updated(engine.model, version)
        return True


class TurnsAtEachStep:
    """`submit` / `step` for a session that runs turns only together (its `generate`): the turns
    queued when `step` comes run then, to their end, one `generate` per sampling setting. A
    session that releases a row calls `forget(row)`."""

    queued: list[tuple[int, list[int], SamplingParams, Randomness, list]]

    def submit(self, row, new_tokens, params, generator=None, new_images=None) -> None:
        if not hasattr(self, "queued"):
            self.queued = []
        self.queued.append((row, list(new_tokens), params, generator, list(new_images or [])))

    def step(self) -> list[tuple[int, Generation]]:
        queued, self.queued = sorted(getattr(self, "queued", []), key=lambda turn: turn[0]), []
        ended: list[tuple[int, Generation]] = []
        while queued:
            params, generator = queued[0][2], queued[0][3]
            same = [turn for turn in queued if turn[2] == params]
            queued = [turn for turn in queued if turn[2] != params]
            rows = [turn[0] for turn in same]
            images = {"new_images": [turn[4] for turn in same]} if any(turn[4] for turn in same) else {}
            generations = self.generate(rows, [turn[1] for turn in same], params, generator, **images)
            ended.extend(zip(rows, generations))
        return ended

    def forget(self, row: int) -> None:
        """Drop the row's queued turn, if any."""
        self.queued = [turn for turn in getattr(self, "queued", []) if turn[0] != row]


class ReprefillSession(TurnsAtEachStep):
    """Turn generation through `engine.generate` alone: every turn feeds each conversation whole
    (an engine with prefix caching finds the shared part in its cache). Submitted turns run
    together at the next `step`, to their end: the rows queued by then make one turn."""

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
        self.forget(row)
