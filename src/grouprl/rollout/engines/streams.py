"""Sampling randomness by trajectory, not by batch position.

Every trajectory of a rollout has a key (its group's index in the step's global batch x n +
its sample index); its draws come from a SplitMix64 stream seeded by (rollout seed, key). A
sample's tokens therefore do not depend on which other rows share its batch, how the batch is
chunked, which rows ended earlier, or on which rank it runs: the same step on 1 or N processes
samples the same tokens, and a resumed run needs only the step number to redraw them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def mix_seed(*parts: int) -> int:
    """One 64-bit seed from integers (e.g. run seed, step, rollout call)."""
    h = np.uint64(0)
    for p in parts:
        h = splitmix64(np.array([h ^ np.uint64(p & _MASK64)]))[0]
    return int(h)


class RowStreams:
    """Independent uniform streams, one per row (trajectory); `select(rows)` is a view on some
    rows sharing their draw counters, so a row continues its stream across turns and calls."""

    def __init__(self, seed: int, keys: Sequence[int]):
        self.seed = seed & _MASK64
        keys = np.asarray(list(keys), dtype=np.uint64)
        self._state = splitmix64(np.uint64(self.seed) ^ splitmix64(keys))  # [K] each row's stream seed
        self._drawn = np.zeros(len(keys), dtype=np.uint64)  # [K] draws so far
        self._rows = np.arange(len(keys))

    def __len__(self) -> int:
        return len(self._rows)

    def select(self, rows: Sequence[int]) -> RowStreams:
        view = object.__new__(RowStreams)
        view.seed, view._state, view._drawn = self.seed, self._state, self._drawn
        view._rows = self._rows[np.asarray(list(rows), dtype=np.int64)]
        return view

    def state(self) -> np.ndarray:
        """How far each row's stream has gone: its draws so far ([K] uint64, every row of the
        streams, also from a view), a copy. The seed and keys are fixed when the streams are made;
        this is all that changes."""
        return self._drawn.copy()

    def restore(self, state: np.ndarray) -> None:
        """Every row's stream goes on from `state` (what `state()` gave, here or from a copy of
        these streams elsewhere, e.g. an engine process that drew from them); views share it."""
        state = np.asarray(state)
        if state.shape != self._drawn.shape:
            raise ValueError(f"a state of {state.shape[0] if state.ndim else 0} rows for {len(self._drawn)} row streams")
        np.copyto(self._drawn, state.astype(np.uint64, copy=False))

    def uniform(self, device=None, dtype=torch.float32) -> torch.Tensor:
        """One draw per row in [0, 1) -> [A], advancing each row's stream."""
        rows = self._rows
        with np.errstate(over="ignore"):
            self._drawn[rows] += np.uint64(1)
            bits = splitmix64(self._state[rows] + self._drawn[rows] * _GOLDEN)
        u = torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * 2.0**-53)
        # [0, 1) in the target dtype too: a float32 rounding up to 1.0 would reach past the last token
        below_one = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(0.0, dtype=dtype))
        return u.to(dtype=dtype).clamp_(max=float(below_one)).to(device)

Randomness = torch.Generator | RowStreams | None


def for_rows(generator: Randomness, rows: Sequence[int]) -> Randomness:
    """The randomness of `rows` of a call: a view of row streams, a generator as it is."""
    return generator.select(rows) if isinstance(generator, RowStreams) else generator
