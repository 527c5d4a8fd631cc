"""The retrieval HTTP service (FastAPI), with the source system's request shape.

    POST /search[?top_k=5]   body: [{"query": "...", "id": "q1", "top_k": 3 (optional)}, ...]
      -> [{"id": "q1", "results": [{"doc_id", "score", "text", "image", "title", "rank"}, ...]}, ...]
    GET /health              -> {"status": "ok", "count", "model", "mode", "uptime_s"}

All queries of one request are searched together (one embedding batch), and so are the
queries of requests that arrive while a search is running (micro-batching: many agents
sending one query each still share embedding passes). A malformed request
gets 400 (not JSON, not a list) or 422 (an item's query, id or top_k is wrong) with
{"detail": "<one line naming the item>"}.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoint annotations at
# definition time, and `Request` is imported inside `create_app` (fastapi loads lazily).
import asyncio
import json
import threading
import time
from typing import TYPE_CHECKING, Any

from grouprl.retriever.batching import MicroBatcher

if TYPE_CHECKING:
    from grouprl.retriever.index import Retriever

DEFAULT_TOP_K = 5
MAX_TOP_K = 100
MAX_QUERIES = 4096  # per request; a bigger batch should be split by the caller


def create_app(
    retriever: "Retriever",
    *,
    default_top_k: int = DEFAULT_TOP_K,
    max_top_k: int = MAX_TOP_K,
    batch_window_s: float = 0.002,
) -> Any:
    from fastapi import FastAPI, HTTPException, Request
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="grouprl retriever")
    started = time.monotonic()

    async def search_batch(items: list[tuple[str, int]]) -> list[list[Any]]:
        """Distinct (query, top_k) pairs of all requests waiting now: one `Retriever.search`."""
        hits = await run_in_threadpool(retriever.search, [q for q, _ in items], max(k for _, k in items))
        return [query_hits[:k] for (_, k), query_hits in zip(items, hits)]

    # concurrent requests (one query each, say) are searched together, one batch at a time
    batcher = MicroBatcher(search_batch, window_s=batch_window_s, max_batch=MAX_QUERIES)

    def top_k_of(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_top_k:
            raise HTTPException(422, f"{where}top_k must be an integer from 1 to {max_top_k}, got {value!r}")
        return value

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "count": retriever.count,
            "model": retriever.meta["model"],
            "mode": retriever.mode,
            "uptime_s": round(time.monotonic() - started, 3),
        }

    @app.post("/search")
    async def search(request: Request, top_k: str | None = None) -> list[dict[str, Any]]:
        try:
            default = default_top_k if top_k is None else int(top_k)
        except ValueError:
            raise HTTPException(
                422, f"top_k must be an integer from 1 to {max_top_k}, got {top_k!r}"
            ) from None
        default = top_k_of(default, "")
        try:
            items = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HTTPException(400, "body is not JSON; expected a list of {query, id} objects") from None
        if not isinstance(items, list):
            raise HTTPException(
                400, f"body must be a JSON list of {{query, id}} objects, got {type(items).__name__}"
            )
        if len(items) > MAX_QUERIES:
            raise HTTPException(422, f"at most {MAX_QUERIES} queries per request, got {len(items)}")
        queries, ids, ks = [], [], []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise HTTPException(
                    422, f"item {i}: expected an object with query and id, got {type(item).__name__}"
                )
            query = item.get("query")
            if not isinstance(query, str) or not query.strip():
                raise HTTPException(422, f"item {i}: query must be a non-empty string")
            item_id = item.get("id", str(i))
            if not isinstance(item_id, (str, int)) or isinstance(item_id, bool):
                raise HTTPException(422, f"item {i}: id must be a string or an integer")
            queries.append(query)
            ids.append(item_id)
            ks.append(top_k_of(item["top_k"], f"item {i}: ") if "top_k" in item else default)
        hits = await asyncio.gather(*(batcher.submit((q, k)) for q, k in zip(queries, ks)))
        return [
            {
                "id": item_id,
                "results": [
                    {
                        "doc_id": h.id,
                        "score": h.score,
                        "text": h.text,
                        "image": h.image,
                        "title": h.title,
                        "rank": h.rank,
                    }
                    for h in query_hits
                ],
            }
            for item_id, query_hits in zip(ids, hits)
        ]

    return app


def serve(
    retriever: "Retriever",
    *,
    host: str = "127.0.0.1",
    port: int = 8002,
    log_level: str = "info",
    **app_options: Any,
) -> None:
    """Run the service in the foreground until interrupted."""
    import uvicorn

    uvicorn.run(create_app(retriever, **app_options), host=host, port=port, log_level=log_level)


class BackgroundServer:
    """uvicorn serving `app` in a daemon thread; port 0 picks a free port.

    with BackgroundServer(create_app(retriever)) as server:
        client = RetrievalClient(server.url)
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
        self._thread = threading.Thread(target=self._server.run, name="retriever-service", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"retriever service did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
