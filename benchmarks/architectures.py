"""The published configs of the models grouprl's users train (Qwen2.5 0.5B-7B, Qwen2.5-VL 3B and
7B) and of the default recipe's SmolLM2-135M, as config.json folders: what the memory plan reads (`grouprl train ... --dry-run` with
model.path pointing at one) and what benchmarks/scale.py builds with random weights. Nothing is
downloaded: the numbers are those of each model's config.json on the Hugging Face hub.

    from architectures import write_config
    folder = write_config("qwen2.5-vl-7b", tmp_path)   # tmp_path/qwen2.5-vl-7b/config.json
"""

from __future__ import annotations

import json
from pathlib import Path

_QWEN_TOKENS = {"bos_token_id": 151643, "eos_token_id": 151645}


def _qwen2(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 32768,
        "max_window_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "torch_dtype": "bfloat16",
        **_QWEN_TOKENS,
    }


def _qwen2_5_vl(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool) -> dict:
    text = _qwen2(hidden, intermediate, layers, heads, kv_heads, vocab, tied)
    text.update(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        model_type="qwen2_5_vl",
        max_position_embeddings=128000,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        vision_token_id=151654,
        image_token_id=151655,
        video_token_id=151656,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        vision_config={
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    )
    return text


def _smollm2_135m() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16",
    }  # fmt: skip


ARCHITECTURES: dict[str, dict] = {
    "smollm2-135m": _smollm2_135m(),  # the default recipe's policy (the GPU check's, where its package cannot travel)
    "qwen2.5-0.5b": _qwen2(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": _qwen2(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": _qwen2(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": _qwen2(3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-vl-3b": _qwen2_5_vl(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-vl-7b": _qwen2_5_vl(3584, 18944, 28, 28, 4, 152064, False),
}


def write_config(name: str, parent: str | Path) -> Path:
    """A folder `parent/name` holding the published config.json of `name`."""
    folder = Path(parent) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(ARCHITECTURES[name], indent=1) + "\n")
    return folder
