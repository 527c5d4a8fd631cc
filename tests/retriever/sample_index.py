"""A small page corpus with drawn page images, and one embedding model shared by every test.

    from retriever.sample_index import shared_embedder, write_corpus, DOCS

The `tests` folder is on sys.path (tests/conftest.py), so test modules anywhere below it
import this as `retriever.sample_index`; always use that spelling, so the embedder (about 4 s
to load) is loaded once per session.
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

from grouprl.retriever.embed import Embedder

# (id, title, text); the images of "cats" and "paris" are drawn by `write_corpus`.
DOCS = [
    ("cats", "Cats", "Cats are small domesticated carnivorous mammals that purr and hunt mice."),
    ("dogs", "Dogs", "Dogs are loyal animals descended from wolves; they bark and guard houses."),
    ("revenue", "Annual report 2023", "Revenue grew by twelve percent in 2023 thanks to strong exports."),
    ("paris", "", "Paris is the capital city of France, on the river Seine, with the Eiffel Tower."),
    ("rome", "Rome", "Rome is the capital of Italy, famous for the Colosseum and ancient ruins."),
    ("volcano", "Volcanoes", "A volcano erupts molten lava, ash and gases from the Earth's crust."),
    ("python", "Python language", "Python is a programming language with dynamic typing and indentation."),
    ("tea", "Green tea", "Green tea is brewed from unoxidised leaves and contains caffeine."),
]
IMAGE_SIZES = {"cats": (120, 80), "paris": (300, 200)}


def gradient_image(size: tuple[int, int]):
    """An RGB image whose pixel (x, y) is (x % 256, y % 256, 7): crops are checkable by value."""
    from PIL import Image

    width, height = size
    image = Image.new("RGB", size)
    image.putdata([(x % 256, y % 256, 7) for y in range(height) for x in range(width)])
    return image


def write_corpus(folder: Path) -> Path:
    """corpus.jsonl plus pages/<id>.png for the docs with images; returns the corpus path."""
    (folder / "pages").mkdir(parents=True, exist_ok=True)
    lines = []
    for doc_id, title, text in DOCS:
        record = {"id": doc_id, "text": text}
        if title:
            record["title"] = title
        if doc_id in IMAGE_SIZES:
            gradient_image(IMAGE_SIZES[doc_id]).save(folder / "pages" / f"{doc_id}.png")
            record["image"] = f"pages/{doc_id}.png"  # relative to the corpus file
        lines.append(json.dumps(record))
    corpus = folder / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    return corpus


@functools.lru_cache(maxsize=1)
def shared_embedder() -> Embedder:
    return Embedder(batch_size=64)


class CountingEmbedder:
    """Wraps an Embedder and records the size of every `encode` call (a batch = one call)."""

    def __init__(self, inner: Embedder):
        self.inner = inner
        self.model_name = inner.model_name
        self.max_length = inner.max_length
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def encode(self, texts):
        with self._lock:
            self.calls.append(len(texts))
        return self.inner.encode(texts)
