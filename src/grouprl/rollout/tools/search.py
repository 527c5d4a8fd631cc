"""The `<search>query</search>` tool: retrieval over the page corpus, micro-batched.

The agent loop awaits the tool calls of one turn concurrently (one per active sample). Calls
that arrive within `batch_window_s` of the first pending one, or while `max_in_flight` requests
are in flight, are sent to the backend as one batch (identical queries once; see
retriever/batching.py), so B x n_agent searches cost one embedding pass or one HTTP request
instead of B x n_agent. Under the trajectory schedule searches come one by one: with several
requests allowed in flight (agent.retriever.max_in_flight for the HTTP service; the in-process
index searches one batch at a time on this machine's cores), a search does not wait for an
earlier one's slow reply.

The backend is an in-process `Retriever` (searched in a worker thread) or a
`RetrievalClient` (async HTTP). A failing backend gives the policy an error observation; after
`max_consecutive_failures` failed backend requests in a row (counted across the whole run,
reset by any success) the tool raises `SearchUnavailableError`, which stops the run instead of
training on zero rewards.

Images: the first `max_images` hits that have a page image are shown, and the first of them
becomes `state.current_image` (its path), which `<bbox>` crops. `state.current_image_size` is
the size shown to the policy: the original size, or, when `max_pixels` > 0 and the page has
more pixels, the aspect-preserving size `floor(w * s), floor(h * s)` with
`s = sqrt(max_pixels / (w * h))`, and the observation then carries the resized image itself.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from typing import Any

from grouprl.errors import ConfigError, UserError
from grouprl.retriever.batching import MicroBatcher
from grouprl.rollout.tools.base import AgentState, Observation

logger = logging.getLogger(__name__)


class SearchUnavailableError(UserError):
    """The retrieval backend failed too many times in a row; the run cannot go on."""


class SearchTool:
    name = "search"

    def __init__(
        self,
        backend: Any,
        *,
        top_k: int = 3,
        max_consecutive_failures: int = 5,
        max_chars: int = 1500,
        max_images: int = 1,
        max_pixels: int = 0,
        batch_window_s: float = 0.002,
        max_batch: int = 256,
        max_in_flight: int = 1,
    ):
        if min(top_k, max_consecutive_failures, max_batch, max_chars, max_in_flight) < 1:
            raise ConfigError(
                "search tool: top_k, max_consecutive_failures, max_batch, max_chars and "
                "agent.retriever.max_in_flight must be >= 1"
            )
        self.backend = backend
        self.top_k = top_k
        self.max_consecutive_failures = max_consecutive_failures
        self.max_chars = max_chars  # budget for all snippets of one observation
        self.max_images = max_images
        self.max_pixels = max_pixels  # 0 = show page images at their original size
        self.consecutive_failures = 0
        self._is_async = inspect.iscoroutinefunction(getattr(backend, "search", None))
        self._batcher = MicroBatcher(
            self._search_batch, window_s=batch_window_s, max_batch=max_batch, max_in_flight=max_in_flight
        )
        self._warned: set[str] = set()  # page images already reported missing

    @property
    def backend_calls(self) -> int:
        """Batched requests sent to the backend so far."""
        return self._batcher.batches

    @property
    def where(self) -> str:
        url = getattr(self.backend, "url", None)
        return f"retrieval service at {url}" if url else "in-process retriever"

    async def __call__(self, argument: str, state: AgentState) -> Observation:
        query = " ".join(argument.split())
        if not query:
            state.count_error("search_empty_query")
            return Observation(
                text="Empty search query: write the query inside <search>...</search>.", error="empty query"
            )
        result = await self._enqueue(query)
        if isinstance(result, UserError):
            state.count_error("search_failed")
            return Observation(text=f"Search failed ({result}). You may search again.", error=str(result))
        return self._observation(query, result, state)

    async def _enqueue(self, query: str) -> list[dict[str, Any]] | UserError:
        """The query's hits, or the UserError that made its batch fail (SearchUnavailableError raises)."""
        try:
            return await self._batcher.submit(query)
        except SearchUnavailableError:
            raise
        except UserError as e:
            return e

    async def _search_batch(self, queries: list[str]) -> list[list[dict[str, Any]]]:
        """One backend request for a batch of distinct queries; counts failures in a row."""
        try:
            hits = await self._backend_search(queries)
        except UserError as e:
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.max_consecutive_failures:
                raise SearchUnavailableError(
                    f"{self.where} failed {self.consecutive_failures} times in a row; last error: {e}"
                ) from e
            raise
        self.consecutive_failures = 0
        return hits

    async def _backend_search(self, queries: list[str]) -> list[list[dict[str, Any]]]:
        if self._is_async:
            return await self.backend.search(queries, top_k=self.top_k)
        results = await asyncio.to_thread(self.backend.search, queries, self.top_k)
        return [[h.to_dict() if hasattr(h, "to_dict") else dict(h) for h in hits] for hits in results]

    # -- what the policy sees ------------------------------------------------------------
    def _observation(self, query: str, hits: list[dict[str, Any]], state: AgentState) -> Observation:
        hits = [dict(hit) for hit in hits]  # callers with the same query got the same list
        state.add_hits(hits)
        if not hits:
            return Observation(text=f'No results for "{query}".')
        budget = max(1, self.max_chars // len(hits))  # characters per snippet
        lines = [f'Results for "{query}":']
        for rank, hit in enumerate(hits, start=1):
            title = f" | {hit['title']}" if hit.get("title") else ""
            lines.append(f"[{rank}] {hit['id']}{title}")
            snippet = " ".join((hit.get("text") or "").split())
            if snippet:
                lines.append(snippet if len(snippet) <= budget else snippet[: budget - 1] + "…")
        images = self._show_images(hits, state)
        return Observation(text="\n".join(lines), images=images, retrieved=hits)

    def _show_images(self, hits: list[dict[str, Any]], state: AgentState) -> list[Any]:
        from PIL import Image

        shown: list[Any] = []
        for hit in hits:
            if len(shown) >= self.max_images or not hit.get("image"):
                continue
            path = hit["image"]
            try:
                with Image.open(path) as image:
                    size = image.size
                    display = self._display_size(size)
                    shown_image = path if display == size else image.convert("RGB").resize(display)
            except OSError as e:  # missing or unreadable page image: show the text only
                state.count_error("search_image_missing")
                if path not in self._warned:  # once per page, not once per sample
                    self._warned.add(path)
                    logger.warning("page image of %s unreadable (%s): %s", hit["id"], path, e)
                continue
            if not shown:
                state.current_image, state.current_image_size = path, display
            shown.append(shown_image)
        return shown

    def _display_size(self, size: tuple[int, int]) -> tuple[int, int]:
        width, height = size
        if self.max_pixels <= 0 or width * height <= self.max_pixels:
            return size
        scale = math.sqrt(self.max_pixels / (width * height))
        return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
