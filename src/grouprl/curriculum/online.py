"""The online curriculum: a prompt sampler that follows how hard each prompt is right now.

Per prompt it tracks, from the groups trained on it: visits, the mean and population std of
every reward seen, an exponential moving average of its group means (weight `ema` on the
newest), and whether its latest group scored all alike. Every `rebucket_every` steps all
visited prompts are re-bucketed from the moving average with the rules of
`grouprl curriculum build` (see `buckets`); prompts never visited stay in the `unseen` pool.

Each batch slot first picks a pool by `weights` (pools that are empty, or whose every prompt
is already in this call's draw, are left out and the rest renormalised), then takes the pool's
next prompt in the configured order. A pool is walked in passes: each prompt exactly once per
pass (a prompt the current call already holds waits for a later call rather than repeating);
a re-bucket re-sorts the pools, and prompts drawn earlier in the pass are not drawn again
until the pass ends. `unseen` is always walked in a seeded random order. When no pool with a
positive weight has prompts, every pool is drawn from in proportion to its size; a call asking
for more prompts than the weighted pools hold repeats prompts.

All randomness comes from generators seeded by (seed, number of draw calls) or (seed, pool,
re-bucket, pass), so `state_dict()` -> `load_state_dict()` continues the exact same stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from grouprl.config import CurriculumConfig
from grouprl.curriculum.buckets import BUCKETS, assign_buckets, check_thresholds
from grouprl.curriculum.filtering import GroupSelection
from grouprl.curriculum.order import ORDERS, curriculum_order
from grouprl.data.sampler import PromptSampler
from grouprl.errors import ConfigError

UNSEEN = "unseen"
POOLS = (*BUCKETS, UNSEEN)  # easiest bucket first: a move to a lower index is a promotion


class OnlineCurriculum:
    """Sampler interface of `grouprl.data.PromptSampler` (next_batch, epoch, steps_for_epochs,
    state_dict, load_state_dict) plus update / draw / note_selection / metrics."""

    def __init__(
        self,
        uids: Sequence[str],
        batch_size: int,
        config: CurriculumConfig | None = None,
        seed: int = 0,
        priors: Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        """`priors[i]`, when given, is a `grouprl curriculum build` record {score, std, n, ...}
        that prompt i starts from (as if its n rewards had been seen)."""
        self.config = config = config or CurriculumConfig()
        if not uids:
            raise ConfigError("the curriculum sampler needs at least one sample")
        if batch_size < 1:
            raise ConfigError(f"the curriculum sampler needs batch_size >= 1, got {batch_size}")
        check_thresholds(config.easy, config.hard, config.rule)
        if config.order not in ORDERS:
            raise ConfigError(f"curriculum order must be one of {', '.join(ORDERS)}, got {config.order!r}")
        self.uids = [str(uid) for uid in uids]
        self.index_of = {uid: i for i, uid in enumerate(self.uids)}
        if len(self.index_of) != len(self.uids):
            raise ConfigError("the curriculum sampler needs unique uids")
        self.num_samples, self.batch_size, self.seed = len(self.uids), batch_size, seed
        n = self.num_samples
        self._score: list[float | None] = [None] * n  # moving average of group means; None = unseen
        self._flat = [False] * n  # latest group's rewards all equal
        self._visits = [0] * n
        self._count, self._mean, self._m2 = [0] * n, [0.0] * n, [0.0] * n  # every reward seen
        for i, prior in enumerate(priors or []):
            if prior is not None and prior.get("score") is not None:
                self._score[i] = self._mean[i] = float(prior["score"])
                std, count = float(prior.get("std") or 0.0), int(prior.get("n") or 0)
                self._flat[i] = std == 0.0
                self._count[i], self._m2[i] = count, std * std * count
        self._pool = [UNSEEN] * n
        self._step = self._draw_calls = self._drawn_total = self._rebuckets = 0
        self._passes = dict.fromkeys(POOLS, 0)
        self._cursor = dict.fromkeys(POOLS, 0)
        self._drawn: dict[str, set[int]] = {pool: set() for pool in POOLS}
        self._order: dict[str, list[int]] = {}
        self.counters = {
            "zero_variance_avoided": 0,
            "extra_prompts": 0,
            "promotions": 0,
            "demotions": 0,
            "classified": 0,
        }
        self._assign_pools()
        self.counters.update(promotions=0, demotions=0, classified=0)  # the starting buckets are no moves

    @classmethod
    def from_samples(cls, samples: Sequence[Any], batch_size: int, config: CurriculumConfig, seed: int = 0):
        """From `grouprl.data.Sample`s; with `init_from_build`, their extra_info.curriculum seeds the scores."""
        priors = [_prior(s.extra_info) for s in samples] if config.init_from_build else None
        return cls([s.uid for s in samples], batch_size, config, seed, priors)

    # -- sampler interface (grouprl.data.sampler.Sampler) -----------------------------------
    learns_from_rewards = True  # the loop feeds back every scored group; dynamic filtering draws more

    @property
    def epoch(self) -> int:
        """Prompts drawn so far // dataset size."""
        return self._drawn_total // self.num_samples

    def steps_for_epochs(self, epochs: float) -> int:
        return PromptSampler(self.num_samples, self.batch_size).steps_for_epochs(epochs)

    def next_batch(self) -> list[int]:
        """The prompts of the next step (re-bucketing first every `rebucket_every` steps)."""
        if self._step and self._step % self.config.rebucket_every == 0:
            self.rebucket()
        self._step += 1
        return self.draw(self.batch_size)

    def draw(self, k: int) -> list[int]:
        """k prompts by bucket weights, distinct while the weighted pools have unused prompts.
        Also used for the extra prompts of dynamic filtering (not a new step)."""
        rng = np.random.default_rng([abs(self.seed), int(self.seed < 0), self._draw_calls])
        self._draw_calls += 1
        in_call: dict[str, set[int]] = {pool: set() for pool in POOLS}
        batch = []
        for _ in range(k):
            pool = self._choose_pool(rng, in_call)
            batch.append(self._take(pool, in_call[pool]))
        self._drawn_total += k
        return batch

    def more(self, k: int) -> list[int]:
        """k more prompts of the same step (a refill does not count a step)."""
        return self.draw(k)

    # -- feedback ------------------------------------------------------------------------
    def update(self, uid_or_index: str | int, rewards: Sequence[float]) -> None:
        """Record one group's rewards for a prompt (by uid or dataset index)."""
        i = uid_or_index if isinstance(uid_or_index, int) else self.index_of[str(uid_or_index)]
        rewards = np.asarray(rewards, dtype=np.float64)
        if rewards.size == 0:
            raise ValueError("update needs the rewards of a non-empty group")
        group_mean = float(rewards.mean())
        if rewards.max() == rewards.min():
            group_mean = float(rewards[0])
        previous = self._score[i]
        alpha = self.config.ema
        self._score[i] = group_mean if previous is None else (1 - alpha) * previous + alpha * group_mean
        self._flat[i] = bool(rewards.max() == rewards.min())
        self._visits[i] += 1
        # merge the group into the running (count, mean, M2) (Chan et al.'s parallel variance)
        count, group_m2 = self._count[i], float(((rewards - group_mean) ** 2).sum())
        total = count + rewards.size
        delta = group_mean - self._mean[i]
        self._m2[i] += group_m2 + delta * delta * count * rewards.size / total
        self._mean[i] += delta * rewards.size / total
        self._count[i] = total

    def note_selection(self, selection: GroupSelection) -> None:
        """Count what a dynamic-filtering step avoided and over-drew."""
        self.counters["zero_variance_avoided"] += selection.zero_variance_dropped
        self.counters["extra_prompts"] += selection.extra_prompts

    def rebucket(self) -> None:
        """Re-bucket visited prompts; promotions/demotions count the moves of this re-bucket."""
        self.counters.update(promotions=0, demotions=0, classified=0)
        self._rebuckets += 1
        self._assign_pools()

    # -- reading -------------------------------------------------------------------------
    def stats(self, uid_or_index: str | int) -> dict[str, Any]:
        i = uid_or_index if isinstance(uid_or_index, int) else self.index_of[str(uid_or_index)]
        count = self._count[i]
        std = float(np.sqrt(max(self._m2[i], 0.0) / count)) if count else None
        return {
            "uid": self.uids[i],
            "bucket": self._pool[i],
            "score": self._score[i],
            "visits": self._visits[i],
            "count": count,
            "mean": self._mean[i] if count else None,
            "std": std,
            "latest_flat": self._flat[i],
        }

    def pool_members(self, pool: str) -> list[int]:
        """Indices in `pool`, in its current order."""
        return list(self._order[pool])

    def metrics(self) -> dict[str, float]:
        sizes = {pool: len(self._order[pool]) for pool in POOLS}
        out = {f"curriculum/{pool}": float(size) for pool, size in sizes.items()}
        out.update({f"curriculum/{name}": float(value) for name, value in self.counters.items()})
        out["curriculum/rebuckets"] = float(self._rebuckets)
        return out

    # -- resume --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain python data (lists, dicts, numbers); JSON round-trips it exactly."""
        return {
            "num_samples": self.num_samples,
            "uids_sha1": self._uids_digest(),
            "seed": self.seed,
            "step": self._step,
            "draw_calls": self._draw_calls,
            "drawn_total": self._drawn_total,
            "rebuckets": self._rebuckets,
            "score": list(self._score),
            "flat": list(self._flat),
            "visits": list(self._visits),
            "count": list(self._count),
            "mean": list(self._mean),
            "m2": list(self._m2),
            "pool": list(self._pool),
            "order": {pool: list(order) for pool, order in self._order.items()},
            "cursor": dict(self._cursor),
            "passes": dict(self._passes),
            "drawn": {pool: sorted(drawn) for pool, drawn in self._drawn.items()},
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken; a different dataset is an error."""
        if state["num_samples"] != self.num_samples or state["uids_sha1"] != self._uids_digest():
            raise ConfigError(
                f"curriculum state was saved for a different dataset ({state['num_samples']} samples; now "
                f"{self.num_samples}, or the uids changed)"
            )
        self.seed = int(state["seed"])
        self._step, self._draw_calls = int(state["step"]), int(state["draw_calls"])
        self._drawn_total, self._rebuckets = int(state["drawn_total"]), int(state["rebuckets"])
        self._score = [None if s is None else float(s) for s in state["score"]]
        self._flat = [bool(f) for f in state["flat"]]
        self._visits = [int(v) for v in state["visits"]]
        self._count = [int(c) for c in state["count"]]
        self._mean = [float(m) for m in state["mean"]]
        self._m2 = [float(m) for m in state["m2"]]
        self._pool = list(state["pool"])
        self._order = {pool: [int(i) for i in state["order"][pool]] for pool in POOLS}
        self._cursor = {pool: int(state["cursor"][pool]) for pool in POOLS}
        self._passes = {pool: int(state["passes"][pool]) for pool in POOLS}
        self._drawn = {pool: {int(i) for i in state["drawn"][pool]} for pool in POOLS}
        self.counters = {name: int(value) for name, value in state["counters"].items()}

    # -- internals -----------------------------------------------------------------------
    def _uids_digest(self) -> str:
        return hashlib.sha1("\n".join(self.uids).encode("utf-8")).hexdigest()

    def _assign_pools(self) -> None:
        seen = [i for i, score in enumerate(self._score) if score is not None]
        if seen:
            codes = assign_buckets(
                np.array([self._score[i] for i in seen]),
                np.array([self._flat[i] for i in seen]),
                easy=self.config.easy,
                hard=self.config.hard,
                rule=self.config.rule,
            )
            for i, code in zip(seen, codes.tolist()):
                old, new = self._pool[i], BUCKETS[code]
                if old == UNSEEN:
                    self.counters["classified"] += 1
                elif POOLS.index(new) < POOLS.index(old):
                    self.counters["promotions"] += 1
                elif POOLS.index(new) > POOLS.index(old):
                    self.counters["demotions"] += 1
                self._pool[i] = new
        for pool in POOLS:
            members = [i for i, p in enumerate(self._pool) if p == pool]
            self._drawn[pool] &= set(members)
            self._order[pool] = self._pool_order(pool, members)
            self._cursor[pool] = 0

    def _pool_order(self, pool: str, members: list[int]) -> list[int]:
        seed = int(
            np.random.SeedSequence(
                [abs(self.seed), int(self.seed < 0), POOLS.index(pool), self._rebuckets, self._passes[pool]]
            ).generate_state(1)[0]
        )
        if pool == UNSEEN:
            return [members[j] for j in np.random.default_rng(seed).permutation(len(members)).tolist()]
        positions = curriculum_order(
            [self.uids[i] for i in members],
            np.array([self._score[i] for i in members], dtype=np.float64),
            self.config.order,
            batch_size=self.batch_size,
            seed=seed,
        )
        return [members[j] for j in positions.tolist()]

    def _choose_pool(self, rng: np.random.Generator, in_call: dict[str, set[int]]) -> str:
        sizes = {pool: len(self._order[pool]) for pool in POOLS}
        weighted = {pool: float(self.config.weights.get(pool, 0.0)) for pool in POOLS if sizes[pool]}
        weighted = {pool: w for pool, w in weighted.items() if w > 0}
        if not weighted:  # no weighted pool has prompts: uniform over prompts
            weighted = {pool: float(size) for pool, size in sizes.items() if size}
        open_pools = {pool: w for pool, w in weighted.items() if len(in_call[pool]) < sizes[pool]}
        if not open_pools:  # the call asks for more prompts than the weighted pools hold: repeats allowed
            for drawn in in_call.values():
                drawn.clear()
            open_pools = weighted
        names = list(open_pools)
        cumulative = np.cumsum([open_pools[name] for name in names])
        pick = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
        return names[min(pick, len(names) - 1)]

    def _take(self, pool: str, in_call: set[int]) -> int:
        """The pool's next prompt not yet drawn in its pass (nor in this call)."""
        order, drawn = self._order[pool], self._drawn[pool]
        cursor = self._cursor[pool]
        while cursor < len(order) and order[cursor] in drawn:
            cursor += 1
        if cursor == len(order):  # pass complete: start the next one
            self._passes[pool] += 1
            if pool == UNSEEN or self.config.order == "random":
                order = self._order[pool] = self._pool_order(pool, sorted(order))
            drawn.clear()
            cursor = 0
        # prompts this call already took wait for a later call (they stay undrawn in the pass);
        # one is always left: the call takes fewer prompts from a pool than it holds
        pick = cursor
        while order[pick] in drawn or order[pick] in in_call:
            pick += 1
        index = order[pick]
        drawn.add(index)
        in_call.add(index)
        self._cursor[pool] = cursor + 1 if pick == cursor else cursor
        return index


def _prior(extra_info: Any) -> dict[str, Any] | None:
    """extra_info.curriculum; for a plain-layout dataset the loader nests the written
    extra_info column one level down (extra_info.extra_info.curriculum)."""
    if not isinstance(extra_info, dict):
        return None
    found = extra_info.get("curriculum")
    if found is None and isinstance(extra_info.get("extra_info"), dict):
        found = extra_info["extra_info"].get("curriculum")
    return found if isinstance(found, dict) else None
