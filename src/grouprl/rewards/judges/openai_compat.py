"""The OpenAI-compatible chat-completions backend: OpenAI, vLLM and SGLang servers, Ollama,
DashScope compatible mode, Gemini's OpenAI endpoint.

The transport is `aiohttp` rather than the `openai` SDK: the request is one POST, and the judge
client owns retries, backoff and Retry-After itself, so a second retry layer (the SDK's) would
only blur the counts and delays; here every status code, header and timeout is in view. aiohttp
rather than httpx because of the client's CPU per call: a wave of `max_concurrent_requests`
answers is handled one after the other on one event loop, and measured against a local server
httpx spent 1.7-3.6 ms per call (its pool re-scans queued requests on every change) where
aiohttp's connector spends about 0.5 ms, which at a cap of 50 and 200 ms latency is the
difference between waves that overlap and waves that queue.

Images go as base64 data URLs in `image_url` parts. Errors become `JudgeBackendError`, marked
retryable for 408/409/429/5xx, timeouts, connection failures and unreadable bodies. The API
key is sent in the Authorization header and nowhere else; every message this module makes
is scrubbed of it.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import random
import time
import urllib.request
from typing import Any

import aiohttp

from grouprl.config import JudgeConfig
from grouprl.errors import ConfigError
from grouprl.rewards.judges.base import Completion, JudgeBackendError, JudgePrompt

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


def backoff_delay(attempt: int, retry_after: float | None, base_s: float, max_s: float) -> float:
    """Seconds before retry `attempt` (0-based): Retry-After when given, else base * 2**attempt
    with equal jitter; capped at max_s."""
    if retry_after is not None:
        return min(retry_after, max_s)
    ceiling = min(max_s, base_s * 2**attempt)
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent/bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def chat_messages(prompt: JudgePrompt) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if prompt.system:
        messages.append({"role": "system", "content": prompt.system})
    if not prompt.image_groups:
        messages.append({"role": "user", "content": prompt.user})
        return messages
    parts: list[dict[str, Any]] = [{"type": "text", "text": prompt.user}]
    for label, images in prompt.image_groups:
        parts.append({"type": "text", "text": label})
        for image in images:
            url = f"data:{image.mime_type};base64,{base64.b64encode(image.data).decode('ascii')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
    messages.append({"role": "user", "content": parts})
    return messages


class OpenAICompatBackend:
    """POST {base_url}/chat/completions through one aiohttp connection pool."""

    def __init__(self, cfg: JudgeConfig, api_key: str | None) -> None:
        if not cfg.model:
            raise ConfigError(f"judge {cfg.name!r}: set `model` (the model name the server serves)")
        self.model = cfg.model
        self.base_url = cfg.base_url.rstrip("/")
        self._url = self.base_url + "/chat/completions"
        self._cfg = cfg
        self._api_key = api_key
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None  # made on the judge's loop at first use

    def _http(self) -> aiohttp.ClientSession:
        """The session, created on first use (it binds to the running loop): a connector of
        `max_concurrent_requests` keep-alive connections and one total timeout per request.
        Proxy variables of the environment (HTTPS_PROXY, NO_PROXY, ...) are honoured when any
        is set; only then, because reading them costs a worker-thread round trip per request."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._cfg.max_concurrent_requests, limit_per_host=0)
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self._cfg.timeout_s),
                trust_env=bool(urllib.request.getproxies()),
            )
        return self._session

    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "[redacted]") if self._api_key else text

    async def complete(self, prompt: JudgePrompt) -> Completion:
        payload = {
            "model": self.model,
            "messages": chat_messages(prompt),
            "temperature": self._cfg.temperature,
            "max_tokens": self._cfg.max_tokens,
        }
        body = json.dumps(payload).encode()
        status, retry_after, data = await self._post(body)
        if status != 200:
            raise self._status_error(status, data.decode("utf-8", errors="replace"), retry_after)
        try:
            reply = json.loads(data)
            message = reply["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            text = data.decode("utf-8", errors="replace")
            raise JudgeBackendError(
                f"unreadable response body: {self._scrub(_preview(text))}", retryable=True
            ) from None
        usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
        return Completion(
            text=self._scrub(_content_text(message.get("content"))),
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            truncated=reply["choices"][0].get("finish_reason") == "length",
        )

    async def _post(self, body: bytes) -> tuple[int, str | None, bytes]:
        try:
            async with self._http().post(self._url, data=body) as response:
                return response.status, response.headers.get("Retry-After"), await response.read()
        except asyncio.TimeoutError:  # aiohttp's ServerTimeoutError and the total timeout
            raise JudgeBackendError(f"timed out after {self._cfg.timeout_s:g}s", retryable=True) from None
        except aiohttp.ClientConnectorError as e:  # refused, DNS, TLS handshake
            raise JudgeBackendError(
                self._scrub(f"cannot connect to {self.base_url}: {e.os_error}".splitlines()[0]),
                retryable=True,
            ) from None
        except aiohttp.ClientError as e:  # reset, truncated body, protocol errors
            raise JudgeBackendError(
                self._scrub(f"{type(e).__name__}: {e}".splitlines()[0]), retryable=True
            ) from None

    def _status_error(self, status: int, text: str, retry_after: str | None) -> JudgeBackendError:
        detail = self._scrub(_preview(text))
        hint = ""
        if status in (401, 403):
            hint = (
                f" (check the key in ${self._cfg.api_key_env})"
                if self._cfg.api_key_env
                else " (no api_key_env set)"
            )
        elif status == 404:
            hint = f" (is {self.base_url} an OpenAI-compatible /v1 URL serving model {self.model!r}?)"
        return JudgeBackendError(
            f"HTTP {status}{hint}: {detail}",
            retryable=status in RETRYABLE_STATUS,
            retry_after=parse_retry_after(retry_after),
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def __repr__(self) -> str:
        return f"OpenAICompatBackend(base_url={self.base_url!r}, model={self.model!r})"


def _content_text(content: Any) -> str:
    """message.content as text; some servers send a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _preview(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
