"""The trainer's side of the reward-model worker: `ModelPool` starts the worker process, queues
items per model and sends them in batches (up to the model's batch_size, whatever queued while
the worker was busy), and `ModelComponent` is the per-trajectory reward component on top.

A batch that fails is retried item by item, so one bad sample gets the component's fallback
(counted in reward/errors) and the others their scores. A worker that dies fails what is queued
and what comes later the same way: the run goes on. Metrics per step (`step_metrics`): items,
batches, the worker's busy seconds and the deepest queue, per model.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
import threading
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from grouprl.errors import UserError
from grouprl.processes import start_fresh
from grouprl.rewards.models.kinds import DRAWERS, check
from grouprl.rewards.models.worker import serve

log = logging.getLogger(__name__)

LINGER_S = 0.01  # how long the first queued item waits for company before a batch goes
STATS = ("items", "batches", "busy_s", "queue_max")  # per model and step
PRELOAD = ["torch", "transformers", "grouprl.rewards.models.worker"]  # the server's imports, if the worker starts it


class ModelPool:
    def __init__(self, configs: list, cache_dir: str | Path, start_timeout_s: float = 600.0) -> None:
        self.configs = {c.name: c for c in configs}
        for c in configs:  # a missing folder or package fails here, not after the worker's start-up
            try:
                check(c)
            except UserError as e:
                raise UserError(f"reward models ({', '.join(self.configs)}) failed to load: {type(e).__name__}: {e}") from None
        self._conn, child = multiprocessing.Pipe()
        self._process = start_fresh(serve, (child, list(configs), str(cache_dir)), "grouprl-reward-models", PRELOAD)
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise UserError(f"reward models did not load within {start_timeout_s:g} s")
        try:
            status, why = self._conn.recv()
        except EOFError:
            status, why = "failed", f"the worker exited (code {self._process.exitcode})"
        if status != "ready":
            self.close()
            names = ", ".join(self.configs)
            raise UserError(f"reward models ({names}) failed to load: {why}")
        self._queues: dict[str, collections.deque] = {name: collections.deque() for name in self.configs}
        self._ready = threading.Condition()
        self._closed = False
        self._dead: str | None = None
        self._stats: dict[str, dict[str, float]] = {}
        self._order = itertools.count()  # the oldest queued item's model goes first
        self._thread = threading.Thread(target=self._dispatch, name="grouprl-reward-models", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- callers
    def submit(self, name: str, item: dict[str, Any]) -> Future:
        """Queue one item for model `name`; the future holds its result (or the failure)."""
        future: Future = Future()
        with self._ready:
            if self._dead is not None:
                future.set_exception(RuntimeError(self._dead))
                return future
            queue = self._queues[name]
            queue.append((item, future, next(self._order)))
            stats = self._stats_of(name)
            stats["queue_max"] = max(stats["queue_max"], len(queue))
            self._ready.notify()
        return future

    def step_metrics(self) -> dict[str, float]:
        """Since the last call, per model: reward_model/<name>/{items, batches, busy_s, queue_max}."""
        with self._ready:
            stats, self._stats = self._stats, {}
        scorers = [n for n, c in self.configs.items() if c.kind not in DRAWERS]  # every rank: the same keys
        return {
            f"reward_model/{name}/{key}": stats.get(name, {}).get(key, 0.0) for name in scorers for key in STATS
        }

    def close(self) -> None:
        if getattr(self, "_ready", None) is not None:
            with self._ready:
                self._closed = True
                self._ready.notify_all()
            self._thread.join(timeout=30)
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)

    # -------------------------------------------------------------- the dispatcher thread
    def _stats_of(self, name: str) -> dict[str, float]:
        return self._stats.setdefault(name, dict.fromkeys(STATS, 0.0))

    def _next_batch(self) -> tuple[str, list] | None:
        with self._ready:
            while not self._closed and not any(self._queues.values()):
                self._ready.wait()
            if self._closed:
                return None
            self._ready.wait(LINGER_S)  # let the rest of a group arrive
            name = min((q[0][2], n) for n, q in self._queues.items() if q)[1]
            queue, size = self._queues[name], self.configs[name].batch_size
            return name, [queue.popleft() for _ in range(min(size, len(queue)))]

    def _dispatch(self) -> None:
        try:
            self._serve_queue()
        except BaseException as e:  # noqa: BLE001 - never leave callers waiting on a dead thread
            self._dead = f"the reward-model dispatcher stopped ({type(e).__name__}: {e})"
            log.warning("%s; model rewards fall back from now on", self._dead)
            self._fail_queued()

    def _serve_queue(self) -> None:
        calls = 0
        while (batch := self._next_batch()) is not None:
            name, entries = batch
            calls += 1
            outcome = self._call(calls, name, [item for item, *_ in entries])
            if outcome[0] == "ok":
                for (_, future, _), value in zip(entries, outcome[1]):
                    _settle(future, value)
            elif len(entries) > 1 and self._dead is None:  # find the bad item: one by one
                for item, future, _ in entries:
                    calls += 1
                    single = self._call(calls, name, [item])
                    _settle(future, single[1][0] if single[0] == "ok" else {"error": single[1]})
            else:
                for _, future, _ in entries:
                    _settle(future, {"error": outcome[1]})
            if self._dead is not None:
                self._fail_queued()

    def _call(self, call_id: int, name: str, items: list) -> tuple[str, Any]:
        if self._dead is not None:
            return "error", self._dead
        try:
            self._conn.send((call_id, name, items))
            answer_id, status, value, busy = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self._process.join(timeout=5)
            self._dead = f"the reward-model worker exited (code {self._process.exitcode})"
            log.warning("%s; model rewards fall back from now on", self._dead)
            return "error", self._dead
        assert answer_id == call_id
        with self._ready:
            stats = self._stats_of(name)
            stats["batches"] += 1
            stats["items"] += len(items)
            stats["busy_s"] += busy
        return status, value

    def _fail_queued(self) -> None:
        with self._ready:
            for queue in self._queues.values():
                while queue:
                    _settle(queue.popleft()[1], {"error": self._dead})


def _settle(future: Future, value: Any) -> None:
    """A result, or {"error": why} as the caller's exception; a future its caller cancelled
    (an interrupted step) is left alone."""
    if future.done():
        return
    if isinstance(value, dict):
        future.set_exception(RuntimeError(value["error"]))
    else:
        future.set_result(value)


class ModelComponent:
    """A reward component over a model of the pool: `await component(prompt, response, trajectory)`.
    A scorer with `images_from` draws the response (seeded by the trajectory's group, so a
    group's images differ only by prompt) and scores the image against the prompt (or the
    response); the image's path comes back with the score (`DrawnImage`), and the composite
    keeps it in `trajectory.artifacts[<model name>]`."""

    def __init__(self, pool: ModelPool, name: str) -> None:
        self.pool, self.cfg = pool, pool.configs[name]
        self.drawer = pool.configs.get(self.cfg.images_from)

    def item(self, prompt: str, response: str, trajectory) -> dict[str, Any]:
        if self.cfg.kind == "sequence_classifier":
            return {"prompt": prompt, "response": response}
        seed = (self.drawer.seed + zlib.crc32(str(trajectory.uid).encode())) % 2**31
        return {"text": prompt if self.cfg.text == "prompt" else response, "draw": response, "seed": seed}

    async def __call__(self, prompt: str, response: str, trajectory) -> float:
        result = await asyncio.wrap_future(self.pool.submit(self.cfg.name, self.item(prompt, response, trajectory)))
        if isinstance(result, list):  # [score, image path]: the composite records the path
            from grouprl.rewards.composite import DrawnImage

            return DrawnImage(float(result[0]), self.cfg.name, result[1])
        return float(result)

