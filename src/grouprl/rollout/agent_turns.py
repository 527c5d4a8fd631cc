"""The trajectory schedule's plumbing: the engine stepped for trajectories that each await their
own turns (`TurnDriver`), and where a rollout's time went (`Clock`).

Each trajectory of an agent rollout is a coroutine that awaits its turn's generation, then its
tool call, then its next turn. `TurnDriver.generate` queues the row's turn and waits;
`TurnDriver.run` hands the queued turns to the engine's session (`Session.submit`) and steps it
(`Session.step`) whenever some turn is queued or running, handing each turn to its trajectory
the step it ends, and sleeps when every trajectory is away at its tools. A step runs on another
thread than the event loop, so the loop goes on with the tools' I/O, the frozen answers and the
trajectories handed their turns meanwhile: the thread that called `AgentLoop.run` (`CallerThread`;
the loop then runs on a thread of its own), or, for `arun` awaited in a loop of the caller's, a
thread of the engine's own that takes the loop thread's autocast and device. Either runs one
thing at a time (a step, or a local answer generator's call), and the session is touched only
between its steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
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


class CallerThread(concurrent.futures.Executor):
    """An executor whose calls run on the thread that calls `serve` (the agent's caller), in the
    order submitted, until `stop`. The trajectory schedule steps its engine here while the event
    loop (trajectories, tools) runs on a thread of its own: a CPU's intra-op thread team belongs to
    the thread that computes, and a second thread computing beside the one that loaded the model
    runs a second team on the same cores (on the 2-core test machine a small model's decode step
    took 2.5x as long from a second thread). `post` runs a call there without waiting for it; an
    exception it raises ends `serve` after the queue has drained and is raised by it then."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: BaseException | None = None

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        self._queue.put((None, fn, args, {}))

    def stop(self) -> None:
        self._queue.put(None)

    def serve(self, on_interrupt: Callable[[], None]) -> None:
        """Run what is submitted until `stop`. On Ctrl-C (or a posted call's exception),
        `on_interrupt()` asks the loop to wind down; serving goes on until it has (its cleanup
        may still need this thread), then the interrupt is raised."""
        while True:
            try:
                item = self._queue.get(timeout=0.5)  # a timeout: Ctrl-C reaches a waiting thread
            except queue.Empty:
                continue
            except KeyboardInterrupt as e:
                self._fail(e, on_interrupt)
                continue
            if item is None:
                break
            future, fn, args, kwargs = item
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting coroutine, or raised after the loop ends
                if future is not None and isinstance(e, Exception):
                    future.set_exception(e)
                    continue
                if future is not None:  # Ctrl-C during a call: its coroutine sees an error
                    future.set_exception(RuntimeError("interrupted"))
                self._fail(e, on_interrupt)
                continue
            if future is not None:
                future.set_result(result)
        if self._failed is not None:
            raise self._failed

    def run(self, make: Callable[[], Awaitable[T]], device: torch.device) -> T:
        """`await make()` on an event loop of a thread of its own, serving its calls here until
        it ends; its result, or what it raised (Ctrl-C here, or a posted call's error, first)."""
        outcome: dict[str, Any] = {}

        async def body() -> T:
            outcome["loop"], outcome["task"] = asyncio.get_running_loop(), asyncio.current_task()
            if outcome.get("stopping"):
                raise asyncio.CancelledError
            return await make()

        def loop_thread() -> None:
            use_device(device)
            try:
                outcome["value"] = asyncio.run(body())
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                outcome["error"] = e
            finally:
                self.stop()

        def wind_down() -> None:
            outcome["stopping"] = True
            if "loop" in outcome:
                with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
                    outcome["loop"].call_soon_threadsafe(outcome["task"].cancel)

        thread = threading.Thread(target=loop_thread, name="grouprl-agent-loop", daemon=True)
        thread.start()
        try:
            self.serve(wind_down)
        finally:
            thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _fail(self, e: BaseException, on_interrupt: Callable[[], None]) -> None:
        if self._failed is None:
            self._failed = e
            on_interrupt()


class TurnDriver:
    """Steps `session` for the trajectories awaiting their turns (see the module docstring). An
    engine failure reaches every trajectory awaiting a turn, and any that asks for one later.
    `close` (always, at the rollout's end) waits for a step still running and releases rows."""

    def __init__(self, session: Session, params: SamplingParams, generator: Randomness, clock: Clock, vision: bool,
                 device: torch.device, caller: CallerThread | None = None):  # fmt: skip
        self.session, self.params, self.generator, self.clock = session, params, generator, clock
        self.vision = vision  # new images go with a turn's tokens (a VLM policy)
        self.waiting: dict[int, asyncio.Future] = {}  # row -> its turn's generation
        self.submitted: list[tuple[int, list[int], list[Any]]] = []  # turns not yet given to the session
        self.releasing: list[int] = []  # rows to release between two steps
        self.wake = asyncio.Event()
        self.error: BaseException | None = None
        self.autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        # where steps run: the caller's thread (AgentLoop.run), else a thread of the engine's own
        self.own_thread = caller is None
        self.in_flight: concurrent.futures.Future | None = None  # the last call handed to it
        self.thread = caller or concurrent.futures.ThreadPoolExecutor(1, "grouprl-engine", initializer=use_device, initargs=(device,))

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
        """`fn()` on the engine's thread, under the loop thread's autocast (on the caller's thread:
        under its own)."""
        self.in_flight = self.thread.submit(self._under_autocast, fn)
        return await asyncio.wrap_future(self.in_flight)

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
        if self.own_thread:
            self.thread.shutdown(wait=True)
        elif self.in_flight is not None:  # the caller's thread is still running it
            concurrent.futures.wait([self.in_flight])
        self.submitted = []
        for row in dict.fromkeys([*self.releasing, *rows]):
            self.session.release(row)
        self.releasing = []
