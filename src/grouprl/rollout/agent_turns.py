"""The trajectory schedule's plumbing: the engine stepped for trajectories that each await their
own turns (`TurnDriver`), and where a rollout's time went (`Clock`).

Each trajectory of an agent rollout is a coroutine that awaits its turn's generation, then its
tool call, then its next turn. `TurnDriver.generate` queues the row's turn in the engine's session
(`Session.submit`) and waits; `TurnDriver.run` steps the session (`Session.step`) whenever some
turn is queued or running, handing each turn to its trajectory the step it ends, and sleeps
when every trajectory is away at its tools. A step runs on the event loop's thread (the engine's
settings, such as autocast or a device, are the thread's), and between steps the loop runs the
tools, the frozen answers and the trajectories that were handed their turns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from grouprl.rollout.engines.base import Generation, SamplingParams, Session
from grouprl.rollout.engines.streams import Randomness

T = TypeVar("T")


class Clock:
    """A rollout's time: seconds the engine generated (`engine`) and seconds at least one tool call
    was in flight (`tools`); under the trajectory schedule they overlap."""

    def __init__(self) -> None:
        self.engine = 0.0
        self.tools = 0.0
        self._calls = 0  # tool calls in flight
        self._since = 0.0  # when the first of them started

    async def tool(self, call: Awaitable[T]) -> T:
        """Await a tool call, counted in `tools` while any is in flight."""
        if self._calls == 0:
            self._since = time.perf_counter()
        self._calls += 1
        try:
            return await call
        finally:
            self._calls -= 1
            if self._calls == 0:
                self.tools += time.perf_counter() - self._since

    def metrics(self) -> dict[str, float]:
        return {"time/engine": self.engine, "time/tools": self.tools}


class TurnDriver:
    """Steps `session` for the trajectories awaiting their turns (see the module docstring). An
    engine failure reaches every trajectory awaiting a turn, and any that asks for one later."""

    def __init__(self, session: Session, params: SamplingParams, generator: Randomness, clock: Clock, vision: bool):
        self.session, self.params, self.generator, self.clock = session, params, generator, clock
        self.vision = vision  # new images go with a turn's tokens (a VLM policy)
        self.waiting: dict[int, asyncio.Future] = {}  # row -> its turn's generation
        self.wake = asyncio.Event()
        self.error: BaseException | None = None

    async def generate(self, row: int, new_tokens: list[int], new_images: list[Any]) -> Generation:
        """Row `row`'s next turn: `new_tokens` appended to its context, its continuation sampled."""
        if self.error is not None:
            raise self.error
        future = asyncio.get_running_loop().create_future()
        self.waiting[row] = future
        images = {"new_images": new_images} if self.vision else {}
        self.session.submit(row, new_tokens, self.params, self.generator, **images)
        self.wake.set()
        return await future

    async def run(self) -> None:
        """Step the session while some turn waits; forever (the rollout cancels it at its end)."""
        while True:
            if not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                continue
            started = time.perf_counter()
            try:
                ended = self.session.step()
            except BaseException as e:  # noqa: BLE001 - handed to every trajectory waiting, then raised
                self.error = e
                for future in self.waiting.values():
                    if not future.done():
                        future.set_exception(e)
                self.waiting.clear()
                raise
            self.clock.engine += time.perf_counter() - started
            for row, generation in ended:
                future = self.waiting.pop(row, None)
                if future is not None and not future.done():
                    future.set_result(generation)
            await asyncio.sleep(0)  # the trajectories handed their turns, the tools, then the next step
