"""Async client of the retrieval service (see service.py for the API).

A search call goes out as requests that a service with the default limits accepts (at most
`MAX_QUERIES` queries and a body of at most `MAX_QUERY_CHARS` bytes each, so at most that many
characters of query text), one after another. Connection errors, timeouts and 5xx replies
(503: the service's deadline passed) are retried with exponential backoff
(`backoff * 2**attempt` seconds); a 4xx reply (our request is wrong: 400, 413 too big, 422 a bad
query) or a reply that is not the expected JSON fails at once. Every failure the caller sees is
a `RetrievalServiceError` (a `UserError`) whose one line names the URL and the cause.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from grouprl.errors import UserError
from grouprl.retriever.service import MAX_QUERIES, MAX_QUERY_CHARS


class RetrievalServiceError(UserError):
    """The retrieval service could not be reached or gave an unusable answer."""


class RetrievalClient:
    """`await RetrievalClient("http://127.0.0.1:8002").search(["query", ...], top_k=5)`.

    `url` is the service's base URL; a URL ending in /search (the source's
    `retriever.url`) is accepted too. One `httpx.AsyncClient` is kept per event loop.
    """

    def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5):
        base = url.rstrip("/")
        self.url = base[: -len("/search")] if base.endswith("/search") else base
        self.timeout = timeout
        self.retries = retries  # extra attempts after the first
        self.backoff = backoff
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"RetrievalClient({self.url!r})"

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:  # a client is bound to its loop
            self._client = httpx.AsyncClient(base_url=self.url, timeout=self.timeout)
            self._client_loop = loop
        return self._client

    async def aclose(self) -> None:
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._client_loop = None

    async def search(self, queries: list[str], top_k: int = 5) -> list[list[dict[str, Any]]]:
        """Hits per query, each {id, score, text, title, image, rank} like `Retriever.search`."""
        if not queries:
            return []
        # ASCII JSON: text that UTF-8 cannot encode (a lone surrogate) reaches the service as an
        # escape and comes back as its one-line 422, instead of failing here in httpx's encoder
        items = [json.dumps({"query": q, "id": str(i)}) for i, q in enumerate(queries)]
        parts = _parts(items)
        reply: list[Any] = []
        for start, end in parts:
            what = "the request" if len(parts) == 1 else f"the request for queries {start} to {end - 1}"
            answered = await self._request(
                "POST",
                "/search",
                what=what,
                content="[" + ",".join(items[start:end]) + "]",
                headers={"content-type": "application/json"},
                params={"top_k": top_k},
            )
            if not isinstance(answered, list) or len(answered) != end - start:
                raise RetrievalServiceError(
                    f"retrieval service at {self.url} answered {end - start} queries with "
                    f"{len(answered) if isinstance(answered, list) else type(answered).__name__}"
                )
            reply += answered
        try:
            return [
                [
                    {
                        "id": str(r["doc_id"]),
                        "score": float(r["score"]),
                        "text": r.get("text") or "",
                        "title": r.get("title") or "",
                        "image": r.get("image"),
                        "rank": int(r.get("rank", rank)),
                    }
                    for rank, r in enumerate(entry["results"], start=1)
                ]
                for entry in reply
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise RetrievalServiceError(
                f"retrieval service at {self.url} gave an unexpected reply ({type(e).__name__}: {e})"
            ) from None

    async def health(self) -> dict[str, Any]:
        return await self._request("GET", "/health")

    async def _request(self, method: str, path: str, *, what: str = "the request", **kwargs: Any) -> Any:
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = await self._http().request(method, path, **kwargs)
            except httpx.TimeoutException:
                problem = f"timed out after {self.timeout:g} s"
                continue
            except httpx.TransportError as e:  # refused, reset, DNS, ...
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            if response.status_code >= 500:
                problem = f"HTTP {response.status_code}: {_excerpt(response)}"
                continue
            if response.status_code >= 400:
                raise RetrievalServiceError(
                    f"retrieval service at {self.url} rejected {what}: HTTP {response.status_code}: "
                    f"{_excerpt(response)}"
                )
            try:
                return response.json()
            except ValueError:
                raise RetrievalServiceError(
                    f"retrieval service at {self.url} replied with non-JSON ({_excerpt(response)!r}); "
                    "is that URL a grouprl retriever?"
                ) from None
        attempts = self.retries + 1
        raise RetrievalServiceError(
            f"retrieval service at {self.url} failed after {attempts} attempt{'s' * (attempts != 1)}: {problem}"
        )


def _parts(items: list[str]) -> list[tuple[int, int]]:
    """[start, end) spans of JSON-encoded items, each a body the default limits accept (a single
    item over them still goes alone, and the service's 413 says why)."""
    spans, start, size = [], 0, 2  # the brackets
    for i, item in enumerate(items):
        if i > start and (i - start == MAX_QUERIES or size + len(item) + 1 > MAX_QUERY_CHARS):
            spans.append((start, i))
            start, size = i, 2
        size += len(item) + 1  # and its comma
    spans.append((start, len(items)))
    return spans


def _excerpt(response: httpx.Response, limit: int = 200) -> str:
    """The server's message: FastAPI's {"detail": ...} or the start of the body, on one line."""
    try:
        body = response.json()
        text = body["detail"] if isinstance(body, dict) and "detail" in body else str(body)
    except ValueError:
        text = response.text
    return " ".join(str(text).split())[:limit]
