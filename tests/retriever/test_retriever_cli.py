"""`retriever build|serve` through an argparse parser of our own (as grouprl's main wires it)."""

import argparse
import socket
import subprocess
import sys
import time

import httpx
import pytest

import grouprl.retriever.index as index_module
from grouprl.errors import ConfigError, DataError
from grouprl.retriever.cli import add_parser
from grouprl.retriever.index import Retriever, read_meta
from retriever.sample_index import shared_embedder, write_corpus

PROGRAM = (
    "import argparse, sys\n"
    "from grouprl.retriever.cli import add_parser\n"
    "parser = argparse.ArgumentParser(prog='grouprl')\n"
    "add_parser(parser.add_subparsers(dest='verb', required=True))\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.func(args))\n"
)


def parse(*argv):
    parser = argparse.ArgumentParser(prog="grouprl")
    add_parser(parser.add_subparsers(dest="verb", required=True))
    return parser.parse_args(list(argv))


def test_build_writes_an_index_and_reports_it(tmp_path, capsys, monkeypatch):
    # reuse the session's loaded model instead of loading the same one again
    monkeypatch.setattr(index_module, "Embedder", lambda model, **kw: shared_embedder())
    corpus = write_corpus(tmp_path)
    args = parse(
        "retriever",
        "build",
        "--corpus",
        str(corpus),
        "--out",
        str(tmp_path / "idx"),
        "--mode",
        "bm25",
        "--fusion-k",
        "30",
        "--candidates",
        "7",
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"indexed 8 documents into {tmp_path / 'idx'} (model builtin:all-minilm-l6-v2, 384 dims, "
    )
    meta = read_meta(tmp_path / "idx")
    assert (meta["mode"], meta["fusion"]["k"], meta["fusion"]["candidates"]) == ("bm25", 30, 7)
    assert (
        Retriever.load(tmp_path / "idx", embedder=shared_embedder()).search(["tea"], top_k=1)[0][0].id
        == "tea"
    )


def test_parser_defaults_and_choices(capsys):
    args = parse("retriever", "serve", "--index", "idx")
    assert (args.host, args.port, args.mode, args.top_k, args.max_top_k) == ("127.0.0.1", 8002, None, 5, 100)
    assert (args.max_queries, args.max_query_chars, args.max_body_bytes, args.request_timeout) == (
        1024,
        100_000,
        1_048_576,
        30.0,
    )
    args = parse("retriever", "build", "--corpus", "c.jsonl", "--out", "o")
    assert (args.model, args.mode, args.fusion_k, args.candidates) == (
        "builtin:all-minilm-l6-v2",
        "hybrid",
        60,
        100,
    )
    with pytest.raises(SystemExit):
        parse("retriever", "serve", "--index", "idx", "--mode", "sparse")
    with pytest.raises(SystemExit):
        parse("retriever")
    capsys.readouterr()


def test_user_mistakes_are_user_errors(tmp_path):
    args = parse("retriever", "build", "--corpus", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o"))
    with pytest.raises(DataError, match="corpus file not found"):
        args.func(args)
    args = parse("retriever", "serve", "--index", str(tmp_path / "missing"), "--port", "0")
    with pytest.raises(DataError, match="retriever index not found"):
        args.func(args)
    args = parse("retriever", "serve", "--index", str(tmp_path), "--top-k", "20", "--max-top-k", "10")
    with pytest.raises(ConfigError, match=r"--top-k must be from 1 to --max-top-k \(10\), got 20"):
        args.func(args)
    args = parse("retriever", "serve", "--index", str(tmp_path), "--max-body-bytes", "0")
    with pytest.raises(ConfigError, match=r"^--max-body-bytes must be > 0, got 0$"):
        args.func(args)
    args = parse("retriever", "serve", "--index", str(tmp_path), "--request-timeout", "nan")
    with pytest.raises(ConfigError, match=r"^--request-timeout must be > 0, got nan$"):
        args.func(args)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = parse("retriever", "serve", "--index", str(tmp_path), "--port", str(port))
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: "):
            args.func(args)


def test_serve_hands_its_limits_to_the_service(retriever, monkeypatch, capsys):
    import grouprl.retriever.service as service_module

    served = {}
    monkeypatch.setattr(index_module.Retriever, "load", lambda path, mode=None: retriever)
    monkeypatch.setattr(service_module, "serve", lambda retriever, **options: served.update(options))
    args = parse(
        "retriever",
        "serve",
        "--index",
        "idx",
        "--port",
        "0",
        "--max-queries",
        "10",
        "--max-query-chars",
        "500",
        "--max-body-bytes",
        "2048",
        "--request-timeout",
        "2.5",
    )
    assert args.func(args) == 0
    assert served == {
        "host": "127.0.0.1",
        "port": 0,
        "log_level": "info",
        "default_top_k": 5,
        "max_top_k": 100,
        "max_queries": 10,
        "max_query_chars": 500,
        "max_body_bytes": 2048,
        "request_timeout_s": 2.5,
    }
    capsys.readouterr()


@pytest.mark.slow
def test_serve_answers_until_stopped(index_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            PROGRAM,
            "retriever",
            "serve",
            "--index",
            str(index_dir),
            "--port",
            str(port),
            "--top-k",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 50
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "service did not come up"
                time.sleep(0.2)
        assert health["count"] == 8
        reply = httpx.post(
            f"http://127.0.0.1:{port}/search", json=[{"query": "green tea", "id": "x"}], timeout=30
        )
        assert [r["doc_id"] for r in reply.json()[0]["results"]][0] == "tea"
        assert len(reply.json()[0]["results"]) == 2
    finally:
        server.terminate()
        server.wait(timeout=15)
    assert f"serving 8 documents from {index_dir} on http://127.0.0.1:{port}" in server.stdout.read()
