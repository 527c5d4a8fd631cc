"""The trajectory schedule's plumbing: the engine stepped for trajectories that each await their
own turns (`TurnDriver`), and where a rollout's time went (`Clock`).

Each trajectory of an agent rollout is a coroutine that awaits its turn's generation, then its
tool call, then its next turn. `TurnDriver.generate` queues the row's turn and waits;
`TurnDriver.run` hands the queued turns to the engine's session (`Session.submit`) and steps it
(`Session.step`) whenever some turn is queued or running, handing each turn to its trajectory
the step it ends, and sleeps when every trajectory is away at its tools. A step runs on a thread
of the engine's own, so the event loop goes on with the tools' I/O, the frozen answers and the
trajectories handed their turns meanwhile; that thread takes the loop thread's autocast and
device, and runs one thing at a time (a step, or a local answer generator's call), and the
session is touched only between its steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch

from grouprl.devices import use_device
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
    engine failure reaches every trajectory awaiting a turn, and any that asks for one later.
    `close` (always, at the rollout's end) waits for a step still running and releases rows."""

    def __init__(self, session: Session, params: SamplingParams, generator: Randomness, clock: Clock, vision: bool,
                 device: torch.device):  # fmt: skip
        self.session, self.params, self.generator, self.clock = session, params, generator, clock
        self.vision = vision  # new images go with a turn's tokens (a VLM policy)
        self.waiting: dict[int, asyncio.Future] = {}  # row -> its turn's generation
        self.submitted: list[tuple[int, list[int], list[Any]]] = []  # turns not yet given to the session
        self.releasing: list[int] = []  # rows to release between two steps
        self.wake = asyncio.Event()
        self.error: BaseException | None = None
        self.autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        self.thread = concurrent.futures.ThreadPoolExecutor(1, "grouprl-engine", initializer=use_device, initargs=(device,))

    async def generate(self, row: int, new_tokens: list[int], new_images: list[Any]) -> Generation:
        """Row `row`'s next turn: `new_tokens` appended to its context, its continuation sampled."""
        if self.error is not None:
            raise self.error
        future = asyncio.get_running_loop().create_future()
        self.waiting[row] = future
        self.submitted.append((row, new_tokens, new_images))
        self.wake.set()
        return await future

    def release(self, row: int) -> None:
        """The row has ended: its session row is dropped before the next step."""
        self.releasing.append(row)

    async def in_engine(self, fn: Callable[[], T]) -> T:
        """`fn()` on the engine's thread, under the loop thread's autocast."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, self._under_autocast, fn)

    def _under_autocast(self, fn: Callable[[], T]) -> T:
        with contextlib.ExitStack() as stack:
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype))
            return fn()

    def _hand_over(self) -> None:
        """Between two steps: rows released, turns submitted."""
        for row in self.releasing:
            self.session.release(row)
        self.releasing = []
        for row, new_tokens, new_images in self.submitted:
            images = {"new_images": new_images} if self.vision else {}
            self.session.submit(row, new_tokens, self.params, self.generator, **images)
        self.submitted = []

    async def run(self) -> None:
        """Step the session while some turn waits; forever (the rollout cancels it at its end)."""
        while True:
            self._hand_over()
            if not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                continue
            started = time.perf_counter()
            try:
                ended = await self.in_engine(self.session.step)
            except Exception as e:  # noqa: BLE001 - handed to every trajectory waiting, then raised
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

    def close(self, rows: list[int]) -> None:
        """The rollout is over (or failed): wait for a step still on the engine's thread, then
        release `rows` and those released meanwhile."""
        self.thread.shutdown(wait=True)
        self.submitted = []
        for row in dict.fromkeys([*self.releasing, *rows]):
            self.session.release(row)
        self.releasing = []
