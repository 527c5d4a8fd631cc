"""The retrieval HTTP service (FastAPI), with the source system's request shape.

    POST /search[?top_k=5]   body: [{"query": "...", "id": "q1", "top_k": 3 (optional)}, ...]
      -> [{"id": "q1", "results": [{"doc_id", "score", "text", "image", "title", "rank"}, ...]}, ...]
    GET /health              -> {"status": "ok", "count", "model", "mode", "uptime_s"}

Queries of requests that arrive while a search is running are searched together
(micro-batching: many agents sending one query each still share embedding passes). One
search takes at most `batch_queries` queries and `batch_chars` characters of query text, and
a bigger request enters the queue one such chunk at a time, each after the one before is
answered, so requests that arrive meanwhile are searched between its chunks: a small request
waits for about one bounded batch, never for a whole big request. If a merged batch fails,
it is halved until the failing query is alone, and only requests holding it fail (500).

Every reply other than 200 is {"detail": "<one line>"}:
    400  the body is not JSON, is nested too deeply, or is not a list
    413  the body is over `max_body_bytes`, or its queries hold over `max_query_chars` in all
    422  over `max_queries` items, or an item's query (empty, not valid Unicode), id or top_k
    500  a query the index failed on (the other queries of its batch still get their results)
    503  the request took longer than `request_timeout_s` (its unsearched chunks are dropped)
A request whose client went away is not searched further.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoint annotations at
# definition time, and `Request` is imported inside `create_app` (fastapi loads lazily).
import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from grouprl.retriever.batching import MicroBatcher

if TYPE_CHECKING:
    from grouprl.retriever.index import Retriever

logger = logging.getLogger(__name__)

DEFAULT_TOP_K = 5
MAX_TOP_K = 100
# Per request; bigger batches should be split by the caller (RetrievalClient does). A maximal
# request takes 9-11 s of a busy 2-core CPU (benchmarks/RESULTS.md), well inside the deadline.
MAX_QUERIES = 1024
MAX_QUERY_CHARS = 100_000  # all queries of one request together
MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 30.0
# Per search call: up to about 2 s of that CPU, the longest a small request waits for its turn.
BATCH_QUERIES = 64
BATCH_CHARS = 16_000


def create_app(
    retriever: "Retriever",
    *,
    default_top_k: int = DEFAULT_TOP_K,
    max_top_k: int = MAX_TOP_K,
    max_queries: int = MAX_QUERIES,
    max_query_chars: int = MAX_QUERY_CHARS,
    max_body_bytes: int = MAX_BODY_BYTES,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    batch_window_s: float = 0.002,
    batch_queries: int = BATCH_QUERIES,
    batch_chars: int = BATCH_CHARS,
) -> Any:
    """The FastAPI app serving `retriever`; the limits are those of the module docstring."""
    from fastapi import FastAPI, HTTPException, Request, Response
    from starlette.concurrency import run_in_threadpool

    if min(max_queries, max_query_chars, max_body_bytes, request_timeout_s, batch_queries, batch_chars) <= 0:
        raise ValueError("the service's limits and batch bounds must be > 0")
    app = FastAPI(title="grouprl retriever")
    started = time.monotonic()

    async def search_batch(items: list[tuple[str, int]]) -> list[list[Any]]:
        """Distinct (query, top_k) pairs of all requests waiting now: one `Retriever.search`."""
        hits = await run_in_threadpool(retriever.search, [q for q, _ in items], max(k for _, k in items))
        return [query_hits[:k] for (_, k), query_hits in zip(items, hits)]

    # concurrent requests (one query each, say) are searched together, one bounded batch at a time
    batcher = MicroBatcher(
        search_batch,
        window_s=batch_window_s,
        max_batch=batch_queries,
        max_cost=batch_chars,
        cost=lambda item: len(item[0]),
        isolate_failures=True,
    )
    too_big = f"body is over {max_body_bytes} bytes; send fewer or shorter queries per request"
    too_slow = (
        f"the search took longer than the service's limit of {request_timeout_s:g} s per request; "
        "send fewer queries per request or retry later"
    )

    async def read_body(request: Request) -> bytes:
        """The body, refused (413) as soon as it is known to be too big: declared or as read."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise HTTPException(413, too_big)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise HTTPException(413, too_big)
        return bytes(body)

    def chunks(pairs: list[tuple[str, int]]) -> Iterator[list[tuple[str, int]]]:
        """A request's (query, top_k) pairs in runs that fit one batch."""
        chunk: list[tuple[str, int]] = []
        chars = 0
        for pair in pairs:
            if chunk and (len(chunk) == batch_queries or chars + len(pair[0]) > batch_chars):
                yield chunk
                chunk, chars = [], 0
            chunk.append(pair)
            chars += len(pair[0])
        if chunk:
            yield chunk

    async def search_pairs(request: Request, pairs: list[tuple[str, int]]) -> list[Any] | None:
        """Hits (or the exception) per pair, one chunk in the queue at a time; None once the
        client has gone away, and nothing after a failed query (the request fails anyway)."""
        found: list[Any] = []
        for chunk in chunks(pairs):
            if await request.is_disconnected():
                return None
            found += await asyncio.gather(*(batcher.submit(pair) for pair in chunk), return_exceptions=True)
            if any(isinstance(hits, BaseException) for hits in found[-len(chunk) :]):
                break
        return found

    def top_k_of(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_top_k:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise HTTPException(422, f"{where}top_k must be an integer from 1 to {max_top_k}, got {shown}")
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
    async def search(request: Request, top_k: str | None = None) -> Any:
        try:
            default = default_top_k if top_k is None else int(top_k)
        except ValueError:
            raise HTTPException(
                422, f"top_k must be an integer from 1 to {max_top_k}, got {top_k!r}"
            ) from None
        default = top_k_of(default, "")
        try:
            return await asyncio.wait_for(answer(request, default), request_timeout_s)
        except asyncio.TimeoutError:
            raise HTTPException(503, too_slow) from None

    async def answer(request: Request, default: int) -> Any:
        """The reply to one /search request (its deadline runs around this)."""
        try:
            items = json.loads(await read_body(request))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HTTPException(400, "body is not JSON; expected a list of {query, id} objects") from None
        except RecursionError:  # the C parser recurses once per level
            raise HTTPException(
                400, "body is nested too deeply; expected a list of {query, id} objects"
            ) from None
        except ValueError:  # Python reads no integer of over 4300 digits
            raise HTTPException(
                400, "body holds a number too long to read; expected a list of {query, id} objects"
            ) from None
        if not isinstance(items, list):
            raise HTTPException(
                400, f"body must be a JSON list of {{query, id}} objects, got {type(items).__name__}"
            )
        if len(items) > max_queries:
            raise HTTPException(422, f"at most {max_queries} queries per request, got {len(items)}")
        queries, ids, ks = [], [], []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise HTTPException(
                    422, f"item {i}: expected an object with query and id, got {type(item).__name__}"
                )
            query = item.get("query")
            if not isinstance(query, str) or not query.strip():
                raise HTTPException(422, f"item {i}: query must be a non-empty string")
            try:
                query.encode()  # JSON's \ud800 escapes give lone surrogates, which tokenizers refuse
            except UnicodeEncodeError as e:
                raise HTTPException(
                    422,
                    f"item {i}: query is not valid Unicode text (lone surrogate {query[e.start]!r} "
                    f"at character {e.start})",
                ) from None
            item_id = item.get("id", str(i))
            if not isinstance(item_id, (str, int)) or isinstance(item_id, bool):
                raise HTTPException(422, f"item {i}: id must be a string or an integer")
            queries.append(query)
            ids.append(item_id)
            ks.append(top_k_of(item["top_k"], f"item {i}: ") if "top_k" in item else default)
        chars = sum(map(len, queries))
        if chars > max_query_chars:
            raise HTTPException(
                413,
                f"the queries hold {chars} characters, more than {max_query_chars} per request; "
                "split them over several requests",
            )
        hits = await search_pairs(request, list(zip(queries, ks)))
        if hits is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        for i, found in enumerate(hits):
            if isinstance(found, BaseException):
                # the exception stays in the service's log: its text can name the index's files
                logger.error("search failed on item %d of a request", i, exc_info=found)
                raise HTTPException(500, f"item {i}: search failed (the service's log has the error)")
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
