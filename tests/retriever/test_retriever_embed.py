"""The embedding model: where it is found, and that batching does not change a vector."""

from pathlib import Path

import numpy as np
import pytest
import torch

from grouprl.errors import ModelLoadError
from grouprl.retriever.embed import Embedder, resolve_embedding_model
from retriever.sample_index import shared_embedder


def test_builtin_and_its_hub_id_resolve_to_the_packaged_folder(tmp_path):
    folder = Path(resolve_embedding_model("builtin:all-minilm-l6-v2"))
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert resolve_embedding_model("sentence-transformers/all-MiniLM-L6-v2") == str(folder)
    assert resolve_embedding_model(str(tmp_path)) == str(tmp_path)  # a local folder is used as is
    assert resolve_embedding_model("org/other-model") == "org/other-model"  # a hub id passes through
    with pytest.raises(ModelLoadError, match="unknown built-in embedding model 'builtin:nope'"):
        resolve_embedding_model("builtin:nope")


def test_unloadable_model_is_one_line_error(tmp_path):
    with pytest.raises(ModelLoadError, match=r"could not load embedding model '.*empty'") as raised:
        Embedder(str(tmp_path / "empty")).encode(["x"])
    assert "\n" not in str(raised.value)


def test_batched_vectors_equal_one_at_a_time_mean_pooling():
    embedder = shared_embedder()
    texts = ["a cat", "the capital of France is Paris", "x", "green tea contains caffeine, a stimulant"]
    batched = embedder.encode(texts)  # [4, 384], padded batch
    assert batched.shape == (4, 384) and batched.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)
    # reference: each text alone (no padding), plain mean over its tokens, then L2 norm
    embedder._load()
    for text, vector in zip(texts, batched):
        with torch.inference_mode():
            tokens = embedder._tokenizer(text, return_tensors="pt")
            hidden = embedder._model(**tokens).last_hidden_state[0]  # [T, D]
        reference = hidden.mean(0).numpy()
        np.testing.assert_allclose(vector, reference / np.linalg.norm(reference), atol=2e-5)
    assert embedder.encode([]).shape == (0, 384)


def test_similar_texts_are_closer():
    cat, kitten, market = shared_embedder().encode(["a cat", "a small kitten", "the stock market fell"])
    assert float(cat @ kitten) > float(cat @ market) + 0.2
