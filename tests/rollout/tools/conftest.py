"""The tools' names for the session's sample corpus and its index (tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def tool_corpus(corpus_path):
    return corpus_path


@pytest.fixture(scope="session")
def tool_retriever(retriever):
    return retriever
