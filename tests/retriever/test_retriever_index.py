"""Index build/save/load and batched search, checked against reference computations:
BM25 by its formula, dense by cosine of the embedder's vectors, hybrid by RRF of the two."""

import json
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from bm25s.stopwords import STOPWORDS_EN

from grouprl.errors import ConfigError, DataError
from grouprl.retriever.corpus import file_sha256, read_corpus
from grouprl.retriever.index import Retriever, build_index, read_meta
from retriever.sample_index import DOCS, CountingEmbedder, shared_embedder, write_corpus


def words(text):
    """The index's documented tokenisation: lower-case, 2+ word characters, no English stop words."""
    return [w for w in re.findall(r"(?u)\b\w\w+\b", text.lower()) if w not in STOPWORDS_EN]


def reference_bm25(corpus_path, query, k1=1.5, b=0.75):
    docs = read_corpus(corpus_path)
    tokenised = [words(d.searchable_text) for d in docs]
    avgdl = sum(map(len, tokenised)) / len(docs)
    scores = {}
    for doc, tokens in zip(docs, tokenised):
        counts = Counter(tokens)
        score = 0.0
        for term in words(query):
            df = sum(term in t for t in tokenised)
            if counts[term]:
                idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
                score += idf * counts[term] / (counts[term] + k1 * (1 - b + b * len(tokens) / avgdl))
        if score > 0:
            scores[doc.id] = score
    return scores


def test_index_folder_and_meta(index_dir, corpus_path):
    assert sorted(p.name for p in index_dir.iterdir()) == ["bm25", "dense.faiss", "docs.parquet", "meta.json"]
    meta = read_meta(index_dir)
    assert meta["count"] == len(DOCS) and meta["dims"] == 384
    assert meta["model"] == "builtin:all-minilm-l6-v2" and meta["mode"] == "hybrid"
    assert meta["fusion"] == {"method": "rrf", "k": 60, "candidates": 100}
    assert meta["corpus_sha256"] == file_sha256(corpus_path)
    assert meta["bm25"]["stopwords"] == "en" and meta["bm25"]["stemmer"] is None
    assert meta["build_seconds"] > 0
    assert not [p for p in index_dir.parent.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_bm25_scores_match_the_formula(retriever, corpus_path):
    for query in ["capital city", "The capital of Italy", "tea caffeine leaves", "wolves bark"]:
        expected = reference_bm25(corpus_path, query)
        [hits] = retriever.search([query], top_k=len(DOCS), mode="bm25")
        assert {h.id: h.score for h in hits} == pytest.approx(expected, rel=1e-5)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert [h.rank for h in hits] == list(range(1, len(hits) + 1))


def test_bm25_without_shared_terms_finds_nothing(retriever):
    assert retriever.search(["the of and", "zyzzyva"], top_k=3, mode="bm25") == [[], []]


def test_dense_scores_are_cosines(retriever):
    queries = ["which animal purrs", "Italian capital with ancient ruins"]
    doc_vectors = shared_embedder().encode([f"{t}\n{x}" if t else x for _, t, x in DOCS])
    query_vectors = shared_embedder().encode(queries)
    results = retriever.search(queries, top_k=len(DOCS), mode="dense")
    for query_vector, hits in zip(query_vectors, results):
        expected = {doc_id: float(v @ query_vector) for (doc_id, _, _), v in zip(DOCS, doc_vectors)}
        assert {h.id: h.score for h in hits} == pytest.approx(expected, abs=1e-5)
        assert [h.id for h in hits] == sorted(expected, key=expected.get, reverse=True)
    assert [hits[0].id for hits in results] == ["cats", "rome"]


def test_hybrid_is_rrf_of_the_two_rankings(retriever):
    queries = ["capital city", "which animal purrs", "the"]
    lexical = retriever.search(queries, top_k=len(DOCS), mode="bm25")
    semantic = retriever.search(queries, top_k=len(DOCS), mode="dense")
    fused = retriever.search(queries, top_k=len(DOCS), mode="hybrid")
    for lex, sem, hyb in zip(lexical, semantic, fused):
        expected = {}
        for ranking in (lex, sem):
            for position, hit in enumerate(ranking, start=1):
                expected[hit.id] = expected.get(hit.id, 0.0) + 1 / (60 + position)
        assert {h.id: h.score for h in hyb} == pytest.approx(expected, abs=1e-12)
        scores = [h.score for h in hyb]
        assert scores == sorted(scores, reverse=True)
    assert [h.id for h in fused[0][:2]] == ["paris", "rome"]


def test_hits_carry_document_fields_and_top_k_limits(retriever, corpus_path):
    [hits] = retriever.search(["Paris France Seine"], top_k=2)
    assert len(hits) == 2 and hits[0].id == "paris" and hits[0].rank == 1
    assert hits[0].title == "" and hits[0].text.startswith("Paris is the capital")
    assert hits[0].image == str(corpus_path.parent / "pages" / "paris.png")
    assert set(hits[0].to_dict()) == {"id", "score", "text", "title", "image", "rank"}
    assert len(retriever.search(["cats"], top_k=50)[0]) == len(DOCS)  # never more than the corpus
    assert retriever.search([], top_k=3) == []
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        retriever.search(["cats"], top_k=0)
    with pytest.raises(ConfigError, match="retriever mode must be one of bm25, dense, hybrid"):
        retriever.search(["cats"], mode="sparse")


def test_candidates_bound_each_ranking(index_dir):
    narrow = Retriever.load(index_dir, embedder=shared_embedder(), candidates=2, fusion_k=0)
    query = "capital of France and Italy"
    expected = {}
    for mode in ("bm25", "dense"):
        for position, hit in enumerate(narrow.search([query], top_k=2, mode=mode)[0], start=1):
            expected[hit.id] = expected.get(hit.id, 0.0) + 1 / position  # k = 0
    order = [doc_id for doc_id, _, _ in DOCS]  # equal scores: the earlier document first
    best = sorted(expected, key=lambda doc: (-expected[doc], order.index(doc)))[:2]
    [hits] = narrow.search([query], top_k=2)
    assert [h.id for h in hits] == best
    assert [h.score for h in hits] == pytest.approx([expected[doc] for doc in best], abs=1e-12)
    # a top_k above `candidates` widens both rankings to top_k, so it is still filled
    assert len(narrow.search([query], top_k=8)[0]) == 8


def test_all_queries_are_embedded_in_one_call(index_dir):
    counting = CountingEmbedder(shared_embedder())
    batched = Retriever.load(index_dir, embedder=counting)
    batched.search([f"query number {i}" for i in range(10)], top_k=3)
    assert counting.calls == [10]


def test_rebuild_replaces_and_refuses_foreign_folders(tmp_path):
    corpus = write_corpus(tmp_path / "c")
    out = tmp_path / "idx"
    build_index(corpus, out, embedder=shared_embedder(), mode="bm25", fusion_k=10, candidates=5)
    small = tmp_path / "small.jsonl"
    small.write_text('{"id": "only", "text": "one document"}\n')
    meta = build_index(small, out, embedder=shared_embedder())
    assert meta["count"] == 1 and read_meta(out)["count"] == 1
    assert Retriever.load(out, embedder=shared_embedder()).search(["document"], top_k=3)[0][0].id == "only"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "idx", "small.jsonl"]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(
        DataError, match="refusing to write the index to .*mine: it exists and is not a retriever index"
    ):
        build_index(small, foreign, embedder=shared_embedder())
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(DataError, match="corpus file not found"):
        build_index(tmp_path / "missing.jsonl", tmp_path / "idx2", embedder=shared_embedder())
    assert not (tmp_path / "idx2").exists()


def test_load_errors_are_clear(tmp_path, index_dir):
    with pytest.raises(DataError, match=r"retriever index not found: .*nowhere \(build one with"):
        Retriever.load(tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"is not a retriever index \(no meta.json"):
        Retriever.load(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DataError, match="is not a retriever index .meta.json has no format"):
        Retriever.load(tmp_path)

    broken = tmp_path / "broken"
    shutil.copytree(index_dir, broken)
    meta = json.loads((broken / "meta.json").read_text())
    (broken / "meta.json").write_text(json.dumps({**meta, "count": 99}))
    with pytest.raises(DataError, match="is inconsistent: meta count 99"):
        Retriever.load(broken, embedder=shared_embedder())
    (broken / "meta.json").write_text(json.dumps({**meta, "version": 2}))
    with pytest.raises(DataError, match="index version 2 is not supported"):
        Retriever.load(broken)
    (broken / "meta.json").write_text(json.dumps(meta))
    (broken / "dense.faiss").unlink()
    with pytest.raises(DataError, match=r"is incomplete: missing dense.faiss"):
        Retriever.load(broken)
    Path(broken / "dense.faiss").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"is unreadable: "):
        Retriever.load(broken)


def test_load_uses_the_recorded_model_unless_overridden(index_dir):
    assert Retriever.load(index_dir).embedder.model_name == "builtin:all-minilm-l6-v2"
    assert Retriever.load(index_dir, model="some/other-model").embedder.model_name == "some/other-model"
    assert Retriever.load(index_dir, mode="bm25").mode == "bm25"
