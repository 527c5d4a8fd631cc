"""The native Gemini backend through the `google-genai` SDK (install the `grouprl[gemini]` extra).

The SDK is imported when a gemini judge is built, never at package import. Its own retries are
switched off (`HttpOptions(retry_options=None)` is the default: none) so the judge client's
retry loop is the only one. `google.genai.errors.APIError.code` decides what is retryable, as
for HTTP status codes. Gemini's OpenAI-compatible endpoint also works with the `openai` backend
and needs no extra package.
"""

from __future__ import annotations

from typing import Any

from grouprl.config import JudgeConfig
from grouprl.errors import ConfigError
from grouprl.rewards.judges.base import Completion, JudgeBackendError, JudgePrompt
from grouprl.rewards.judges.openai_compat import RETRYABLE_STATUS

DEFAULT_OPENAI_BASE = JudgeConfig.base_url  # a base_url left at this default means "Google's endpoint"


def import_genai() -> Any:
    try:
        from google import genai
    except ImportError:
        raise ConfigError(
            "judge backend 'gemini' needs the google-genai package: pip install 'grouprl[gemini]' "
            "(or use backend 'openai' with Gemini's OpenAI-compatible endpoint)"
        ) from None
    return genai


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
        http_options: dict[str, Any] = {"timeout": int(cfg.timeout_s * 1000)}  # milliseconds
        if cfg.base_url and cfg.base_url != DEFAULT_OPENAI_BASE:
            http_options["base_url"] = cfg.base_url
        self._client = genai.Client(api_key=api_key, http_options=types.HttpOptions(**http_options))

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
            code = int(getattr(e, "code", 0) or 0)
            message = str(getattr(e, "message", "") or type(e).__name__).replace(self._api_key, "[redacted]")
            raise JudgeBackendError(
                f"Gemini API error {code}: {' '.join(message.split())[:160]}",
                retryable=code in RETRYABLE_STATUS,
            ) from None
        except Exception as e:  # transport errors of the SDK's HTTP layer; the type name only (no secrets)
            raise JudgeBackendError(f"{type(e).__name__} calling Gemini", retryable=True) from None
        usage = getattr(response, "usage_metadata", None)
        return Completion(
            text=response.text or "",
            prompt_tokens=getattr(usage, "prompt_token_count", None),
            completion_tokens=getattr(usage, "candidates_token_count", None),
        )

    async def aclose(self) -> None:
        aio = getattr(self._client, "aio", None)
        if aio is not None and hasattr(aio, "aclose"):
            await aio.aclose()

    def __repr__(self) -> str:
        return f"GeminiBackend(model={self.model!r})"
