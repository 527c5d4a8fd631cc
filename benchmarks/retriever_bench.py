"""Retriever throughput and latency on a deterministic synthetic corpus.

    .venv/bin/python benchmarks/retriever_bench.py                 # 10k docs, 2000 queries, 16 clients
    .venv/bin/python benchmarks/retriever_bench.py --quick         # 1k docs, smoke test
    .venv/bin/python benchmarks/retriever_bench.py --docs 10000 --queries 2000 --batch 64 --clients 16 --out r.json
    .venv/bin/python benchmarks/retriever_bench.py --quick --only-maximal   # step 5 alone

Steps:
1. generate N documents of 3-5 template sentences (seeded), and queries made of 4 words drawn
   from one document each (its "source" document, used for recall@10 as a sanity check);
2. build the index (BM25 + MiniLM embeddings + FAISS): wall time and documents/s;
3. in-process batched search (`Retriever.search`, `--batch` queries per call) in each mode:
   queries/s and recall@10 of the source document;
4. the HTTP service in a separate process (uvicorn, as `grouprl retriever serve` runs it):
   `--clients` concurrent async clients each sending one-query requests back to back
   (p50/p99 latency, requests/s), and the same clients going through the search tool, whose
   micro-batching merges their concurrent calls into fewer requests (calls/s);
5. the same service under a maximal request, the largest its default limits allow, in two
   shapes (`max_queries` short queries, or fewer of 1000 characters, `max_query_chars` in all):
   its time, and the latency of one-query requests sent back to back while it is served (next
   to their latency on the idle service).
The machine may be shared: figures are what one run measured, not a guarantee.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from grouprl.data.sample import Sample
from grouprl.retriever.client import RetrievalClient
from grouprl.retriever.index import Retriever, build_index
from grouprl.retriever.service import MAX_QUERIES, MAX_QUERY_CHARS
from grouprl.rollout.tools.base import AgentState
from grouprl.rollout.tools.search import SearchTool

ADJECTIVES = (
    "annual quarterly regional global digital electric coastal urban rural medical public private".split()
)
NOUNS = (
    "revenue market budget harbor railway hospital school factory museum reactor vaccine satellite bridge "
    "orchard festival library airport dam forest telescope"
).split()
PLACES = "Busan Lyon Porto Quebec Osaka Leeds Perth Accra Lima Bergen Tartu Cusco Dakar Hanoi Turin".split()
VERBS = "grew fell doubled stalled recovered expanded shrank peaked improved declined".split()
UNITS = "percent tonnes visitors patients megawatts students flights hectares".split()
SERVER = (
    "import sys\n"
    "from grouprl.retriever.index import Retriever\n"
    "from grouprl.retriever.service import serve\n"
    "retriever = Retriever.load(sys.argv[1])\n"
    "retriever.search(['warm-up'], top_k=1)\n"
    "serve(retriever, host='127.0.0.1', port=int(sys.argv[2]), log_level='warning')\n"
)


def synthetic_corpus(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        sentences = [
            f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} of {rng.choice(PLACES)} {rng.choice(VERBS)} by "
            f"{rng.randint(2, 95)} {rng.choice(UNITS)} in {rng.randint(1990, 2024)}."
            for _ in range(rng.randint(3, 5))
        ]
        docs.append(
            {
                "id": f"doc{i:05d}",
                "title": f"{rng.choice(PLACES)} {rng.choice(NOUNS)} report",
                "text": " ".join(sentences),
            }
        )
    return docs


def synthetic_queries(docs: list[dict], count: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed + 1)
    queries, sources = [], []
    for _ in range(count):
        doc = rng.choice(docs)
        words = [w.strip(".") for w in doc["text"].split() if len(w) > 3 and w not in ("The", "percent")]
        queries.append(" ".join(rng.sample(words, 4)))
        sources.append(doc["id"])
    return queries, sources


def in_process(retriever: Retriever, queries, sources, batch: int, mode: str) -> dict:
    retriever.search(queries[:batch], top_k=10, mode=mode)  # warm-up
    started = time.perf_counter()
    hits = []
    for start in range(0, len(queries), batch):
        hits += retriever.search(queries[start : start + batch], top_k=10, mode=mode)
    seconds = time.perf_counter() - started
    found = sum(src in {h.id for h in q} for src, q in zip(sources, hits))
    return {"mode": mode, "queries_per_s": len(queries) / seconds, "recall_at_10": found / len(queries)}


async def http_clients(url: str, queries: list[str], clients: int) -> dict:
    latencies: list[float] = []
    queue = list(reversed(queries))
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def client() -> None:
            while queue:
                query = queue.pop()
                started = time.perf_counter()
                reply = await http.post("/search", json=[{"query": query, "id": "0"}], params={"top_k": 10})
                reply.raise_for_status()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - started
    latencies.sort()
    return {
        "requests_per_s": len(latencies) / seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


async def tool_clients(url: str, queries: list[str], clients: int) -> dict:
    tool = SearchTool(RetrievalClient(url, timeout=60), top_k=10)
    queue = list(reversed(queries))

    async def agent(index: int) -> None:
        state = AgentState(sample=Sample(uid=str(index), messages=[]), index=index)
        while queue:
            observation = await tool(queue.pop(), state)
            assert observation.error is None, observation.error

    started = time.perf_counter()
    await asyncio.gather(*(agent(i) for i in range(clients)))
    seconds = time.perf_counter() - started
    return {"calls_per_s": len(queries) / seconds, "requests": tool.backend_calls}


def maximal_requests(queries: list[str]) -> dict[str, list[str]]:
    """The two largest request shapes the default limits allow, every query distinct."""
    short = MAX_QUERY_CHARS // MAX_QUERIES
    long_count = MAX_QUERY_CHARS // 1000
    return {
        f"{MAX_QUERIES} queries of {short} chars": [
            f"{i:04d} {queries[i % len(queries)]} {queries[(i + 1) % len(queries)]}"[:short]
            for i in range(MAX_QUERIES)
        ],
        f"{long_count} queries of 1000 chars": [
            f"{i:04d} " + " ".join(queries[(i + j) % len(queries)] for j in range(40))[:995]
            for i in range(long_count)
        ],
    }


async def small_beside_maximal(url: str, big: list[str], probes: list[str]) -> dict:
    """One-query requests sent one after another while `big` (one request) is served."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def probe(query: str) -> float:
            started = time.perf_counter()
            reply = await http.post("/search", json=[{"query": query, "id": "0"}], params={"top_k": 10})
            reply.raise_for_status()
            return time.perf_counter() - started

        idle = [await probe(q) for q in probes[:10]]
        started = time.perf_counter()
        served = asyncio.ensure_future(
            http.post("/search", json=[{"query": q, "id": str(i)} for i, q in enumerate(big)])
        )
        await asyncio.sleep(0.5)  # the big request is being searched now
        latencies = []
        while not served.done():
            latencies.append(await probe(probes[len(latencies) % len(probes)]))
        reply = await served
        big_s = time.perf_counter() - started
    reply.raise_for_status()
    return {
        "big_s": big_s,
        "idle_p50_ms": 1000 * statistics.median(idle),
        "probes": len(latencies),
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "max_ms": 1000 * max(latencies) if latencies else None,
    }


def start_server(index: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(index), str(port)], stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(url + "/health", timeout=1).raise_for_status()
            return server, url
        except httpx.HTTPError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the retrieval service did not start") from None
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64, help="queries per in-process search call")
    parser.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients")
    parser.add_argument(
        "--http-queries", type=int, default=800, help="queries sent through HTTP per scenario"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1000 docs, 256 queries")
    parser.add_argument(
        "--only-maximal", action="store_true", help="build, then step 5 only (skip the throughput steps)"
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    if args.quick:
        args.docs, args.queries, args.http_queries = 1000, 256, 160

    docs = synthetic_corpus(args.docs, args.seed)
    queries, sources = synthetic_queries(docs, args.queries, args.seed)
    results: dict = {"docs": args.docs, "queries": args.queries, "batch": args.batch, "clients": args.clients}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
        started = time.perf_counter()
        build_index(corpus, Path(tmp) / "index")
        build_s = time.perf_counter() - started
        results["build"] = {"seconds": build_s, "docs_per_s": args.docs / build_s}
        print(
            f"build: {args.docs} docs in {build_s:.1f} s ({args.docs / build_s:.0f} docs/s, model load included)"
        )

        if not args.only_maximal:
            retriever = Retriever.load(Path(tmp) / "index")
            results["in_process"] = [
                in_process(retriever, queries, sources, args.batch, m) for m in ("bm25", "dense", "hybrid")
            ]
            print(f"\nin-process, {args.batch} queries per call, top 10:")
            print(f"{'mode':8} {'queries/s':>10} {'recall@10':>10}")
            for row in results["in_process"]:
                print(f"{row['mode']:8} {row['queries_per_s']:10.0f} {row['recall_at_10']:10.3f}")
            del retriever

        server, url = start_server(Path(tmp) / "index")
        try:
            http_queries = queries[: args.http_queries]
            asyncio.run(http_clients(url, http_queries[:32], args.clients))  # warm-up
            if not args.only_maximal:
                results["http"] = asyncio.run(http_clients(url, http_queries, args.clients))
                results["http_tool"] = asyncio.run(tool_clients(url, http_queries, args.clients))
            results["maximal"] = {
                shape: asyncio.run(small_beside_maximal(url, big, queries))
                for shape, big in maximal_requests(queries).items()
            }
        finally:
            server.terminate()
            server.wait(timeout=30)
    if not args.only_maximal:
        http, tool = results["http"], results["http_tool"]
        print(
            f"\nHTTP service (hybrid, top 10), {args.clients} concurrent clients, {len(http_queries)} queries:"
        )
        print(f"{'scenario':34} {'queries/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'requests':>9}")
        print(
            f"{'one query per request':34} {http['requests_per_s']:10.0f} {http['p50_ms']:8.1f} {http['p99_ms']:8.1f} {len(http_queries):9d}"
        )
        print(
            f"{'through SearchTool (micro-batched)':34} {tool['calls_per_s']:10.0f} {'':>8} {'':>8} {tool['requests']:9d}"
        )
    print("\none-query requests sent back to back while a maximal request is served (hybrid, top 10):")
    print(
        f"{'maximal request':28} {'its s':>6} {'idle p50 ms':>12} {'probes':>7} {'p50 ms':>8} {'max ms':>8}"
    )
    for shape, row in results["maximal"].items():
        p50, worst = (f"{row[k]:8.0f}" if row[k] is not None else f"{'-':>8}" for k in ("p50_ms", "max_ms"))
        print(f"{shape:28} {row['big_s']:6.1f} {row['idle_p50_ms']:12.0f} {row['probes']:7d} {p50} {worst}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
