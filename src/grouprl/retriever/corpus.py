"""Read a page corpus (jsonl): one document per line.

    {"id": "report_3", "text": "Revenue grew 12% ...", "image": "pages/report_3.jpg", "title": "Annual report"}

`id` and `text` are required (`text` may be empty for image-only pages); `image` is a path
relative to the corpus file (or absolute) and is stored resolved to an absolute path; `title`
is optional. Problems are one-line `DataError`s naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from grouprl.errors import DataError


@dataclass(frozen=True)
class Document:
    """One searchable page."""

    id: str
    text: str
    title: str = ""
    image: str | None = None  # absolute path of the page image, if any

    @property
    def searchable_text(self) -> str:
        """What BM25 and the embedder read: the title, then the text."""
        return f"{self.title}\n{self.text}" if self.title else self.text


def read_corpus(path: str | Path) -> list[Document]:
    """All documents of a jsonl corpus, in file order; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"corpus file not found: {path}")
    base = path.resolve().parent
    documents: list[Document] = []
    seen: dict[str, int] = {}  # id -> line number of its first occurrence
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            document = _parse_line(line, path, number, base)
            if document.id in seen:
                raise DataError(
                    f"{path}:{number}: duplicate id {document.id!r} (first on line {seen[document.id]})"
                )
            seen[document.id] = number
            documents.append(document)
    if not documents:
        raise DataError(f"corpus {path} is empty")
    return documents


def _parse_line(line: str, path: Path, number: int, base: Path) -> Document:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    doc_id = record.get("id")
    if doc_id is None or (isinstance(doc_id, str) and not doc_id.strip()):
        raise DataError(f"{where}: missing id")
    if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool):
        raise DataError(f"{where}: id must be a string or an integer, got {type(doc_id).__name__}")
    text = record.get("text")
    if not isinstance(text, str):
        raise DataError(
            f"{where}: missing text (a string)" if text is None else f"{where}: text must be a string"
        )
    title = record.get("title") or ""
    if not isinstance(title, str):
        raise DataError(f"{where}: title must be a string")
    image = record.get("image")
    if image is not None:
        if not isinstance(image, str) or not image:
            raise DataError(f"{where}: image must be a path string")
        image = str((base / image).resolve()) if not Path(image).is_absolute() else image
    return Document(id=str(doc_id), text=text, title=title, image=image)


def file_sha256(path: str | Path) -> str:
    """Hex digest of the file's bytes: recorded in the index to tell which corpus it came from."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
