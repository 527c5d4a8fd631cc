"""Session fixtures: an index of the sample corpus (tests/retriever/sample_index.py)."""

import pytest

from grouprl.retriever.index import Retriever, build_index
from retriever.sample_index import shared_embedder, write_corpus


@pytest.fixture(scope="session")
def tool_corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("tool_corpus"))


@pytest.fixture(scope="session")
def tool_retriever(tool_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_index") / "index"
    build_index(tool_corpus, out, embedder=shared_embedder())
    return Retriever.load(out, embedder=shared_embedder())
