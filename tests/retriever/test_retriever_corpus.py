"""Reading corpus.jsonl: fields, image paths, and one-line errors naming file and line."""

import json

import pytest

from grouprl.errors import DataError
from grouprl.retriever.corpus import Document, file_sha256, read_corpus


def write_lines(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_reads_documents_in_order_with_resolved_images(tmp_path):
    absolute = tmp_path / "elsewhere" / "b.png"
    (tmp_path / "sub").mkdir()
    corpus = write_lines(
        tmp_path / "sub" / "corpus.jsonl",
        [
            {"id": "a", "text": "alpha", "title": "A", "image": "pages/a.png"},
            "",
            {"id": 7, "text": "", "image": str(absolute)},
            {"id": "c", "text": "gamma"},
        ],
    )
    docs = read_corpus(corpus)
    assert docs == [
        Document(id="a", text="alpha", title="A", image=str(tmp_path / "sub" / "pages" / "a.png")),
        Document(id="7", text="", title="", image=str(absolute)),
        Document(id="c", text="gamma", title="", image=None),
    ]
    assert docs[0].searchable_text == "A\nalpha"
    assert docs[2].searchable_text == "gamma"


@pytest.mark.parametrize(
    "lines, message",
    [
        (
            ['{"id": "a", "text": "x"}', "{not json"],
            ":2: not valid JSON (Expecting property name enclosed in double quotes)",
        ),
        ([{"id": "a", "text": "x"}, ["a list"]], ":2: expected a JSON object, got list"),
        ([{"text": "x"}], ":1: missing id"),
        ([{"id": " ", "text": "x"}], ":1: missing id"),
        ([{"id": "a"}], ":1: missing text (a string)"),
        ([{"id": "a", "text": 3}], ":1: text must be a string"),
        ([{"id": "a", "text": "x", "image": 5}], ":1: image must be a path string"),
        (
            [{"id": "a", "text": "x"}, "", {"id": "b", "text": "y"}, {"id": "a", "text": "z"}],
            ":4: duplicate id 'a' (first on line 1)",
        ),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, lines, message):
    corpus = write_lines(tmp_path / "corpus.jsonl", lines)
    with pytest.raises(DataError) as raised:
        read_corpus(corpus)
    assert str(raised.value) == f"{corpus}{message}"


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match=r"corpus file not found: .*nope\.jsonl"):
        read_corpus(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"corpus .*empty\.jsonl is empty"):
        read_corpus(empty)


def test_file_hash_is_sha256_of_bytes(tmp_path):
    import hashlib

    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"id": "a", "text": "x"}\n')
    assert file_sha256(path) == hashlib.sha256(b'{"id": "a", "text": "x"}\n').hexdigest()
