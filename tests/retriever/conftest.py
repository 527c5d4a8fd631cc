"""Session fixtures: the sample corpus and one index built from it (read-only for tests)."""

import pytest

from grouprl.retriever.index import Retriever, build_index
from retriever.sample_index import shared_embedder, write_corpus


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def index_dir(corpus_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("indexes") / "index"
    build_index(corpus_path, out, embedder=shared_embedder())
    return out


@pytest.fixture(scope="session")
def retriever(index_dir):
    return Retriever.load(index_dir, embedder=shared_embedder())
