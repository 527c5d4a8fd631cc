"""What a plan is made from: the model's shape (counted on the meta device) and the devices."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from grouprl.config import Config

GIB = 2**30
AUTO_MICRO_BATCH_TOKENS = 16384  # actor.micro_batch_tokens=auto on CUDA (verl's ppo_max_token_len_per_gpu default)
PHASES = ("startup", "generation", "update")
# outside what the model's tensors take: the CUDA context, cuBLAS workspaces and NCCL buffers
# (about 0.5-1 GiB on an H100); on a CPU the interpreter with torch and transformers imported
CUDA_RUNTIME_GB = 1.0
CPU_RUNTIME_GB = 1.0
# PyTorch's caching allocator on CUDA reserves more than it allocates: blocks split and cached
# for other sizes (the plan's stated margin on what the trainer allocates in a phase)
FRAGMENTATION = 0.05
# what vLLM still holds asleep (levels 1 and 2 free its weights and KV cache): its CUDA graphs'
# memory pool (captured batch sizes; none with enforce_eager) and buffers of its own (sampler,
# workspaces), as vLLM's own reports of a 7-8B model put them
VLLM_ASLEEP_GB = 1.25
VLLM_ASLEEP_EAGER_GB = 0.25


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: parameter counts and the language model's dimensions."""

    params: int  # every parameter, tied ones once
    trainable: int  # those the update trains (frozen parts and LoRA's base left out)
    vision: int  # the vision tower and connector
    linear: int  # in the language model's linear layers, LM head excluded (what 4-bit packs)
    layer: int  # the largest decoder layer (what FSDP gathers at a time)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    file_bytes: int = 4  # bytes a weight takes in the checkpoint (config.json's dtype)
    head: int = 0  # the LM head's weights when not tied to the embeddings
    root: int = 0  # outside the layers FSDP shards one by one (embeddings, head, norms, a VLM's connector)
    positions: int = 0  # the language model's max_position_embeddings (0 = unknown)

    def frozen_copy_bytes(self, param_bytes: int, autocast_bytes: int | None) -> float:
        """A copy that runs under autocast only (trainer.models.cast_frozen_linears): its linear
        weights in the autocast dtype, the rest in the parameters'."""
        if autocast_bytes is None or autocast_bytes == param_bytes:
            return self.params * param_bytes
        linear = self.linear + self.head
        return linear * autocast_bytes + (self.params - linear) * param_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


def model_shape(model_cfg, config) -> Shape:
    """The Shape of the model a transformers `config` describes, as `model_cfg` (the model
    section: LoRA, frozen parts) would train it: built on the meta device, nothing allocated."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from grouprl.trainer.models import freeze_parts, lora_config
    from grouprl.vision.families import family_class, is_vision_config

    family = family_class(config) if is_vision_config(config) else None
    auto = AutoModelForImageTextToText if family is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    if family is not None:
        freeze_parts(model, family, model_cfg)
    vision_prefixes = (family.tower + family.connector) if family is not None else ()
    head = model.get_output_embeddings()
    embeddings = model.get_input_embeddings()
    untied_head = head.weight.numel() if head is not None and head.weight is not getattr(embeddings, "weight", None) else 0
    linear = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and not name.startswith(vision_prefixes)
    )
    if model_cfg.lora.rank > 0:
        from peft import get_peft_model

        with torch.device("meta"):
            model = get_peft_model(model, lora_config(model_cfg, family))
        if family is not None:
            freeze_parts(model.get_base_model(), family, model_cfg, base_frozen=True)
    seen, params, trainable, vision = set(), 0, 0, 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        trainable += p.numel() if p.requires_grad else 0
        vision += p.numel() if _strip_peft(name).startswith(vision_prefixes) else 0
    from grouprl.trainer.parallel import decoder_layers

    blocks = decoder_layers(model)
    layer = max((sum(p.numel() for p in m.parameters()) for m in blocks), default=0)
    in_blocks = {id(p) for m in blocks for p in m.parameters()}
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return Shape(
        params=params, trainable=trainable, vision=vision, linear=linear, layer=layer,
        layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
        heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
        vocab=text.vocab_size, head=untied_head, file_bytes=_dtype_bytes(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)),
        root=sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in in_blocks),
        positions=getattr(text, "max_position_embeddings", 0) or 0,
    )  # fmt: skip


def _dtype_bytes(dtype) -> int:
    """Bytes per element of a config's dtype (a torch dtype or its name); 4 when it says none."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4


def _strip_peft(name: str) -> str:
    return name.removeprefix("base_model.model.")


@dataclass(frozen=True)
class Devices:
    """The devices a plan is for: those present, or those the settings name (a dry run for
    another machine: trainer.nnodes x trainer.n_gpus_per_node of trainer.gpu_memory_gb)."""

    kind: str  # "cuda" or "cpu"
    nodes: int
    per_node: int  # ranks on one node: its GPUs, or CPU processes sharing the host
    memory_gb: float  # one device's memory as it reports it (GiB; 0 = unknown); on a CPU the host's, which the node's ranks share
    named: bool = False  # from the settings, not read off this machine

    @property
    def known(self) -> bool:
        return self.memory_gb > 0

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def describe(self) -> str:
        if self.kind == "cpu":
            ranks = f", {self.per_node} ranks on each" if self.per_node > 1 else ""
            hosts = f"{self.nodes} CPU hosts" if self.nodes > 1 else "a CPU host"
            return f"{hosts} of {self.memory_gb:.1f} GiB{ranks}"
        memory = f"{self.memory_gb:.1f} GiB" if self.known else "unknown memory"
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.per_node} GPU{'s' if self.per_node > 1 else ''} of {memory}"


def cuda_memory_gb(index: int) -> float:
    """What the driver reports of a GPU's memory (an "80 GB" H100 or A100: about 79.2 GiB)."""
    return torch.cuda.mem_get_info(index)[1] / GIB


def host_memory_gb() -> float:
    import psutil

    return psutil.virtual_memory().total / GIB


def devices_for(cfg: Config) -> Devices:
    """The devices to plan for: named by trainer.n_gpus_per_node (and nnodes, gpu_memory_gb), or
    those present (the launcher's WORLD_SIZE / LOCAL_WORLD_SIZE ranks on trainer.device)."""
    t = cfg.trainer
    if t.n_gpus_per_node > 0:
        kind = "cpu" if t.device == "cpu" else "cuda"
        memory = t.gpu_memory_gb
        if not memory:
            if kind == "cuda" and torch.cuda.is_available():
                memory = cuda_memory_gb(0)
            elif kind == "cpu":
                memory = host_memory_gb()
            else:  # GPUs this machine lacks (a GPU script's dry run on a laptop): planned, not checked
                memory = 0.0
        return Devices(kind, t.nnodes, t.n_gpus_per_node, float(memory), named=True)
    from grouprl.trainer.models import resolve_device

    device = resolve_device(t.device)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    if t.gpu_memory_gb:
        memory = t.gpu_memory_gb
    elif device.type == "cuda":
        memory = cuda_memory_gb(device.index or 0)
    else:
        memory = host_memory_gb()
    return Devices(device.type, max(1, world // max(per_node, 1)), per_node, float(memory))
