"""`grouprl retriever build|serve`: index a page corpus, serve an index over HTTP.

grouprl retriever build --corpus corpus.jsonl --out index/ [--model builtin:all-minilm-l6-v2]
grouprl retriever serve --index index/ [--port 8002] [--host 127.0.0.1] [--mode hybrid]
                        [--max-queries 1024] [--max-query-chars 100000] [--max-body-bytes 1048576]
                        [--request-timeout 30]
"""

from __future__ import annotations

import argparse

from grouprl.errors import ConfigError
from grouprl.ports import check_port_free
from grouprl.retriever.embed import DEFAULT_EMBEDDING_MODEL
from grouprl.retriever.fusion import DEFAULT_RRF_K, MODES
from grouprl.retriever.service import (
    DEFAULT_TOP_K,
    MAX_BODY_BYTES,
    MAX_QUERIES,
    MAX_QUERY_CHARS,
    MAX_TOP_K,
    REQUEST_TIMEOUT_S,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `retriever` verb and its `build` / `serve` sub-verbs."""
    retriever = subparsers.add_parser("retriever", help="build or serve the search index for search agents")
    verbs = retriever.add_subparsers(dest="retriever_verb", required=True)

    build = verbs.add_parser("build", help="index a jsonl corpus (id, text, optional image, title)")
    build.add_argument(
        "--corpus", required=True, help="corpus.jsonl: one {id, text, image?, title?} per line"
    )
    build.add_argument(
        "--out", required=True, help="index folder to write (replaced if it holds an older index)"
    )
    build.add_argument(
        "--model",
        default=DEFAULT_EMBEDDING_MODEL,
        help="embedding model: builtin:<name>, a local folder or a hub id",
    )
    build.add_argument(
        "--mode", choices=MODES, default="hybrid", help="default search mode recorded in the index"
    )
    build.add_argument(
        "--fusion-k", type=int, default=DEFAULT_RRF_K, help="reciprocal rank fusion constant k"
    )
    build.add_argument(
        "--candidates", type=int, default=100, help="documents each retriever contributes to fusion"
    )
    build.add_argument("--batch-size", type=int, default=64, help="texts per embedding batch")
    build.add_argument("--max-length", type=int, default=256, help="tokens per text the embedder reads")
    build.set_defaults(func=cmd_build)

    serve = verbs.add_parser("serve", help="serve an index over HTTP (POST /search, GET /health)")
    serve.add_argument("--index", required=True, help="index folder written by `grouprl retriever build`")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8002, help="port to listen on")
    serve.add_argument("--mode", choices=MODES, default=None, help="search mode (default: the index's)")
    serve.add_argument(
        "--top-k", type=int, default=DEFAULT_TOP_K, help="results per query when a request gives none"
    )
    serve.add_argument("--max-top-k", type=int, default=MAX_TOP_K, help="largest top_k a request may ask for")
    serve.add_argument(
        "--max-queries", type=int, default=MAX_QUERIES, help="most queries one request may hold (422 beyond)"
    )
    serve.add_argument(
        "--max-query-chars",
        type=int,
        default=MAX_QUERY_CHARS,
        help="most characters the queries of one request may hold together (413 beyond)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="largest request body in bytes (413 beyond)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=REQUEST_TIMEOUT_S,
        help="seconds a request may take; past them it gets 503 and its remaining queries are dropped",
    )
    serve.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="uvicorn log level"
    )
    serve.set_defaults(func=cmd_serve)


def cmd_build(args: argparse.Namespace) -> int:
    from grouprl.retriever.index import build_index

    meta = build_index(
        args.corpus,
        args.out,
        model=args.model,
        mode=args.mode,
        fusion_k=args.fusion_k,
        candidates=args.candidates,
        batch_size=args.batch_size,
        max_length=args.max_length,
    )
    print(
        f"indexed {meta['count']} documents into {args.out} "
        f"(model {meta['model']}, {meta['dims']} dims, {meta['build_seconds']:.1f} s)"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from grouprl.retriever.index import Retriever
    from grouprl.retriever.service import serve

    if not 1 <= args.top_k <= args.max_top_k:
        raise ConfigError(f"--top-k must be from 1 to --max-top-k ({args.max_top_k}), got {args.top_k}")
    for name in ("max_queries", "max_query_chars", "max_body_bytes", "request_timeout"):
        if not getattr(args, name) > 0:  # NaN too
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name):g}")
    check_port_free(args.host, args.port)
    retriever = Retriever.load(args.index, mode=args.mode)
    retriever.search(["warm-up"], top_k=1)  # load the embedder before the first request
    print(f"serving {retriever.count} documents from {args.index} on http://{args.host}:{args.port}")
    serve(
        retriever,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        default_top_k=args.top_k,
        max_top_k=args.max_top_k,
        max_queries=args.max_queries,
        max_query_chars=args.max_query_chars,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
    )
    return 0

