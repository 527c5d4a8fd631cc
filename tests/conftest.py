"""Shared test set-up. Its presence puts this `tests` folder on sys.path (pytest's default
"prepend" import mode), so any test module can `from helpers import tiny_model_and_tokenizer`."""

import pytest


def pytest_configure(config):
    """hypothesis (the fuzz tests) keeps its caches in a temp folder, not a `.hypothesis/` in the
    folder pytest runs from; the tests themselves keep no example database (`database=None`)."""
    import importlib.util
    import tempfile
    from pathlib import Path

    if importlib.util.find_spec("hypothesis") is not None:
        from hypothesis.configuration import set_hypothesis_home_dir

        set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "grouprl-hypothesis")


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory):
    """The sample page corpus of tests/retriever/sample_index.py (read-only for tests)."""
    from retriever.sample_index import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def index_dir(corpus_path, tmp_path_factory):
    """One index of the sample corpus, built once per session (read-only for tests)."""
    from grouprl.retriever.index import build_index
    from retriever.sample_index import shared_embedder

    out = tmp_path_factory.mktemp("indexes") / "index"
    build_index(corpus_path, out, embedder=shared_embedder())
    return out


@pytest.fixture(scope="session")
def retriever(index_dir):
    from grouprl.retriever.index import Retriever
    from retriever.sample_index import shared_embedder

    return Retriever.load(index_dir, embedder=shared_embedder())
