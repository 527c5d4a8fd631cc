"""The search engine of search agents: a hybrid (BM25 + dense) index over a page corpus,
searched in-process (`Retriever`) or through an HTTP service (`create_app`, `RetrievalClient`).

    grouprl retriever build --corpus corpus.jsonl --out index/
    grouprl retriever serve --index index/ --port 8002

Names are imported on first use, so `grouprl --help` does not pay for numpy, httpx or FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Document": "corpus",
    "read_corpus": "corpus",
    "DEFAULT_EMBEDDING_MODEL": "embed",
    "Embedder": "embed",
    "MODES": "fusion",
    "reciprocal_rank_fusion": "fusion",
    "Hit": "index",
    "Retriever": "index",
    "build_index": "index",
    "read_meta": "index",
    "create_app": "service",
    "BackgroundServer": "service",
    "RetrievalClient": "client",
    "RetrievalServiceError": "client",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
