"""Which prompts each step trains on: an endless, resumable stream of epochs of indices."""

from __future__ import annotations

from typing import Any, Literal, Protocol

import numpy as np

from grouprl.errors import ConfigError

MODES = ("random", "sequential")


class Sampler(Protocol):
    """What the training loop asks of whatever picks a step's prompts: `PromptSampler` (random or
    sequential epochs) or the online curriculum (grouprl.curriculum.OnlineCurriculum), which
    learns from each scored group. Nothing outside this file and the curriculum asks which one
    it has: `learns_from_rewards` says what the loop must feed back."""

    # the loop hands it every scored group (`update`), a dynamic-filtering step's selection
    # (`note_selection`), and logs its `metrics()`; dynamic filtering needs it
    learns_from_rewards: bool

    @property
    def epoch(self) -> int:
        """Completed passes over the prompts (train/epoch)."""
        ...

    def steps_for_epochs(self, epochs: float) -> int: ...

    def next_batch(self) -> list[int]:
        """The next step's prompt indices."""
        ...

    def more(self, k: int) -> list[int]:
        """Indices for `k` more prompts within the same step (prompts redrawn for skipped ones,
        dynamic filtering's refills); a sampler may give more, and the caller takes what it needs."""
        ...

    def update(self, uid: str, rewards: list[float]) -> None:
        """One scored group's rewards (a sampler that does not learn ignores them)."""
        ...

    def note_selection(self, selection: Any) -> None: ...

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PromptSampler:
    """Yields batches of dataset indices, epoch after epoch.

    random: epoch e is a permutation drawn from a generator seeded by (seed, e) alone, so the
    order depends on neither the global RNG nor how many batches were drawn before.
    sequential: 0..N-1 every epoch, never shuffled (verl's shuffle=False).
    A batch that reaches the end of an epoch is completed from the start of the next one, so
    every batch has exactly `batch_size` indices (a batch larger than the dataset repeats some).
    It learns nothing from rewards (`Sampler.learns_from_rewards` False).
    """

    learns_from_rewards = False

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        mode: Literal["random", "sequential"] = "random",
        seed: int = 0,
    ) -> None:
        if num_samples < 1:
            raise ConfigError(f"the prompt sampler needs at least one sample, got {num_samples}")
        if batch_size < 1:
            raise ConfigError(f"the prompt sampler needs batch_size >= 1, got {batch_size}")
        if mode not in MODES:
            raise ConfigError(f"sampler mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.mode = mode
        self.seed = seed
        self._epoch = 0
        self._position = 0  # next index to take inside the current epoch's order
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from = the number of completed epochs."""
        return self._epoch

    @property
    def steps_per_epoch(self) -> int:
        """`steps_for_epochs(1)`: floor(N / B), at least 1."""
        return self.steps_for_epochs(1)

    def steps_for_epochs(self, epochs: float) -> int:
        """Steps for `epochs` passes: floor(epochs * N / B), but at least 1 when epochs > 0.

        Because batches cross epoch boundaries, floor() never draws beyond the requested
        epochs; the minimum of 1 lets a dataset smaller than one batch still train.
        """
        # round() first so that 0.29 * 100 samples counts as 29, not 28.999999999999996
        samples = (
            epochs * self.num_samples if isinstance(epochs, int) else round(epochs * self.num_samples, 9)
        )
        steps = int(samples // self.batch_size)
        return max(steps, 1) if epochs > 0 else 0

    def epoch_order(self, epoch: int) -> list[int]:
        """The index order of `epoch`."""
        if self.mode == "sequential":
            return list(range(self.num_samples))
        # SeedSequence mixes (seed, epoch) into independent streams; abs() because it needs
        # non-negative entropy, the sign bit then goes into the second word.
        rng = np.random.default_rng([abs(self.seed), int(self.seed < 0), epoch])
        return rng.permutation(self.num_samples).tolist()

    def next_batch(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.batch_size:
            if self._order_epoch != self._epoch:
                self._order, self._order_epoch = self.epoch_order(self._epoch), self._epoch
            take = min(self.batch_size - len(batch), self.num_samples - self._position)
            batch += self._order[self._position : self._position + take]
            self._position += take
            if self._position == self.num_samples:  # roll over eagerly: `epoch` counts finished passes
                self._epoch += 1
                self._position = 0
        return batch

    def more(self, k: int) -> list[int]:
        """Prompts within the same step: its next whole batch (the caller takes the first it needs)."""
        return self.next_batch()

    def update(self, uid: str, rewards: list[float]) -> None:
        """Rewards teach a plain sampler nothing."""

    def note_selection(self, selection: Any) -> None:
        """Dynamic filtering needs the curriculum; a plain sampler has nothing to count."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "mode": self.mode,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken. The saved seed wins over the constructor's;
        a different dataset size or mode cannot continue the same stream and is an error."""
        if state["num_samples"] != self.num_samples:
            raise ConfigError(
                f"sampler state was saved for {state['num_samples']} samples, the dataset now has {self.num_samples}"
            )
        if state["mode"] != self.mode:
            raise ConfigError(
                f"sampler state was saved in mode {state['mode']!r}, the config now says {self.mode!r}"
            )
        if not 0 <= state["position"] < self.num_samples or state["epoch"] < 0:
            raise ConfigError(
                f"sampler state is out of range: epoch {state['epoch']}, position {state['position']}"
            )
        self.seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._order_epoch = -1
