"""Build, save and load a hybrid search index (BM25 + dense), and search it in batches.

An index folder holds:

    meta.json       format, model, dims, count, BM25 and fusion settings, build time, corpus hash
    docs.parquet    id, title, text, image (absolute path or null), in corpus order
    bm25/           bm25s's own save (sparse score matrix + vocabulary)
    dense.faiss     a flat inner-product FAISS index of L2-normalised embeddings (= cosine)

It is written into a temporary sibling folder and renamed into place when complete, so a
crashed build never leaves a half-written index under the final name.

BM25 tokenisation (bm25s): lower-cased, split on the regex `(?u)\\b\\w\\w+\\b` (words of two or
more characters), English stop words removed, no stemming (a stemmer needs PyStemmer, which is
not a dependency). Titles are indexed with the text. Both retrievers contribute their top
`candidates` documents; documents with a BM25 score of 0 (no shared term) are left out of
the BM25 ranking.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from grouprl.errors import ConfigError, DataError
from grouprl.files import temp_folder
from grouprl.retriever.corpus import Document, file_sha256, read_corpus
from grouprl.retriever.embed import DEFAULT_EMBEDDING_MODEL, Embedder
from grouprl.retriever.fusion import DEFAULT_RRF_K, MODES, reciprocal_rank_fusion

INDEX_FORMAT = "grouprl-retriever-index"
INDEX_VERSION = 1
BM25_SETTINGS = {"method": "lucene", "k1": 1.5, "b": 0.75, "stopwords": "en", "stemmer": None}
FILES = ("meta.json", "docs.parquet", "bm25", "dense.faiss")


@dataclass
class Hit:
    """One search result. `score` is BM25 (bm25 mode), cosine (dense) or the RRF score (hybrid)."""

    id: str
    score: float
    text: str
    title: str
    image: str | None
    rank: int  # 1-based position in this query's results

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tokenize(texts: list[str]) -> Any:
    import bm25s

    return bm25s.tokenize(texts, stopwords=BM25_SETTINGS["stopwords"], show_progress=False)


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"retriever mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def build_index(
    corpus: str | Path,
    out: str | Path,
    *,
    model: str = DEFAULT_EMBEDDING_MODEL,
    embedder: Embedder | None = None,
    mode: str = "hybrid",
    fusion_k: int = DEFAULT_RRF_K,
    candidates: int = 100,
    batch_size: int = 64,
    max_length: int = 256,
) -> dict[str, Any]:
    """Index the jsonl `corpus` into the folder `out` (replacing an older index there); return meta.

    Both BM25 and the dense index are always built; `mode` is only the default search mode
    recorded in meta.json (a loaded index can search in any mode). `embedder` reuses an
    already loaded model (its name is recorded instead of `model`).
    """
    import bm25s
    import faiss
    import pyarrow as pa
    import pyarrow.parquet as pq

    _check_mode(mode)
    if fusion_k < 0 or candidates < 1:
        raise ConfigError(f"need fusion_k >= 0 and candidates >= 1, got {fusion_k} and {candidates}")
    out = Path(out)
    _check_replaceable(out)
    started = time.perf_counter()
    documents = read_corpus(corpus)
    embedder = embedder or Embedder(model, batch_size=batch_size, max_length=max_length)
    texts = [d.searchable_text for d in documents]

    bm25 = bm25s.BM25(method=BM25_SETTINGS["method"], k1=BM25_SETTINGS["k1"], b=BM25_SETTINGS["b"])
    bm25.index(_tokenize(texts), show_progress=False)
    vectors = embedder.encode(texts)  # [N, D]
    dense = faiss.IndexFlatIP(vectors.shape[1])
    dense.add(vectors)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(f".{out.name}.tmp-", out.parent)  # a mkdir's mode: the index is an ordinary folder
    try:
        bm25.save(str(tmp / "bm25"))
        faiss.write_index(dense, str(tmp / "dense.faiss"))
        table = pa.table(
            {
                "id": [d.id for d in documents],
                "title": [d.title for d in documents],
                "text": [d.text for d in documents],
                "image": pa.array([d.image for d in documents], type=pa.string()),
            }
        )
        pq.write_table(table, tmp / "docs.parquet")
        meta = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "model": embedder.model_name,
            "dims": int(vectors.shape[1]),
            "max_length": embedder.max_length,
            "count": len(documents),
            "mode": mode,
            "fusion": {"method": "rrf", "k": fusion_k, "candidates": candidates},
            "bm25": BM25_SETTINGS,
            "build_seconds": round(time.perf_counter() - started, 3),
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "corpus": str(Path(corpus).resolve()),
            "corpus_sha256": file_sha256(corpus),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _check_replaceable(out: Path) -> None:
    """Only an older index or an empty folder may be replaced: never a user's other files."""
    if out.exists() and not (out.is_dir() and ((out / "meta.json").is_file() or not any(out.iterdir()))):
        raise DataError(f"refusing to write the index to {out}: it exists and is not a retriever index")


def _move_into_place(tmp: Path, out: Path) -> None:
    _check_replaceable(out)
    if not out.exists():
        tmp.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The index's meta.json, checked to be one this version can read."""
    path = Path(path)
    hint = f"build one with: grouprl retriever build --corpus corpus.jsonl --out {path}"
    if not path.is_dir():
        raise DataError(f"retriever index not found: {path} ({hint})")
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise DataError(f"{path} is not a retriever index (no meta.json; {hint})")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_file}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != INDEX_FORMAT:
        raise DataError(f"{path} is not a retriever index (meta.json has no format {INDEX_FORMAT!r})")
    if meta.get("version") != INDEX_VERSION:
        raise DataError(
            f"{path}: index version {meta.get('version')} is not supported (expected {INDEX_VERSION})"
        )
    missing = [name for name in FILES if not (path / name).exists()]
    if missing:
        raise DataError(f"retriever index {path} is incomplete: missing {', '.join(missing)}")
    return meta


class Retriever:
    """A loaded index: `Retriever.load(path).search(["query", ...], top_k=5)`."""

    def __init__(
        self,
        documents: list[Document],
        bm25: Any,
        dense: Any,
        embedder: Embedder,
        meta: dict[str, Any],
        *,
        mode: str | None = None,
        fusion_k: int | None = None,
        candidates: int | None = None,
    ):
        self.documents = documents
        self.bm25 = bm25
        self.dense = dense
        self.embedder = embedder
        self.meta = meta
        self.mode = _check_mode(mode or meta["mode"])
        self.fusion_k = meta["fusion"]["k"] if fusion_k is None else fusion_k
        self.candidates = candidates or meta["fusion"]["candidates"]

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        mode: str | None = None,
        model: str | None = None,
        embedder: Embedder | None = None,
        fusion_k: int | None = None,
        candidates: int | None = None,
        batch_size: int = 64,
    ) -> Retriever:
        """Open an index folder. `model`/`embedder` override the recorded embedding model
        (it must embed into the same space; only the width can be checked)."""
        import bm25s
        import faiss
        import pyarrow.parquet as pq

        path = Path(path)
        meta = read_meta(path)
        try:
            table = pq.read_table(path / "docs.parquet").to_pylist()
            dense = faiss.read_index(str(path / "dense.faiss"))
            bm25 = bm25s.BM25.load(str(path / "bm25"))
        except Exception as e:  # noqa: BLE001 - a damaged index is the user's file
            raise DataError(f"retriever index {path} is unreadable: {type(e).__name__}: {e}") from None
        documents = [Document(id=r["id"], text=r["text"], title=r["title"], image=r["image"]) for r in table]
        counts = {
            "docs.parquet": len(documents),
            "dense.faiss": dense.ntotal,
            "bm25": bm25.scores["num_docs"],
        }
        if set(counts.values()) != {meta["count"]}:
            raise DataError(f"retriever index {path} is inconsistent: meta count {meta['count']}, {counts}")
        if dense.d != meta["dims"]:
            raise DataError(
                f"retriever index {path} is inconsistent: dims {dense.d} != meta dims {meta['dims']}"
            )
        embedder = embedder or Embedder(
            model or meta["model"], batch_size=batch_size, max_length=meta.get("max_length", 256)
        )
        return cls(
            documents, bm25, dense, embedder, meta, mode=mode, fusion_k=fusion_k, candidates=candidates
        )

    @property
    def count(self) -> int:
        return len(self.documents)

    def search(self, queries: list[str], top_k: int = 5, *, mode: str | None = None) -> list[list[Hit]]:
        """The best `top_k` documents for each query; all queries' embeddings in one batched pass.

        Each retriever contributes its best max(candidates, top_k) documents to the fusion.
        """
        mode = _check_mode(mode or self.mode)
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if not queries:
            return []
        pool = min(max(self.candidates, top_k), self.count)
        lexical = self._bm25_rankings(queries, pool) if mode != "dense" else None
        semantic = self._dense_rankings(queries, pool) if mode != "bm25" else None
        results = []
        for q in range(len(queries)):
            if mode == "bm25":
                ranked = lexical[q]
            elif mode == "dense":
                ranked = semantic[q]
            else:
                ranked = reciprocal_rank_fusion(
                    [[doc for doc, _ in lexical[q]], [doc for doc, _ in semantic[q]]], k=self.fusion_k
                )
            results.append(
                [self._hit(doc, score, rank) for rank, (doc, score) in enumerate(ranked[:top_k], 1)]
            )
        return results

    def _hit(self, doc: int, score: float, rank: int) -> Hit:
        d = self.documents[doc]
        return Hit(id=d.id, score=float(score), text=d.text, title=d.title, image=d.image, rank=rank)

    def _bm25_rankings(self, queries: list[str], pool: int) -> list[list[tuple[int, float]]]:
        import bm25s

        tokens = bm25s.tokenize(
            queries, stopwords=BM25_SETTINGS["stopwords"], return_ids=False, show_progress=False
        )  # list of token lists; words unknown to the index are dropped by bm25s
        indices, scores = self.bm25.retrieve(tokens, k=pool, show_progress=False)  # [Q, pool] each
        return [
            [(int(doc), float(score)) for doc, score in zip(row_docs, row_scores) if score > 0]
            for row_docs, row_scores in zip(indices, scores)
        ]

    def _dense_rankings(self, queries: list[str], pool: int) -> list[list[tuple[int, float]]]:
        vectors = self.embedder.encode(queries)  # [Q, D]
        scores, indices = self.dense.search(np.ascontiguousarray(vectors), pool)  # [Q, pool] each
        return [
            [(int(doc), float(score)) for doc, score in zip(row_docs, row_scores) if doc >= 0]
            for row_docs, row_scores in zip(indices, scores)
        ]
