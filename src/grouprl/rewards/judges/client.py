"""`JudgeClient`: a backend plus rendering, parsing, the cache, the concurrency cap and retries.

The client runs its own event loop on a daemon thread and every judge call executes there, so
the semaphore (`max_concurrent_requests`), the HTTP connection pool, the in-flight table and
the cache are shared by all callers, whatever loop or thread they call from: overlapping
`CompositeReward.ascore` calls, `score` (which runs its own loop) and the re-score command
all meet the same cap. Cancelling a caller cancels its call on the judge loop.

One call: render the prompt (images encoded in a worker thread) -> cache lookup -> join an
identical request already in flight, if any -> up to 1 + max_retries attempts, each holding a
semaphore slot only while its request is out; retried on 429/5xx, timeouts, connection errors
and unparsable output, after Retry-After (seconds) when the server sends one, else after
exponential backoff with jitter, both capped at backoff_max_s. The call never raises for a
judge fault: a failure is a `JudgeResult` with `error` set and NaN aggregate.

Calls that reached the judge and failed after their retries are counted in a row
(`consecutive_failures`, reset by any answer); with `max_consecutive_failures` set, reaching it
marks the judge `down` and later calls fail at once (cache hits still answer), so a judge that
stopped answering costs one round of timeouts, not a whole step of them. The trainer decides
what to do about it (rewards.failures.rewards_down).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from grouprl.config import JudgeConfig
from grouprl.errors import ConfigError
from grouprl.rewards.judges.base import (
    Backend,
    Completion,
    JudgeBackendError,
    JudgePrompt,
    JudgeRequest,
    JudgeResult,
)
from grouprl.rewards.judges.cache import JudgeCache, cache_key
from grouprl.rewards.judges.images import JudgeImageError
from grouprl.rewards.judges.log import JudgeLog
from grouprl.rewards.judges.openai_compat import backoff_delay
from grouprl.rewards.judges.parsing import JudgeParseError, parse_scores
from grouprl.rewards.judges.prompt import fenced_texts, load_template, render

logger = logging.getLogger(__name__)


def api_key_from_env(cfg: JudgeConfig) -> str | None:
    """The key from the variable named by `api_key_env`; None when no variable is named."""
    if not cfg.api_key_env:
        return None
    key = os.environ.get(cfg.api_key_env, "").strip()
    if not key:
        raise ConfigError(
            f"judge {cfg.name!r}: environment variable {cfg.api_key_env} (api_key_env) is not set"
        )
    return key


def build_backend(cfg: JudgeConfig) -> Backend:
    if cfg.backend == "openai":
        from grouprl.rewards.judges.openai_compat import OpenAICompatBackend

        return OpenAICompatBackend(cfg, api_key_from_env(cfg))
    if cfg.backend == "gemini":
        from grouprl.rewards.judges.gemini import GeminiBackend

        return GeminiBackend(cfg, api_key_from_env(cfg))
    if cfg.backend == "local":
        from grouprl.rewards.judges.local_hf import LocalHFBackend

        return LocalHFBackend(cfg)
    raise ConfigError(f"judge {cfg.name!r}: backend must be openai, gemini or local, got {cfg.backend!r}")


class _LoopThread:
    """An event loop running forever on a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"judge-{name}", daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class JudgeClient:
    """A judge: `await client.judge(request)` from any loop; `client.judge_many(requests)` from sync code."""

    def __init__(
        self,
        cfg: JudgeConfig,
        backend: Backend | None = None,
        *,
        log_path: str | Path | None = None,
        max_consecutive_failures: int = 0,
    ):
        self.cfg = cfg
        self.name = cfg.name
        self.template = load_template(cfg.prompt_template)
        self.backend = backend if backend is not None else build_backend(cfg)
        self.cache = JudgeCache(cfg.cache_path) if cfg.cache_path else None
        chosen_log = cfg.log_path or log_path
        self.log = JudgeLog(chosen_log) if chosen_log else None
        self._thread = _LoopThread(cfg.name)
        self._semaphore: asyncio.Semaphore | None = None  # made on the judge loop
        self._in_flight: dict[str, asyncio.Future] = {}  # cache key -> the call that will answer it
        self._closed = False
        self.max_consecutive_failures = max_consecutive_failures  # 0: never marked down
        # updated on the judge loop only: calls sent that failed in a row, the last one's error,
        # and why calls now fail without being sent (None: they are sent)
        self.consecutive_failures = 0
        self.last_error = ""
        self.down: str | None = None

    # -- entry points --------------------------------------------------------------------
    async def judge(self, request: JudgeRequest) -> JudgeResult:
        if self._closed:
            raise RuntimeError(f"judge {self.name!r} is closed")
        return await asyncio.wrap_future(self._thread.submit(self._judge(request)))

    def judge_many(self, requests: list[JudgeRequest]) -> list[JudgeResult]:
        """Judge all concurrently (up to the cap) and wait; for callers outside an event loop."""

        async def every() -> list[JudgeResult]:
            return list(await asyncio.gather(*(self._judge(r) for r in requests)))

        return self._thread.submit(every()).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._thread.submit(self.backend.aclose()).result(timeout=10)
        except Exception as e:  # closing must not mask what the caller is doing
            logger.debug("closing judge %r backend: %s", self.name, type(e).__name__)
        self._thread.stop()
        if self.cache is not None:
            self.cache.close()
        if self.log is not None:
            self.log.close()

    def __repr__(self) -> str:
        return f"JudgeClient(name={self.name!r}, backend={self.backend!r})"

    # -- one call, on the judge loop -----------------------------------------------------
    async def _judge(self, request: JudgeRequest) -> JudgeResult:
        shown: list[JudgePrompt] = []  # the rendered prompt, for the log
        result = await self._judge_unlogged(request, shown)
        if self.log is not None:
            self.log.write(self.name, self.backend.model, request.request_id, result, shown[0] if shown else None)
        return result

    async def _judge_unlogged(self, request: JudgeRequest, shown: list) -> JudgeResult:
        cfg = self.cfg
        make_prompt = functools.partial(
            render,
            self.template,
            request,
            system=cfg.system_prompt,
            max_pixels=cfg.image_max_pixels,
            image_base_path=cfg.image_base_path,
        )
        try:  # decoding and resizing images is CPU work: keep it off the judge loop
            has_images = bool(request.retrieved_images or request.gold_images)
            prompt = await asyncio.to_thread(make_prompt) if has_images else make_prompt()
        except JudgeImageError as e:
            return JudgeResult(error=f"bad input: {e}")
        shown.append(prompt)
        key = cache_key(cfg.backend, self.backend.model, prompt, cfg.temperature, cfg.max_tokens)
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            try:
                return self._scored(hit, prompt, cached=True, attempts=0, latency_s=0.0)
            except JudgeParseError:  # stored under other fields/scale: ask again
                pass
        while key in self._in_flight:  # the same prompt is being judged: wait for that answer
            shared = await asyncio.shield(self._in_flight[key])
            if shared is not None:  # None: its caller was cancelled; ask ourselves
                return dataclasses.replace(shared, cached=True, attempts=0, latency_s=0.0)
        if self.down is not None:
            return JudgeResult(error=f"judge not called: {self.down}")
        future: asyncio.Future[JudgeResult | None] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        result = None
        try:
            result = await self._call_with_retries(prompt, key)
            self._count(result)
        finally:
            del self._in_flight[key]
            future.set_result(result)
        return result

    def _count(self, result: JudgeResult) -> None:
        """Failed calls in a row; at max_consecutive_failures the judge is marked down."""
        if result.attempts == 0:  # not sent: says nothing about the judge
            return
        if result.ok:
            self.consecutive_failures = 0
            return
        self.consecutive_failures += 1
        self.last_error = result.error or ""
        limit = self.max_consecutive_failures
        if limit and self.consecutive_failures >= limit and self.down is None:
            self.down = f"{self.consecutive_failures} calls in a row failed (last: {self.last_error})"
            logger.warning("judge %r: %s; its later calls fail without being sent", self.name, self.down)

    async def _call_with_retries(self, prompt: JudgePrompt, key: str) -> JudgeResult:
        cfg = self.cfg
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(cfg.max_concurrent_requests)
        attempts, latency, error, raw = 0, 0.0, "", ""
        for attempt in range(cfg.max_retries + 1):
            retry_after: float | None = None
            async with self._semaphore:
                if self.down is not None:  # marked down while this call waited for a slot
                    error = error or f"judge not called: {self.down}"
                    break
                attempts += 1
                started = time.perf_counter()
                try:
                    completion = await asyncio.wait_for(self.backend.complete(prompt), cfg.timeout_s)
                except (asyncio.TimeoutError, TimeoutError):
                    completion, error, retryable = None, f"timed out after {cfg.timeout_s:g}s", True
                except JudgeBackendError as e:
                    completion, error, retryable, retry_after = None, str(e), e.retryable, e.retry_after
                except Exception as e:  # a backend bug must not stop training: fail this call
                    completion, error, retryable = None, f"{type(e).__name__} in the judge backend", False
                    logger.debug("judge %r backend raised", self.name, exc_info=True)
                latency = time.perf_counter() - started
            if completion is not None:
                raw = completion.text
                try:
                    result = self._scored(completion, prompt, cached=False, attempts=attempts, latency_s=latency)
                except JudgeParseError as e:
                    error, retryable = f"unparsable judge output: {e}", True
                else:
                    if self.cache is not None:
                        self.cache.put(key, completion)
                    return result
            if not retryable or attempt == cfg.max_retries:
                break
            await asyncio.sleep(self._delay(attempt, retry_after))
        return JudgeResult(raw=raw, error=error, attempts=attempts, latency_s=latency)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        return backoff_delay(attempt, retry_after, self.cfg.backoff_base_s, self.cfg.backoff_max_s)

    def _scored(
        self, completion: Completion, prompt: JudgePrompt, *, cached: bool, attempts: int, latency_s: float
    ) -> JudgeResult:
        """The completion's scores; a score it copies from the policy's fenced text is no verdict."""
        parsed = parse_scores(
            completion.text,
            self.cfg.fields,
            self.cfg.scale,
            truncated=completion.truncated,
            quoted=fenced_texts(prompt),
        )
        return JudgeResult(
            scores=parsed.scores,
            aggregate=parsed.aggregate,
            raw=completion.text,
            cached=cached,
            attempts=attempts,
            latency_s=latency_s,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
        )

