"""The native Gemini backend through the `google-genai` SDK (install the `grouprl[gemini]` extra).

The SDK is imported when a gemini judge is built, never at package import. Its own retries are
switched off so the judge client's retry loop is the only one: `HttpRetryOptions(attempts=1)`,
because with no retry options at all the SDK's aiohttp transport still retries a failed
connection once, after sleeping 1-10 s. `HttpOptions.timeout` (milliseconds) is `timeout_s`.

A request is `POST {base}/{api_version}/models/{model}:generateContent` with the key in the
`x-goog-api-key` header; images go as inline base64 parts with their MIME type, the system
prompt as `systemInstruction`. `google.genai.errors.APIError.code` decides what is retryable, as
for HTTP status codes, and its response's Retry-After header is honoured; transport timeouts,
connection errors and bodies that are not JSON are retryable. Usage comes from
`usage_metadata`: `prompt_token_count`, and `candidates_token_count` plus `thoughts_token_count`
(thinking tokens are generated and billed as output) for the completion. The API key is
scrubbed from error messages and judge text. Gemini's OpenAI-compatible endpoint also works with
the `openai` backend and needs no extra package.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from typing import Any

from grouprl.config import JudgeConfig
from grouprl.errors import ConfigError
from grouprl.rewards.judges.base import Completion, JudgeBackendError, JudgePrompt
from grouprl.rewards.judges.openai_compat import RETRYABLE_STATUS, parse_retry_after

DEFAULT_OPENAI_BASE = JudgeConfig.base_url  # a base_url left at this default means "Google's endpoint"


def import_genai() -> Any:
    try:  # import_module, not `from google import genai`: a namespace attribute outlives sys.modules
        genai = importlib.import_module("google.genai")
    except ImportError:
        raise ConfigError(
            "judge backend 'gemini' needs the google-genai package: pip install 'grouprl[gemini]' "
            "(or use backend 'openai' with Gemini's OpenAI-compatible endpoint)"
        ) from None
    return genai


def _timeout_types() -> tuple[type[BaseException], ...]:
    """Timeouts of the SDK's transports: asyncio's (aiohttp) and httpx's / httpx2's, where loaded."""
    found: list[type[BaseException]] = [TimeoutError, asyncio.TimeoutError]
    for name in ("httpx", "httpx2"):
        module = sys.modules.get(name)
        if module is not None and isinstance(getattr(module, "TimeoutException", None), type):
            found.append(module.TimeoutException)
    return tuple(found)


class GeminiBackend:
    def __init__(self, cfg: JudgeConfig, api_key: str | None) -> None:
        if not cfg.model:
            raise ConfigError(f"judge {cfg.name!r}: set `model`, e.g. gemini-2.5-flash")
        if not api_key:
            raise ConfigError(
                f"judge {cfg.name!r}: the gemini backend needs api_key_env naming a set variable"
            )
        genai = import_genai()
        from google.genai import types

        self._types = types
        self._cfg = cfg
        self._api_key = api_key
        self.model = cfg.model
        http_options: dict[str, Any] = {
            "timeout": max(1, round(cfg.timeout_s * 1000)),  # milliseconds
            "retry_options": types.HttpRetryOptions(attempts=1),
        }
        self._where = ""  # in connection errors: the endpoint, when it is not Google's
        if cfg.base_url and cfg.base_url != DEFAULT_OPENAI_BASE:
            http_options["base_url"] = cfg.base_url
            self._where = f" at {cfg.base_url}"
        self._client = genai.Client(api_key=api_key, http_options=types.HttpOptions(**http_options))

    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "[redacted]")

    def _contents(self, prompt: JudgePrompt) -> list[Any]:
        parts = [self._types.Part.from_text(text=prompt.user)]
        for label, images in prompt.image_groups:
            parts.append(self._types.Part.from_text(text=label))
            parts.extend(self._types.Part.from_bytes(data=i.data, mime_type=i.mime_type) for i in images)
        return parts

    async def complete(self, prompt: JudgePrompt) -> Completion:
        from google.genai import errors

        config = self._types.GenerateContentConfig(
            temperature=self._cfg.temperature,
            max_output_tokens=self._cfg.max_tokens,
            system_instruction=prompt.system or None,
        )
        try:
            response = await self._client.aio.models.generate_content(
                model=self.model, contents=self._contents(prompt), config=config
            )
        except errors.APIError as e:
            raise self._api_error(e) from None
        except _timeout_types():
            raise JudgeBackendError(f"timed out after {self._cfg.timeout_s:g}s", retryable=True) from None
        except (json.JSONDecodeError, errors.UnknownApiResponseError) as e:  # a body that is not JSON
            raise JudgeBackendError(
                f"unreadable response body from Gemini ({type(e).__name__})", retryable=True
            ) from None
        except Exception as e:  # connection errors of the SDK's HTTP layer; the type name only (no secrets)
            raise JudgeBackendError(
                self._scrub(f"{type(e).__name__} calling Gemini{self._where}"), retryable=True
            ) from None
        usage = getattr(response, "usage_metadata", None)
        output = [getattr(usage, name, None) for name in ("candidates_token_count", "thoughts_token_count")]
        counted = [n for n in output if n is not None]
        candidates = getattr(response, "candidates", None) or []
        finish = getattr(candidates[0], "finish_reason", None) if candidates else None
        return Completion(
            text=self._scrub(response.text or ""),
            prompt_tokens=getattr(usage, "prompt_token_count", None),
            completion_tokens=sum(counted) if counted else None,
            truncated="MAX_TOKENS" in str(finish),  # FinishReason.MAX_TOKENS
        )

    def _api_error(self, e: Any) -> JudgeBackendError:
        code = int(getattr(e, "code", 0) or 0)
        status = getattr(e, "status", None)
        message = self._scrub(" ".join(str(getattr(e, "message", "") or type(e).__name__).split()))
        hint = ""
        if code in (401, 403):
            hint = f" (check the key in ${self._cfg.api_key_env})"
        elif code == 404:
            hint = f" (is {self.model!r} a Gemini model name?)"
        headers = getattr(getattr(e, "response", None), "headers", None)
        retry_after = headers.get("Retry-After") if headers is not None else None
        head = f"Gemini API error {code}" + (f" {status}" if isinstance(status, str) and status else "")
        return JudgeBackendError(
            self._scrub(f"{head}{hint}: {message[:160]}"),
            retryable=code in RETRYABLE_STATUS,
            retry_after=parse_retry_after(retry_after),
        )

    async def aclose(self) -> None:
        aio = getattr(self._client, "aio", None)
        if aio is not None and hasattr(aio, "aclose"):
            await aio.aclose()
        if hasattr(self._client, "close"):
            self._client.close()  # the SDK's sync HTTP client, made with the async one

    def __repr__(self) -> str:
        return f"GeminiBackend(model={self.model!r})"
