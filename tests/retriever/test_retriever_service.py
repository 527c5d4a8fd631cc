"""The HTTP service and its async client, against real servers on 127.0.0.1 (free ports):
the retrieval service itself, and small misbehaving servers (500s, non-JSON, slow)."""

import asyncio
import json
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from grouprl.retriever.client import RetrievalClient, RetrievalServiceError
from grouprl.retriever.index import Retriever
from grouprl.retriever.service import BackgroundServer, create_app
from helpers import free_port
from retriever.sample_index import CountingEmbedder, shared_embedder


@pytest.fixture(scope="module")
def service(index_dir):
    """The real service over the sample index; `.embedder.calls` records each embedding batch."""
    embedder = CountingEmbedder(shared_embedder())
    retriever = Retriever.load(index_dir, embedder=embedder)
    with BackgroundServer(create_app(retriever, default_top_k=2, max_top_k=5)) as server:
        server.retriever, server.embedder = retriever, embedder
        yield server


def post(service, body, **params):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{service.url}/search", content=content, params=params, timeout=30)




def test_health(service):
    reply = httpx.get(f"{service.url}/health", timeout=10).json()
    assert reply["status"] == "ok" and reply["count"] == 8 and reply["mode"] == "hybrid"
    assert reply["model"] == "builtin:all-minilm-l6-v2" and reply["uptime_s"] >= 0


def test_a_foreign_host_is_refused(service):
    """A page elsewhere that rebinds its name to this machine sends that name as Host: refused
    (403) before anything is searched; loopback names and addresses are answered."""
    port = service.port
    before = len(service.embedder.calls)
    for host in ["evil.example", f"evil.example:{port}", f"localhost.evil.example:{port}"]:
        headers = {"Host": host}
        assert httpx.get(f"{service.url}/health", headers=headers, timeout=10).status_code == 403
        refused = httpx.post(f"{service.url}/search", content=json.dumps([{"query": "tea"}]), headers=headers, timeout=10)
        assert refused.status_code == 403 and "results" not in refused.text
    assert len(service.embedder.calls) == before
    for host in [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"10.0.0.2:{port}"]:
        assert httpx.get(f"{service.url}/health", headers={"Host": host}, timeout=10).status_code == 200


def test_search_matches_in_process_and_batches_one_request(service):
    queries = ["capital city", "which animal purrs", "green tea", "lava"]
    before = len(service.embedder.calls)
    reply = post(service, [{"query": q, "id": f"q{i}"} for i, q in enumerate(queries)])
    assert reply.status_code == 200
    assert service.embedder.calls[before:] == [4]  # the four queries in one embedding batch
    expected = service.retriever.search(queries, top_k=2)
    assert [entry["id"] for entry in reply.json()] == ["q0", "q1", "q2", "q3"]
    for entry, hits in zip(reply.json(), expected):
        assert entry["results"] == [
            {
                "doc_id": h.id,
                "score": pytest.approx(h.score, abs=1e-6),
                "text": h.text,
                "image": h.image,
                "title": h.title,
                "rank": h.rank,
            }
            for h in hits
        ]


def test_top_k_per_item_and_as_query_parameter(service):
    reply = post(
        service, [{"query": "capital", "id": 1, "top_k": 1}, {"query": "capital", "id": "b"}], top_k=3
    )
    first, second = reply.json()
    assert (first["id"], len(first["results"])) == (1, 1)
    assert (second["id"], len(second["results"])) == ("b", 3)
    assert [entry["id"] for entry in post(service, [{"query": "tea"}, {"query": "cats"}]).json()] == [
        "0",
        "1",
    ]
    assert post(service, []).json() == []


@pytest.mark.parametrize(
    "body, params, status, detail",
    [
        (b"{not json", {}, 400, "body is not JSON; expected a list of {query, id} objects"),
        ({"query": "x"}, {}, 400, "body must be a JSON list of {query, id} objects, got dict"),
        ([{"query": "ok"}, {"query": "  "}], {}, 422, "item 1: query must be a non-empty string"),
        (["just a string"], {}, 422, "item 0: expected an object with query and id, got str"),
        ([{"query": "x", "id": [1]}], {}, 422, "item 0: id must be a string or an integer"),
        ([{"query": "x", "top_k": 0}], {}, 422, "item 0: top_k must be an integer from 1 to 5, got 0"),
        ([{"query": "x", "top_k": "3"}], {}, 422, "item 0: top_k must be an integer from 1 to 5, got '3'"),
        ([{"query": "x"}], {"top_k": 6}, 422, "top_k must be an integer from 1 to 5, got 6"),
        ([{"query": "x"}], {"top_k": "many"}, 422, "top_k must be an integer from 1 to 5, got 'many'"),
        (
            [{"query": "x", "top_k": 10**50}],
            {},
            422,
            "item 0: top_k must be an integer from 1 to 5, got 1000000000000000000000000000000000000...",
        ),
        (
            b"[" + b"7" * 5000 + b"]",
            {},
            400,
            "body holds a number too long to read; expected a list of {query, id} objects",
        ),
        (b"[" * 100_000, {}, 400, "body is nested too deeply; expected a list of {query, id} objects"),
        (
            b'[{"query": ' * 50_000,
            {},
            400,
            "body is nested too deeply; expected a list of {query, id} objects",
        ),
    ],
)
def test_bad_requests_get_a_clear_4xx(service, body, params, status, detail):
    reply = post(service, body, **params)
    assert reply.status_code == status
    assert reply.json() == {"detail": detail}


def test_client_returns_in_process_hits(service):
    async def run():
        client = RetrievalClient(service.url + "/search")  # the source's URL form is accepted
        assert client.url == service.url
        hits = await client.search(["capital city", "volcano"], top_k=3)
        health = await client.health()
        await client.aclose()
        return hits, health

    hits, health = asyncio.run(run())
    expected = service.retriever.search(["capital city", "volcano"], top_k=3)
    assert [[h["id"] for h in q] for q in hits] == [[h.id for h in q] for q in expected]
    assert hits[0][0] == {**expected[0][0].to_dict(), "score": pytest.approx(expected[0][0].score, abs=1e-6)}
    assert health["count"] == 8
    assert asyncio.run(RetrievalClient(service.url).search([])) == []


def test_client_reports_rejected_requests_without_retrying(service):
    client = RetrievalClient(service.url, retries=3, backoff=5.0)  # a retry would take >= 5 s
    started = time.monotonic()
    with pytest.raises(RetrievalServiceError) as raised:
        asyncio.run(client.search(["x"], top_k=50))
    assert time.monotonic() - started < 4
    assert str(raised.value) == (
        f"retrieval service at {service.url} rejected the request: HTTP 422: top_k must be an integer from 1 to 5, got 50"
    )


def test_client_gives_up_on_a_stopped_service_after_retries():
    url = f"http://127.0.0.1:{free_port()}"
    client = RetrievalClient(url, retries=2, backoff=0.01)
    with pytest.raises(
        RetrievalServiceError, match=rf"retrieval service at {url} failed after 3 attempts: ConnectError"
    ):
        asyncio.run(client.search(["x"]))


def misbehaving_app(fail_first: int, failure):
    """Fails the first `fail_first` /search requests with `failure()`, then answers one hit."""
    app = FastAPI()
    app.state.requests = 0

    @app.post("/search")
    async def search(request: Request):
        app.state.requests += 1
        if app.state.requests <= fail_first:
            return failure()
        items = json.loads(await request.body())
        return [
            {
                "id": it["id"],
                "results": [
                    {"doc_id": "d1", "score": 0.5, "text": "t", "image": None, "title": "", "rank": 1}
                ],
            }
            for it in items
        ]

    return app


def test_client_retries_5xx_then_succeeds():
    app = misbehaving_app(2, lambda: PlainTextResponse("overloaded", status_code=503))
    with BackgroundServer(app) as server:
        hits = asyncio.run(RetrievalClient(server.url, retries=2, backoff=0.01).search(["a", "b"]))
    assert app.state.requests == 3
    assert hits == [[{"id": "d1", "score": 0.5, "text": "t", "title": "", "image": None, "rank": 1}]] * 2


def test_client_gives_up_on_persistent_5xx():
    app = misbehaving_app(100, lambda: JSONResponse({"detail": "index exploded"}, status_code=500))
    with BackgroundServer(app) as server:
        with pytest.raises(RetrievalServiceError) as raised:
            asyncio.run(RetrievalClient(server.url, retries=1, backoff=0.01).search(["a"]))
    assert app.state.requests == 2
    assert (
        str(raised.value)
        == f"retrieval service at {server.url} failed after 2 attempts: HTTP 500: index exploded"
    )


def test_client_rejects_non_json_at_once():
    app = misbehaving_app(100, lambda: PlainTextResponse("<html>hello</html>"))
    with BackgroundServer(app) as server:
        with pytest.raises(
            RetrievalServiceError,
            match=r"replied with non-JSON \('<html>hello</html>'\); is that URL a grouprl retriever\?",
        ):
            asyncio.run(RetrievalClient(server.url, retries=3).search(["a"]))
    assert app.state.requests == 1


def test_client_times_out():
    app = FastAPI()

    @app.post("/search")
    async def slow():
        await asyncio.sleep(0.8)
        return []

    with BackgroundServer(app) as server:
        client = RetrievalClient(server.url, timeout=0.2, retries=1, backoff=0.01)
        started = time.monotonic()
        with pytest.raises(RetrievalServiceError, match="failed after 2 attempts: timed out after 0.2 s"):
            asyncio.run(client.search(["a"]))
        assert time.monotonic() - started < 0.8


def test_client_checks_reply_shape():
    app = FastAPI()

    @app.post("/search")
    async def wrong():
        return [{"id": "0", "results": [{"score": 1.0}]}]

    with BackgroundServer(app) as server:
        with pytest.raises(RetrievalServiceError, match=r"gave an unexpected reply \(KeyError: 'doc_id'\)"):
            asyncio.run(RetrievalClient(server.url).search(["a"]))
        with pytest.raises(RetrievalServiceError, match="answered 2 queries with 1"):
            asyncio.run(RetrievalClient(server.url).search(["a", "b"]))


def test_client_survives_a_new_event_loop(service):
    client = RetrievalClient(service.url)
    first = asyncio.run(client.search(["tea"], top_k=1))
    second = asyncio.run(client.search(["tea"], top_k=1))  # the first loop is closed by now
    assert first == second and first[0][0]["id"] == "tea"


def test_concurrent_requests_share_embedding_batches(service):
    queries = [f"request {i}: capital, tea or volcano" for i in range(16)]
    before = len(service.embedder.calls)

    async def run():
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as http:
            replies = await asyncio.gather(
                *(http.post("/search", json=[{"query": q, "id": str(i)}]) for i, q in enumerate(queries))
            )
        return [reply.json()[0] for reply in replies]

    entries = asyncio.run(run())
    calls = service.embedder.calls[before:]
    assert sum(calls) == 16 and len(calls) < 16  # requests waiting together were embedded together
    expected = service.retriever.search(queries, top_k=2)
    for i, (entry, hits) in enumerate(zip(entries, expected)):
        assert entry["id"] == str(i) and [r["doc_id"] for r in entry["results"]] == [h.id for h in hits]
