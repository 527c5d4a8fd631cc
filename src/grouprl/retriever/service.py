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
A request whose client went away is not searched further. Every route answers only a Host that
is this machine's loopback (localhost, 127.0.0.1, ::1), the `--host` it listens on, or an address
written out (`ports.TrustedHosts`; anything else: 403): a web page elsewhere whose name is made
to resolve to this machine (DNS rebinding) cannot use the service from a browser.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoint annotations at
# definition time, and `Request` is imported inside `create_app` (fastapi loads lazily).
import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grouprl.ports import TrustedHosts
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


@dataclass(frozen=True)
class Limits:
    """The service's bounds (module docstring); all must be > 0."""

    default_top_k: int = DEFAULT_TOP_K
    max_top_k: int = MAX_TOP_K
    max_queries: int = MAX_QUERIES
    max_query_chars: int = MAX_QUERY_CHARS
    max_body_bytes: int = MAX_BODY_BYTES
    request_timeout_s: float = REQUEST_TIMEOUT_S
    batch_queries: int = BATCH_QUERIES
    batch_chars: int = BATCH_CHARS

    def __post_init__(self) -> None:
        bounds = (self.max_queries, self.max_query_chars, self.max_body_bytes, self.request_timeout_s)
        if min(*bounds, self.batch_queries, self.batch_chars) <= 0:
            raise ValueError("the service's limits and batch bounds must be > 0")


class Refused(Exception):
    """A request refused with an HTTP status and one line for the client."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def top_k_of(value: Any, where: str, max_top_k: int) -> int:
    """`value` as a top_k from 1 to `max_top_k`, else refused (422)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_top_k:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise Refused(422, f"{where}top_k must be an integer from 1 to {max_top_k}, got {shown}")
    return value


def parse_body(body: bytes) -> list[Any]:
    """The body as a JSON list, else refused (400)."""
    expected = "expected a list of {query, id} objects"
    try:
        items = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Refused(400, f"body is not JSON; {expected}") from None
    except RecursionError:  # the C parser recurses once per level
        raise Refused(400, f"body is nested too deeply; {expected}") from None
    except ValueError:  # Python reads no integer of over 4300 digits
        raise Refused(400, f"body holds a number too long to read; {expected}") from None
    if not isinstance(items, list):
        raise Refused(400, f"body must be a JSON list of {{query, id}} objects, got {type(items).__name__}")
    return items


def parse_item(i: int, item: Any, default_top_k: int, max_top_k: int) -> tuple[str, str | int, int]:
    """One item's (query, id, top_k), else refused (422)."""
    if not isinstance(item, dict):
        raise Refused(422, f"item {i}: expected an object with query and id, got {type(item).__name__}")
    query = item.get("query")
    if not isinstance(query, str) or not query.strip():
        raise Refused(422, f"item {i}: query must be a non-empty string")
    try:
        query.encode()  # JSON's \ud800 escapes give lone surrogates, which tokenizers refuse
    except UnicodeEncodeError as e:
        raise Refused(
            422,
            f"item {i}: query is not valid Unicode text (lone surrogate {query[e.start]!r} at character {e.start})",
        ) from None
    item_id = item.get("id", str(i))
    if not isinstance(item_id, (str, int)) or isinstance(item_id, bool):
        raise Refused(422, f"item {i}: id must be a string or an integer")
    top_k = top_k_of(item["top_k"], f"item {i}: ", max_top_k) if "top_k" in item else default_top_k
    return query, item_id, top_k


def parse_request(body: bytes, default_top_k: int, limits: Limits) -> list[tuple[str, str | int, int]]:
    """A /search body's (query, id, top_k) items, within the limits, else refused."""
    items = parse_body(body)
    if len(items) > limits.max_queries:
        raise Refused(422, f"at most {limits.max_queries} queries per request, got {len(items)}")
    parsed = [parse_item(i, item, default_top_k, limits.max_top_k) for i, item in enumerate(items)]
    chars = sum(len(query) for query, _, _ in parsed)
    if chars > limits.max_query_chars:
        raise Refused(
            413,
            f"the queries hold {chars} characters, more than {limits.max_query_chars} per request; "
            "split them over several requests",
        )
    return parsed


def chunks(pairs: list[tuple[str, int]], limits: Limits) -> Iterator[list[tuple[str, int]]]:
    """A request's (query, top_k) pairs in runs that fit one batch."""
    chunk: list[tuple[str, int]] = []
    chars = 0
    for pair in pairs:
        if chunk and (len(chunk) == limits.batch_queries or chars + len(pair[0]) > limits.batch_chars):
            yield chunk
            chunk, chars = [], 0
        chunk.append(pair)
        chars += len(pair[0])
    if chunk:
        yield chunk


def reply(ids: list[str | int], hits: list[Any]) -> list[dict[str, Any]]:
    """The /search reply: each id with its hits."""
    fields = ("score", "text", "image", "title", "rank")
    return [
        {"id": item_id, "results": [{"doc_id": h.id, **{f: getattr(h, f) for f in fields}} for h in query_hits]}
        for item_id, query_hits in zip(ids, hits)
    ]


def create_app(
    retriever: "Retriever", *, batch_window_s: float = 0.002, hosts: tuple[str, ...] = (), **limits: Any
) -> Any:
    """The FastAPI app serving `retriever`; `hosts`: the names it answers besides the loopback's
    and addresses (the `--host` it listens on); `limits` are `Limits`' fields (module docstring)."""
    from fastapi import FastAPI, HTTPException, Request, Response
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    bounds = Limits(**limits)
    app = FastAPI(title="grouprl retriever")
    app.add_middleware(TrustedHosts, hosts=hosts, what="the retrieval service")
    started = time.monotonic()

    async def search_batch(items: list[tuple[str, int]]) -> list[list[Any]]:
        """Distinct (query, top_k) pairs of all requests waiting now: one `Retriever.search`."""
        hits = await run_in_threadpool(retriever.search, [q for q, _ in items], max(k for _, k in items))
        return [query_hits[:k] for (_, k), query_hits in zip(items, hits)]

    # concurrent requests (one query each, say) are searched together, one bounded batch at a time
    batcher = MicroBatcher(
        search_batch,
        window_s=batch_window_s,
        max_batch=bounds.batch_queries,
        max_cost=bounds.batch_chars,
        cost=lambda item: len(item[0]),
        isolate_failures=True,
    )
    too_slow = (
        f"the search took longer than the service's limit of {bounds.request_timeout_s:g} s per request; "
        "send fewer queries per request or retry later"
    )

    async def read_body(request: Request) -> bytes:
        """The body, refused (413) as soon as it is known to be too big: declared or as read."""
        too_big = f"body is over {bounds.max_body_bytes} bytes; send fewer or shorter queries per request"
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > bounds.max_body_bytes:
            raise Refused(413, too_big)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > bounds.max_body_bytes:
                raise Refused(413, too_big)
        return bytes(body)

    async def search_pairs(request: Request, pairs: list[tuple[str, int]]) -> list[Any] | None:
        """Hits (or the exception) per pair, one chunk in the queue at a time; None once the
        client has gone away, and nothing after a failed query (the request fails anyway)."""
        found: list[Any] = []
        for chunk in chunks(pairs, bounds):
            if await request.is_disconnected():
                return None
            found += await asyncio.gather(*(batcher.submit(pair) for pair in chunk), return_exceptions=True)
            if any(isinstance(hits, BaseException) for hits in found[-len(chunk) :]):
                break
        return found

    @app.exception_handler(Refused)
    async def refused(request: Request, e: Refused) -> Any:
        return JSONResponse({"detail": e.detail}, status_code=e.status)

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
            default = bounds.default_top_k if top_k is None else int(top_k)
        except ValueError:
            raise Refused(422, f"top_k must be an integer from 1 to {bounds.max_top_k}, got {top_k!r}") from None
        default = top_k_of(default, "", bounds.max_top_k)
        try:
            return await asyncio.wait_for(answer(request, default), bounds.request_timeout_s)
        except asyncio.TimeoutError:
            raise HTTPException(503, too_slow) from None

    async def answer(request: Request, default: int) -> Any:
        """The reply to one /search request (its deadline runs around this)."""
        items = parse_request(await read_body(request), default, bounds)
        hits = await search_pairs(request, [(query, k) for query, _, k in items])
        if hits is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        for i, found in enumerate(hits):
            if isinstance(found, BaseException):
                # the exception stays in the service's log: its text can name the index's files
                logger.error("search failed on item %d of a request", i, exc_info=found)
                raise Refused(500, f"item {i}: search failed (the service's log has the error)")
        return reply([item_id for _, item_id, _ in items], hits)

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

    uvicorn.run(create_app(retriever, hosts=(host,), **app_options), host=host, port=port, log_level=log_level)


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
