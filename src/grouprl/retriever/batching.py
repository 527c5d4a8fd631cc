"""Dynamic micro-batching: many concurrent `await submit(item)` become few `await run(items)`.

A call waits at most `window_s` for company; while `max_in_flight` batches are running, new
calls queue up and leave together as soon as one finishes (so under load batches grow by
themselves instead of piling up). A batch takes the oldest waiting calls, at most `max_batch`
of them and at most `max_cost` of summed `cost(item)` (at least one call), so one batch's work
stays bounded; calls cancelled while waiting are dropped unrun. Identical items in a batch are
run once. If `run` raises, every call of that batch raises the same exception; with
`isolate_failures` the batch is halved and each half run again until the failing items are
alone, so only their callers get the exception and the others their results.

Used by the search service (concurrent requests share one embedding pass) and the search tool
(the agent loop's concurrent tool calls share one request).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any


class MicroBatcher:
    def __init__(
        self,
        run: Callable[[list[Any]], Awaitable[Sequence[Any]]],
        *,
        window_s: float = 0.002,
        max_batch: int = 256,
        max_in_flight: int = 1,
        max_cost: float = math.inf,
        cost: Callable[[Any], float] = lambda item: 1,
        isolate_failures: bool = False,
    ):
        if max_batch < 1 or max_in_flight < 1 or window_s < 0 or max_cost <= 0:
            raise ValueError("need max_batch >= 1, max_in_flight >= 1, max_cost > 0 and window_s >= 0")
        self.run = run
        self.window_s = window_s
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.max_cost = max_cost
        self.cost = cost
        self.isolate_failures = isolate_failures
        self.batches = 0  # calls of `run` so far
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[Hashable, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._in_flight = 0
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, item: Hashable) -> Any:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (e.g. a new asyncio.run): start afresh
            self._loop, self._pending, self._timer, self._in_flight = loop, [], None, 0
        future = loop.create_future()
        self._pending.append((item, future))
        if len(self._pending) >= self.max_batch:
            self._start_batches()
        elif self._timer is None and self._in_flight < self.max_in_flight:
            self._timer = loop.call_later(self.window_s, self._start_batches)
        return await future

    def _start_batches(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._in_flight < self.max_in_flight:
            batch = self._take_batch()
            if not batch:
                break
            self._in_flight += 1
            task = self._loop.create_task(self._run_batch(batch))
            self._tasks.add(task)  # keep a reference until done
            task.add_done_callback(self._tasks.discard)

    def _take_batch(self) -> list[tuple[Hashable, asyncio.Future]]:
        """The oldest waiting calls that fit one batch; calls cancelled meanwhile are dropped."""
        self._pending = [(item, future) for item, future in self._pending if not future.done()]
        taken, total = 0, 0.0
        for item, _ in self._pending[: self.max_batch]:
            total += self.cost(item)
            if taken and total > self.max_cost:
                break
            taken += 1
        batch, self._pending = self._pending[:taken], self._pending[taken:]
        return batch

    async def _run_batch(self, batch: list[tuple[Hashable, asyncio.Future]]) -> None:
        unique = list(dict.fromkeys(item for item, _ in batch))
        try:
            outcomes = await self._outcomes(unique)
            for item, future in batch:
                if not future.done():
                    ok, value = outcomes[item]
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
        except BaseException as e:  # hand it to every waiting caller; nobody hangs
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            if not isinstance(e, Exception):
                raise
        finally:
            self._in_flight -= 1
            if self._pending:  # queued while this batch ran: they have waited long enough
                self._start_batches()

    async def _outcomes(self, items: list[Hashable]) -> dict[Hashable, tuple[bool, Any]]:
        """item -> (True, result) or (False, exception) from `run` on `items` (halved on failure
        when isolating: one bad item costs about 2 * log2(len(items)) extra runs)."""
        self.batches += 1
        try:
            results = await self.run(items)
        except Exception as e:
            if not self.isolate_failures or len(items) == 1:
                return {item: (False, e) for item in items}
            half = len(items) // 2
            return {**await self._outcomes(items[:half]), **await self._outcomes(items[half:])}
        if len(results) != len(items):
            raise RuntimeError(f"batch function returned {len(results)} results for {len(items)} items")
        return {item: (True, result) for item, result in zip(items, results)}
