"""The search tool over the in-process retriever and over the HTTP service (real servers on
127.0.0.1): observations, state updates, micro-batching, and failures that stop the run."""

import asyncio
import json
import shutil

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from grouprl.data.sample import Sample
from grouprl.errors import ConfigError
from grouprl.retriever.client import RetrievalClient
from grouprl.retriever.index import Retriever, build_index
from grouprl.retriever.service import BackgroundServer, create_app
from grouprl.rollout.tools.base import AgentState
from grouprl.rollout.tools.search import SearchTool, SearchUnavailableError
from helpers import free_port
from retriever.sample_index import CountingEmbedder, shared_embedder


def new_state(index: int = 0) -> AgentState:
    return AgentState(sample=Sample(uid="q", messages=[{"role": "user", "content": "?"}]), index=index)


def call(tool, query, state=None):
    state = state or new_state()
    return asyncio.run(tool(query, state)), state




def test_observation_lists_the_hits_and_records_them(tool_retriever):
    tool = SearchTool(tool_retriever, top_k=3)
    observation, state = call(tool, "  capital\n city ")
    expected = [h.to_dict() for h in tool_retriever.search(["capital city"], top_k=3)[0]]
    assert observation.error is None and observation.retrieved == expected
    lines = ['Results for "capital city":']
    for rank, hit in enumerate(expected, start=1):
        lines += [f"[{rank}] {hit['id']}" + (f" | {hit['title']}" if hit["title"] else ""), hit["text"]]
    assert observation.text == "\n".join(lines)
    assert state.retrieved == expected and state.retrieved_ids == [h["id"] for h in expected]
    asyncio.run(tool("green tea leaves", state))
    assert state.retrieved_ids[:3] == [h["id"] for h in expected] and "tea" in state.retrieved_ids
    assert len(set(state.retrieved_ids)) == len(state.retrieved_ids)
    assert state.errors == {}


def test_snippets_share_the_character_budget(tool_retriever):
    tool = SearchTool(tool_retriever, top_k=2, max_chars=60)  # 30 characters per snippet
    observation, _ = call(tool, "volcano lava")
    texts = [h["text"] for h in observation.retrieved]
    snippets = observation.text.splitlines()[2::2]
    assert snippets == [t if len(t) <= 30 else t[:29] + "…" for t in texts]
    assert all(len(s) <= 30 for s in snippets) and snippets[0].endswith("…")


def test_top_hit_image_becomes_the_current_image(tool_retriever, tool_corpus):
    paris = str(tool_corpus.parent / "pages" / "paris.png")
    observation, state = call(SearchTool(tool_retriever, top_k=2), "Paris France Seine Eiffel")
    assert observation.retrieved[0]["id"] == "paris"
    assert observation.images == [paris]
    assert (state.current_image, state.current_image_size) == (paris, (300, 200))

    # more pixels than max_pixels: shown (and cropped against) at floor(300 s) x floor(200 s), s = sqrt(1/4)
    observation, state = call(
        SearchTool(tool_retriever, top_k=2, max_pixels=300 * 200 // 4), "Paris France Seine"
    )
    [shown] = observation.images
    assert shown.size == (150, 100) and state.current_image_size == (150, 100)
    assert state.current_image == paris

    observation, state = call(SearchTool(tool_retriever, top_k=1), "green tea caffeine")
    assert observation.images == [] and state.current_image is None and state.current_image_size is None


def test_missing_page_image_is_counted_and_skipped(tool_corpus, tmp_path):
    shutil.copytree(tool_corpus.parent, tmp_path / "corpus")
    build_index(tmp_path / "corpus" / "corpus.jsonl", tmp_path / "index", embedder=shared_embedder())
    (tmp_path / "corpus" / "pages" / "paris.png").unlink()
    retriever = Retriever.load(tmp_path / "index", embedder=shared_embedder())
    observation, state = call(SearchTool(retriever, top_k=1), "Paris France Seine Eiffel")
    assert observation.error is None and observation.retrieved[0]["id"] == "paris"
    assert observation.images == [] and state.current_image is None
    assert state.errors == {"search_image_missing": 1}


def test_empty_query_is_an_error_observation(tool_retriever):
    tool = SearchTool(tool_retriever)
    observation, state = call(tool, " \n ")
    assert observation.error == "empty query" and "<search>" in observation.text
    assert state.errors == {"search_empty_query": 1} and tool.backend_calls == 0


def test_concurrent_calls_become_one_batch_in_process(tool_retriever):
    counting = CountingEmbedder(shared_embedder())
    retriever = Retriever(
        tool_retriever.documents, tool_retriever.bm25, tool_retriever.dense, counting, tool_retriever.meta
    )
    tool = SearchTool(retriever, top_k=2)
    queries = [f"topic {i % 8} capital tea cats" for i in range(16)]  # 8 distinct queries

    async def run():
        states = [new_state(i) for i in range(16)]
        return await asyncio.gather(*(tool(q, s) for q, s in zip(queries, states))), states

    observations, states = asyncio.run(run())
    assert tool.backend_calls == 1 and counting.calls == [8]  # one search, each distinct query once
    for query, observation, state in zip(queries, observations, states):
        expected = [h.to_dict() for h in tool_retriever.search([query], top_k=2)[0]]
        assert [(h["id"], h["rank"]) for h in observation.retrieved] == [
            (h["id"], h["rank"]) for h in expected
        ]
        assert [h["score"] for h in observation.retrieved] == pytest.approx(
            [h["score"] for h in expected], abs=1e-9
        )
        assert state.retrieved == observation.retrieved


def test_max_batch_splits_a_burst(tool_retriever):
    tool = SearchTool(tool_retriever, top_k=1, max_batch=5)

    async def run():
        return await asyncio.gather(*(tool(f"query {i}", new_state(i)) for i in range(12)))

    assert all(o.error is None for o in asyncio.run(run()))
    assert tool.backend_calls == 3  # 5 + 5 + 2


def counting_service(retriever):
    """The real service, with a middleware counting the /search requests it receives."""
    app = create_app(retriever, max_top_k=10)
    app.state.search_requests = 0

    @app.middleware("http")
    async def count(request, call_next):
        if request.url.path == "/search":
            app.state.search_requests += 1
        return await call_next(request)

    return app


def test_concurrent_calls_become_one_http_request(tool_retriever):
    app = counting_service(tool_retriever)
    queries = [f"question {i} about volcano, tea or Rome" for i in range(16)]
    with BackgroundServer(app) as server:
        tool = SearchTool(RetrievalClient(server.url), top_k=3)

        async def run():
            return await asyncio.gather(*(tool(q, new_state(i)) for i, q in enumerate(queries)))

        observations = asyncio.run(run())
    assert app.state.search_requests == 1 and tool.backend_calls == 1
    expected = tool_retriever.search(queries, top_k=3)
    for observation, hits in zip(observations, expected):
        assert [h["id"] for h in observation.retrieved] == [h.id for h in hits]


def flaky_app():
    """Answers /search according to app.state.mode: "ok", "500" or "html"."""
    app = FastAPI()
    app.state.mode = "ok"

    @app.post("/search")
    async def search(request: Request):
        if app.state.mode == "500":
            return JSONResponse({"detail": "index exploded"}, status_code=500)
        if app.state.mode == "html":
            return PlainTextResponse("<html>proxy login</html>")
        items = json.loads(await request.body())
        return [
            {
                "id": it["id"],
                "results": [
                    {"doc_id": "d1", "score": 1.0, "text": "t", "image": None, "title": "", "rank": 1}
                ],
            }
            for it in items
        ]

    return app


def test_errors_are_observations_until_too_many_in_a_row():
    app = flaky_app()
    with BackgroundServer(app) as server:
        tool = SearchTool(RetrievalClient(server.url, retries=0), max_consecutive_failures=2)
        app.state.mode = "500"
        observation, state = call(tool, "a")
        assert (
            observation.error
            == f"retrieval service at {server.url} failed after 1 attempt: HTTP 500: index exploded"
        )
        assert observation.text.startswith("Search failed (") and state.errors == {"search_failed": 1}
        app.state.mode = "ok"  # a success resets the count
        observation, _ = call(tool, "b")
        assert observation.error is None and observation.retrieved[0]["id"] == "d1"
        app.state.mode = "html"
        observation, state = call(tool, "c")
        assert "replied with non-JSON ('<html>proxy login</html>')" in observation.error
        assert state.errors == {"search_failed": 1}
        app.state.mode = "500"
        with pytest.raises(SearchUnavailableError) as raised:
            call(tool, "d")
    assert str(raised.value) == (
        f"retrieval service at {server.url} failed 2 times in a row; last error: "
        f"retrieval service at {server.url} failed after 1 attempt: HTTP 500: index exploded"
    )


def test_stopped_service_stops_the_run():
    url = f"http://127.0.0.1:{free_port()}"
    tool = SearchTool(RetrievalClient(url, retries=1, backoff=0.01), max_consecutive_failures=2)
    observation, state = call(tool, "a")
    assert "failed after 2 attempts: ConnectError" in observation.error and state.errors == {
        "search_failed": 1
    }

    async def burst():
        return await asyncio.gather(*(tool("q", new_state(i)) for i in range(16)), return_exceptions=True)

    outcomes = asyncio.run(burst())  # one failed request for all 16 calls: the second in a row
    assert tool.backend_calls == 2 and tool.consecutive_failures == 2
    assert all(isinstance(o, SearchUnavailableError) for o in outcomes)
    assert str(outcomes[0]).startswith(f"retrieval service at {url} failed 2 times in a row; last error: ")


class SlowFirst:
    """An async backend: a request holding query "slow" answers after 0.4 s, others at once;
    records each request's queries."""

    url = "http://127.0.0.1:1"

    def __init__(self):
        self.requests = []

    async def search(self, queries, top_k):
        self.requests.append(list(queries))
        await asyncio.sleep(0.4 if "slow" in queries else 0.0)
        return [[{"id": f"d-{q}", "text": q, "score": 1.0}] for q in queries]


@pytest.mark.parametrize("in_flight", [1, 4])
def test_a_search_waits_for_an_earlier_slow_request_only_beyond_max_in_flight(in_flight):
    backend = SlowFirst()
    tool = SearchTool(backend, top_k=1, max_in_flight=in_flight)

    async def both():
        done = {}

        async def one(query, delay):
            await asyncio.sleep(delay)
            await tool(query, new_state())
            done[query] = asyncio.get_running_loop().time()

        start = asyncio.get_running_loop().time()
        await asyncio.gather(one("slow", 0.0), one("fast", 0.05))  # "fast" comes while "slow" is in flight
        return {q: t - start for q, t in done.items()}

    done = asyncio.run(both())
    assert backend.requests == [["slow"], ["fast"]]  # apart: "fast" came after the batching window
    if in_flight == 1:  # queued behind the slow request
        assert done["fast"] >= 0.4
    else:  # its own request at once
        assert done["fast"] < 0.2 < 0.4 <= done["slow"]


def test_max_in_flight_is_checked():
    with pytest.raises(ConfigError, match="max_in_flight must be >= 1"):
        SearchTool(SlowFirst(), max_in_flight=0)
