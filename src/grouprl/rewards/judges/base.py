"""What a judge takes and gives back, and the two protocols behind it.

A `JudgeRequest` holds what one answer is judged on; a `JudgeResult` holds the named scores
(each in [0, 1]), their weighted aggregate, the judge's raw text and how the call went
(attempts, cache hit, latency, tokens, error). A `Backend` turns a rendered prompt into text;
a `Judge` (see `client.JudgeClient`) adds rendering, parsing, the cache, the concurrency cap
and retries on top of a backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class JudgeRequest:
    """One answer to judge. Images are bytes, paths, PIL images or {"bytes"|"path": ...} dicts."""

    question: str
    response: str  # the policy's full response (observations included for agents)
    answer: str = ""  # the extracted final answer ("" when none was found)
    gold_answer: str = ""
    retrieved_images: list[Any] = field(default_factory=list)
    gold_images: list[Any] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # more template fields, e.g. {"level": 2}
    request_id: str = ""  # shows up in judge.jsonl, e.g. "<uid>/<sample>"


@dataclass
class JudgeResult:
    """The outcome of judging one request. `error` set means it failed: `aggregate` is NaN."""

    scores: dict[str, float] = field(default_factory=dict)  # field -> value in [0, 1]
    aggregate: float = math.nan
    raw: str = ""  # the judge's text, as received
    error: str | None = None  # one line, never a secret
    cached: bool = False
    attempts: int = 0  # requests sent (0 for a cache hit)
    latency_s: float = 0.0  # duration of the last request sent
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def retries(self) -> int:
        return max(self.attempts - 1, 0)


@dataclass
class ImagePart:
    """An image ready to send: encoded bytes and their MIME type."""

    data: bytes
    mime_type: str


@dataclass
class JudgePrompt:
    """A rendered prompt: an optional system text, the user text, and labelled image groups."""

    system: str
    user: str
    image_groups: list[tuple[str, list[ImagePart]]] = field(default_factory=list)  # (label, images)
    nonce: str = ""  # this call's marker around the policy's text (prompt.py), "" when none


@dataclass
class Completion:
    """A backend's answer: the text and, when the server reports them, token counts."""

    text: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    truncated: bool = False  # stopped at the token limit (max_tokens), not by the judge's own end


class JudgeBackendError(Exception):
    """A backend call that failed; `retryable` says whether trying again may help.

    `retry_after` is the server's Retry-After in seconds when it sent one. The message must
    hold no secret (no API key, no request headers).
    """

    def __init__(self, message: str, *, retryable: bool, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


class Backend(Protocol):
    """Turns prompts into judge text. `complete` is called from the judge's own event loop."""

    model: str

    async def complete(self, prompt: JudgePrompt) -> Completion: ...

    async def aclose(self) -> None: ...


class Judge(Protocol):
    """Judges requests; safe to call from any event loop, concurrently."""

    name: str

    async def judge(self, request: JudgeRequest) -> JudgeResult: ...

    def close(self) -> None: ...
