"""The order prompts of one bucket are trained in. Ties are always broken by uid, so the
order is a pure function of (uids, scores, order, batch size, seed).

    easy-to-hard  mean descending (the source plan's choice: early successes, then harder)
    hard-to-easy  mean ascending
    spread        every batch mixes difficulties: sort easy-to-hard, cut into S = min(B, N)
                  contiguous strata of sizes differing by at most one (larger ones first),
                  then take the 1st prompt of each stratum, the 2nd of each, ...; every run
                  of B consecutive prompts starting at a multiple of B holds one prompt of
                  each stratum (the last, partial round the first N mod S strata)
    random        a permutation of the uid-sorted prompts drawn from `seed`
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from grouprl.errors import ConfigError

ORDERS = ("easy-to-hard", "hard-to-easy", "spread", "random")


def curriculum_order(
    uids: Sequence[str], mean: np.ndarray, order: str, *, batch_size: int = 8, seed: int = 0
) -> np.ndarray:
    """Positions into `uids`/`mean`, in training order. [N] -> [N] int64."""
    if order not in ORDERS:
        raise ConfigError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    keys = np.asarray(list(uids), dtype=str)
    mean = np.asarray(mean, dtype=np.float64)
    if len(keys) == 0:
        return np.empty(0, dtype=np.int64)
    if order == "random":
        rng = np.random.default_rng([abs(seed), int(seed < 0)])
        return np.argsort(keys, kind="stable")[rng.permutation(len(keys))].astype(np.int64)
    if order == "hard-to-easy":
        return np.lexsort((keys, mean)).astype(np.int64)
    easy_first = np.lexsort((keys, -mean)).astype(np.int64)
    if order == "easy-to-hard":
        return easy_first
    return spread(easy_first, batch_size)


def spread(sorted_positions: np.ndarray, batch_size: int) -> np.ndarray:
    """Round-robin over min(B, N) contiguous strata of an easy-to-hard list."""
    strata = np.array_split(sorted_positions, min(batch_size, len(sorted_positions)))
    rounds = len(strata[0])
    return np.array(
        [stratum[j] for j in range(rounds) for stratum in strata if j < len(stratum)], dtype=np.int64
    )
