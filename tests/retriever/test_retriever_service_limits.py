"""The retrieval service under bad and huge requests, against real servers on 127.0.0.1: text
the tokenizer cannot take, a query that breaks its merged batch, bounded bodies and query text,
deadlines, clients that leave, and small requests arriving while a maximal one is served."""

import asyncio
import contextlib
import json
import re
import threading
import time

import httpx
import pytest

from grouprl.retriever.client import RetrievalClient, RetrievalServiceError
from grouprl.retriever.index import Retriever
from grouprl.retriever.service import BackgroundServer, create_app
from retriever.sample_index import shared_embedder


class TroubledEmbedder:
    """The shared embedder, `delay` seconds slower per text, failing on any batch holding a text
    with "poison"; `batches` records the size of every call (`failed`: of those that failed),
    `texts` counts the texts handed in."""

    def __init__(self, delay: float = 0.0):
        self.inner = shared_embedder()
        self.model_name = self.inner.model_name
        self.max_length = self.inner.max_length
        self.delay = delay
        self.batches: list[int] = []
        self.failed: list[int] = []
        self.texts = 0
        self._lock = threading.Lock()

    def encode(self, texts):
        with self._lock:
            self.batches.append(len(texts))
            self.texts += len(texts)
        if any("poison" in t for t in texts):
            self.failed.append(len(texts))
            raise ValueError("cannot embed poison")
        time.sleep(self.delay * len(texts))
        return self.inner.encode(texts)


@contextlib.contextmanager
def serving(index_dir, *, delay: float = 0.0, **options):
    """The real service over the sample index with a TroubledEmbedder (`server.embedder`)."""
    embedder = TroubledEmbedder(delay)
    retriever = Retriever.load(index_dir, embedder=embedder)
    with BackgroundServer(create_app(retriever, **options)) as server:
        server.retriever, server.embedder = retriever, embedder
        yield server


async def post_all(url: str, bodies: list, timeout: float = 30) -> list[httpx.Response]:
    """All bodies at once, one request each; json.dumps escapes lone surrogates as JSON allows."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        return await asyncio.gather(*(http.post("/search", content=json.dumps(b)) for b in bodies))


def test_text_the_tokenizer_cannot_take_fails_only_its_own_requests(index_dir):
    queries = [f"question {i} about tea, Rome or volcanoes" for i in range(20)]
    bodies = [[{"query": q, "id": i}] for i, q in enumerate(queries)]
    bodies[3:3] = [[{"query": "\ud800 x", "id": "bad"}]]  # 1 request in 10 carries a lone surrogate
    bodies[14:14] = [[{"query": "fine", "id": "a"}, {"query": "tea \udfff", "id": "b"}]]
    with serving(index_dir, default_top_k=3) as server:
        replies = asyncio.run(post_all(server.url, bodies))
        expected = server.retriever.search(queries, top_k=3)
    bad = [replies.pop(14), replies.pop(3)]
    assert [(r.status_code, r.json()) for r in bad] == [
        (
            422,
            {"detail": "item 1: query is not valid Unicode text (lone surrogate '\\udfff' at character 4)"},
        ),
        (
            422,
            {"detail": "item 0: query is not valid Unicode text (lone surrogate '\\ud800' at character 0)"},
        ),
    ]
    assert [r.status_code for r in replies] == [200] * 20
    for reply, hits in zip(replies, expected):
        assert [r["doc_id"] for r in reply.json()[0]["results"]] == [h.id for h in hits]


def test_a_query_that_breaks_its_merged_batch_fails_alone(index_dir):
    queries = [f"request {i}: capital, cats or green tea" for i in range(11)]
    bodies = [[{"query": q, "id": i}] for i, q in enumerate(queries)]
    bodies.insert(5, [{"query": "tea", "id": "x"}, {"query": "poison pill", "id": "y"}])
    # a long window, so the twelve requests land in one merged batch
    with serving(index_dir, batch_window_s=0.5) as server:
        replies = asyncio.run(post_all(server.url, bodies))
        expected = server.retriever.search(queries, top_k=5)
        failed = server.embedder.failed
    culprit = replies.pop(5)
    assert failed[0] > 2 and failed[-1] == 1  # merged with other requests' queries, then alone
    assert (culprit.status_code, culprit.json()) == (
        500,
        {"detail": "item 1: search failed (the service's log has the error)"},  # nothing of the exception
    )
    assert [r.status_code for r in replies] == [200] * 11
    for reply, hits in zip(replies, expected):
        assert [r["doc_id"] for r in reply.json()[0]["results"]] == [h.id for h in hits]


def test_body_size_and_query_text_are_bounded(index_dir):
    with serving(index_dir, max_body_bytes=2000, max_query_chars=300) as server:
        url = f"{server.url}/search"
        big = json.dumps([{"query": "tea " * 50, "id": str(i)} for i in range(10)])
        too_big = {"detail": "body is over 2000 bytes; send fewer or shorter queries per request"}
        reply = httpx.post(url, content=big, timeout=10)  # Content-Length says so
        assert (reply.status_code, reply.json()) == (413, too_big)
        chunks = (big[i : i + 500].encode() for i in range(0, len(big), 500))
        reply = httpx.post(url, content=chunks, timeout=10)  # chunked: counted while read
        assert (reply.status_code, reply.json()) == (413, too_big)
        reply = httpx.post(url, json=[{"query": "x" * 100}] * 3 + [{"query": "tea"}], timeout=10)
        assert (reply.status_code, reply.json()) == (
            413,
            {
                "detail": "the queries hold 303 characters, more than 300 per request; split them over several requests"
            },
        )
        reply = httpx.post(
            url, json=[{"query": "x" * 100}] * 2 + [{"query": "green tea" + "!" * 91}], timeout=10
        )
        assert reply.status_code == 200 and reply.json()[2]["results"][0]["doc_id"] == "tea"


def test_a_request_past_its_deadline_gets_503_and_its_work_stops(index_dir):
    queries = [{"query": f"slow query {i}"} for i in range(40)]  # 40 x 0.05 s of embedding
    with serving(index_dir, delay=0.05, request_timeout_s=0.5, batch_queries=4) as server:
        started = time.monotonic()
        reply = httpx.post(f"{server.url}/search", json=queries, timeout=30)
        elapsed = time.monotonic() - started
        time.sleep(0.3)  # the batch running at the deadline finishes
        done = server.embedder.texts
        time.sleep(0.5)
        assert server.embedder.texts == done < 20  # nothing more was searched for it
    assert reply.status_code == 503 and elapsed < 1.5
    assert reply.json() == {
        "detail": "the search took longer than the service's limit of 0.5 s per request; "
        "send fewer queries per request or retry later"
    }


def test_work_stops_when_the_client_goes_away(index_dir):
    queries = [{"query": f"abandoned query {i}"} for i in range(40)]
    with serving(index_dir, delay=0.05, batch_queries=4) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/search", json=queries, timeout=0.4)
        time.sleep(0.4)  # the batch running when the client left finishes
        done = server.embedder.texts
        time.sleep(0.5)
        assert server.embedder.texts == done < 20
        # and the service goes on answering
        reply = httpx.post(f"{server.url}/search", json=[{"query": "green tea"}], timeout=10)
        assert reply.status_code == 200 and reply.json()[0]["results"][0]["doc_id"] == "tea"


def test_a_small_request_does_not_wait_behind_a_maximal_one(index_dir):
    # the largest request this service allows: 600 queries, about 3 s of (slowed) embedding
    big = [{"query": f"maximal request, query {i}", "id": i} for i in range(600)]
    with serving(index_dir, delay=0.005, max_queries=600) as server:

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                served = asyncio.ensure_future(http.post("/search", json=big))
                await asyncio.sleep(0.4)  # the big request is being searched now
                started = time.monotonic()
                reply = await http.post("/search", json=[{"query": "green tea", "id": "small"}])
                latency = time.monotonic() - started
                big_done = served.done()
                served.cancel()  # the client leaves; the service stops its work
                return reply, latency, big_done

        reply, latency, big_done = asyncio.run(run())
    assert reply.status_code == 200 and reply.json()[0]["results"][0]["doc_id"] == "tea"
    assert not big_done and latency < 2.0  # about one bounded batch (0.3 s here), not 3 s


def test_client_fails_once_on_rejected_text_and_sizes(index_dir):
    with serving(index_dir, max_body_bytes=300) as server:
        client = RetrievalClient(server.url, retries=3, backoff=5.0)  # a retry would take >= 5 s
        started = time.monotonic()
        with pytest.raises(RetrievalServiceError) as bad_text:
            asyncio.run(client.search(["green tea", "\ud800 x"]))
        with pytest.raises(RetrievalServiceError) as too_big:
            asyncio.run(client.search([f"query number {i}" for i in range(20)]))
        assert time.monotonic() - started < 4
    assert str(bad_text.value) == (
        f"retrieval service at {server.url} rejected the request: HTTP 422: "
        "item 1: query is not valid Unicode text (lone surrogate '\\ud800' at character 0)"
    )
    assert re.fullmatch(
        rf"retrieval service at {server.url} rejected the request: HTTP 413: body is over 300 bytes; .*",
        str(too_big.value),
    )


def test_client_splits_a_big_call_into_requests_the_limits_accept(retriever, monkeypatch):
    import grouprl.retriever.client as client_module

    # the client's bounds are the service's defaults; here both are small
    monkeypatch.setattr(client_module, "MAX_QUERIES", 3)
    monkeypatch.setattr(client_module, "MAX_QUERY_CHARS", 200)
    app = create_app(retriever, max_queries=3, max_query_chars=150, max_body_bytes=200)
    sizes = []

    @app.middleware("http")
    async def count(request, call_next):
        sizes.append(int(request.headers["content-length"]))
        return await call_next(request)

    queries = ["green tea", "cats", "capital of France", "volcano " * 15, "Rome", "dogs", "python", "revenue"]
    with BackgroundServer(app) as server:
        hits = asyncio.run(RetrievalClient(server.url).search(queries, top_k=2))
        with pytest.raises(RetrievalServiceError) as raised:
            asyncio.run(RetrievalClient(server.url).search(["tea", "x" * 190]))
    # 3 queries; the long one and "Rome" (a third would pass 200 bytes); 3; then 1 and 1
    assert sizes == [106, 175, 93, 29, 216]
    expected = retriever.search(queries, top_k=2)
    assert [[h["id"] for h in q] for q in hits] == [[h.id for h in q] for q in expected]
    assert str(raised.value) == (
        f"retrieval service at {server.url} rejected the request for queries 1 to 1: HTTP 413: "
        "body is over 200 bytes; send fewer or shorter queries per request"
    )
