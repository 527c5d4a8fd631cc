"""A fake OpenAI-compatible judge server on 127.0.0.1, for tests and benchmarks (not for runs).

    with FakeJudgeServer(latency=0.2) as server:      # a random free port, its own thread
        cfg = JudgeConfig(base_url=server.base_url, model="fake", ...)
        ... server.requests, server.max_in_flight, server.authorizations ...

A plain asyncio HTTP/1.1 server (keep-alive, Content-Length bodies) rather than a web framework,
so it can misbehave at the byte level: each request is answered by `behaviour(call)` -> `Reply`,
where `call` holds the request number, the parsed body and how often the same user text was
seen. Reply kinds: "ok" (a chat completion whose message is `content`), "status" (any status
code, optional Retry-After), "hang" (no answer until the client gives up), "truncated"
(a Content-Length longer than the body, then close), "garbage" (200 with a non-JSON body),
"drop" (close without answering).

Without a behaviour the judge answers `{"correctness": N}` where N is the digit after the last
"GRADE:" in the prompt (0 if none), after `latency` seconds.

`python tests/rewards/judges/fake_server.py --latency 0.2` serves in the foreground and
prints its base URL (for a benchmark client in another process); `GET /stats[?reset=1]` returns
(and resets) its request count and highest in-flight count, with the CPU seconds its process
has used (`cpu_s`, for a benchmark to tell a busy server from a busy client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_GRADE = re.compile(r"GRADE:(\d)")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 429: "Too Many Requests"}


@dataclass
class Call:
    number: int  # 1-based, over the server's life
    body: dict[str, Any]
    user_text: str
    seen: int  # how many requests (this one included) carried the same user text
    headers: dict[str, str]


@dataclass
class Reply:
    kind: str = "ok"  # ok | status | hang | truncated | garbage | drop
    content: str | None = None  # kind ok: the message text (None: the default judge)
    status: int = 200  # kind status
    body: str = ""  # kind status / garbage
    retry_after: str | None = None  # kind status: the Retry-After header value
    usage: dict[str, int] | None = field(
        default_factory=lambda: {"prompt_tokens": 11, "completion_tokens": 7}
    )
    latency: float | None = None  # None: the server's latency
    finish_reason: str = "stop"  # kind ok: "length" = cut off at max_tokens


def default_judge_text(user_text: str) -> str:
    grades = _GRADE.findall(user_text)
    return json.dumps({"correctness": int(grades[-1]) if grades else 0})


def user_text_of(body: dict[str, Any]) -> str:
    texts = []
    for message in body.get("messages", []):
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p.get("text", "") for p in content if isinstance(p, dict))
    return "\n".join(texts)


class FakeJudgeServer:
    def __init__(self, latency: float = 0.0, behaviour: Callable[[Call], Reply] | None = None) -> None:
        self.latency = latency
        self.behaviour = behaviour
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.authorizations: list[str] = []
        self.bodies: list[dict[str, Any]] = []
        self.seen: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> FakeJudgeServer:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=1024)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fake-judge-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout=10):
            raise RuntimeError("fake judge server did not start")
        return self

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> FakeJudgeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- serving ---------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        key, value = line.split(":", 1)
                        headers[key.strip().lower()] = value.strip()
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                target = lines[0].split(" ")[1] if " " in lines[0] else ""
                if target.startswith("/stats"):
                    keep_open = await self._send_stats(reset="reset=1" in target, writer=writer)
                else:
                    keep_open = await self._answer(raw, headers, reader, writer)
                if not keep_open:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return  # the client went away, or the server is stopping
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _answer(self, raw: bytes, headers: dict[str, str], reader, writer) -> bool:
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        text = user_text_of(body)
        with self._lock:
            self.requests += 1
            self.seen[text] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.authorizations.append(headers.get("authorization", ""))
            self.bodies.append(body)
            call = Call(self.requests, body, text, self.seen[text], headers)
        try:
            reply = self.behaviour(call) if self.behaviour else Reply()
            delay = self.latency if reply.latency is None else reply.latency
            if reply.kind == "hang":
                await reader.read()  # until the client closes the connection
                return False
            if delay:
                await asyncio.sleep(delay)
            return await self._send(reply, call, writer)
        finally:
            with self._lock:
                self.in_flight -= 1

    def stats(self, reset: bool = False) -> dict[str, float]:
        with self._lock:
            counts = {
                "requests": self.requests,
                "max_in_flight": self.max_in_flight,
                "in_flight": self.in_flight,
                "cpu_s": time.process_time(),
            }
            if reset:
                self.requests, self.max_in_flight = 0, self.in_flight
        return counts

    async def _send_stats(self, reset: bool, writer: asyncio.StreamWriter) -> bool:
        data = json.dumps(self.stats(reset)).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
            + data
        )
        await writer.drain()
        return True

    async def _send(self, reply: Reply, call: Call, writer: asyncio.StreamWriter) -> bool:
        if reply.kind == "drop":
            return False
        status, extra, keep_open = 200, "", True
        if reply.kind == "ok":
            content = default_judge_text(call.user_text) if reply.content is None else reply.content
            payload = {
                "id": f"fake-{call.number}",
                "object": "chat.completion",
                "model": call.body.get("model", ""),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": reply.finish_reason,
                    }
                ],
            }
            if reply.usage is not None:
                payload["usage"] = reply.usage
            data = json.dumps(payload).encode()
        elif reply.kind == "status":
            status, data = reply.status, reply.body.encode()
            if reply.retry_after is not None:
                extra = f"Retry-After: {reply.retry_after}\r\n"
        elif reply.kind == "garbage":
            data = (reply.body or "<html>502 upstream garbage</html>").encode()
        elif reply.kind == "truncated":
            data, keep_open = b'{"choices": [{"message": {"content": "{\\"correc', False
        else:
            raise ValueError(f"unknown reply kind {reply.kind!r}")
        length = len(data) + (500 if reply.kind == "truncated" else 0)
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n"
        )
        writer.write(head.encode() + data)
        await writer.drain()
        return keep_open


def main() -> None:
    parser = argparse.ArgumentParser(
        description="A fake OpenAI-compatible judge on 127.0.0.1 (tests, benchmarks)."
    )
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    args = parser.parse_args()
    server = FakeJudgeServer(latency=args.latency).start()
    print(server.base_url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
