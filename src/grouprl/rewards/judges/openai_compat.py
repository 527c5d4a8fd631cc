"""The OpenAI-compatible chat-completions backend: OpenAI, vLLM and SGLang servers, Ollama,
DashScope compatible mode, Gemini's OpenAI endpoint.

Plain `httpx` rather than the `openai` SDK: the request is one POST, and the judge client owns
retries, backoff and Retry-After itself, so a second retry layer (the SDK's) would only blur
the counts and delays; with httpx every status code, header and timeout is in view.

Images go as base64 data URLs in `image_url` parts. Errors become `JudgeBackendError`, marked
retryable for 408/409/429/5xx, timeouts, connection failures and unreadable bodies. The API
key is sent in the Authorization header and nowhere else; every message this module makes
is scrubbed of it.
"""

from __future__ import annotations

import base64
import email.utils
import json
import time
from typing import Any

import httpx

from grouprl.config import JudgeConfig
from grouprl.errors import ConfigError
from grouprl.rewards.judges.base import Completion, JudgeBackendError, JudgePrompt

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
_SHARD = 4  # connections per pooled client


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
    """POST {base_url}/chat/completions through a few small httpx connection pools."""

    def __init__(self, cfg: JudgeConfig, api_key: str | None) -> None:
        if not cfg.model:
            raise ConfigError(f"judge {cfg.name!r}: set `model` (the model name the server serves)")
        self.model = cfg.model
        self.base_url = cfg.base_url.rstrip("/")
        self._cfg = cfg
        self._api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients: list[httpx.AsyncClient] = []  # created on the judge's loop at first use
        self._busy: list[int] = []  # requests out per client
        self._sizes: list[int] = []  # connections per client

    def _pick_client(self) -> int:
        """The httpx client with the most free connections, of ceil(cap / _SHARD) (made on first
        use, on the judge loop).

        httpcore's pool scans every queued request against every connection on each change,
        so one pool of 50 connections spends more CPU than the requests; pools of a few
        connections keep that scan small. Picking by free connections (not by requests out:
        the last pool may be smaller) never queues a request while another pool has room."""
        if not self._clients:
            cap = self._cfg.max_concurrent_requests
            tls = httpx.create_ssl_context()  # one for all pools: building one costs milliseconds
            for start in range(0, cap, _SHARD):
                size = min(_SHARD, cap - start)
                self._clients.append(
                    httpx.AsyncClient(
                        base_url=self.base_url + "/",
                        headers=self._headers,
                        verify=tls,
                        timeout=httpx.Timeout(self._cfg.timeout_s),
                        limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
                    )
                )
                self._busy.append(0)
                self._sizes.append(size)
        return max(range(len(self._clients)), key=lambda i: self._sizes[i] - self._busy[i])

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
        )

    async def _post(self, body: bytes) -> tuple[int, str | None, bytes]:
        shard = self._pick_client()
        self._busy[shard] += 1
        try:
            response = await self._clients[shard].post(
                "chat/completions", content=body, headers={"Content-Type": "application/json"}
            )
        except httpx.TimeoutException:
            raise JudgeBackendError(f"timed out after {self._cfg.timeout_s:g}s", retryable=True) from None
        except httpx.TransportError as e:  # connection refused/reset, truncated body, protocol errors
            raise JudgeBackendError(
                self._scrub(f"{type(e).__name__}: {e}".splitlines()[0]), retryable=True
            ) from None
        finally:
            self._busy[shard] -= 1
        return response.status_code, response.headers.get("retry-after"), response.content

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
        for client in self._clients:
            await client.aclose()
        self._clients, self._busy, self._sizes = [], [], []

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
