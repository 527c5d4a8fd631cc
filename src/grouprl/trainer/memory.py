"""The memory plan: what each device holds at its peak in each phase of a run, worked out from
the model's config.json and the run's settings alone (the model is built on the meta device to
count its parameters; no weight is read), before anything loads.

Phases, per rank (every rank holds the same, so one is planned):
- start-up: what loading materialises before the engine starts: one process loads the whole
  model; on several ranks each rank makes only its shards, filled from rank 0's host copy;
- generation: the rollout engine (vLLM's share of the device, or the built-in engine's KV cache
  and logits) beside what the trainer keeps resident meanwhile (its weights, the optimizer's
  state, the reference, the copy that generates ahead; the reference and the optimizer's state
  in host memory with actor.reference_offload / optimizer_offload);
- update: weights, gradients, optimizer state, activations of one micro-batch (with or without
  gradient checkpointing), the LM head's chunk of logits, whole layers under FSDP, and whatever
  of the engine stays awake.
All figures are GiB (2^30 bytes). `grouprl train --dry-run` prints the plan, a run writes it to
`<run>/memory_plan.json` and stops before loading when a phase does not fit, naming settings that
would make it fit; each step logs what it measured (`perf/peak_gb/<phase>`, `PeakMeter`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from grouprl.config import Config
from grouprl.errors import UserError

log = logging.getLogger(__name__)

GIB = 2**30
AUTO_MICRO_BATCH_TOKENS = 16384  # actor.micro_batch_tokens=auto on CUDA (verl's ppo_max_token_len_per_gpu default)
PHASES = ("startup", "generation", "update")
# outside what the model's tensors take: the CUDA context, cuBLAS workspaces and NCCL buffers
# (about 0.5-1 GiB on an H100); on a CPU the interpreter with torch and transformers imported
CUDA_RUNTIME_GB = 1.0
CPU_RUNTIME_GB = 1.0


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

    layer = max((sum(p.numel() for p in m.parameters()) for m in decoder_layers(model)), default=0)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return Shape(
        params=params, trainable=trainable, vision=vision, linear=linear, layer=layer,
        layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
        heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
        vocab=text.vocab_size, head=untied_head, file_bytes=_dtype_bytes(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)),
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
    memory_gb: float  # one device's memory; on a CPU the host's, which the node's ranks share
    named: bool = False  # from the settings, not read off this machine

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def describe(self) -> str:
        if self.kind == "cpu":
            ranks = f", {self.per_node} ranks on each" if self.per_node > 1 else ""
            hosts = f"{self.nodes} CPU hosts" if self.nodes > 1 else "a CPU host"
            return f"{hosts} of {self.memory_gb:.1f} GiB{ranks}"
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.per_node} GPU{'s' if self.per_node > 1 else ''} of {self.memory_gb:.1f} GiB"


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
                memory = torch.cuda.get_device_properties(0).total_memory / GIB
            elif kind == "cpu":
                memory = host_memory_gb()
            else:
                raise UserError(
                    f"trainer.n_gpus_per_node={t.n_gpus_per_node} names GPUs this machine lacks: "
                    "set trainer.gpu_memory_gb (the memory of one, e.g. 80) to plan for them"
                )
        return Devices(kind, t.nnodes, t.n_gpus_per_node, float(memory), named=True)
    from grouprl.trainer.models import resolve_device

    device = resolve_device(t.device)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    if t.gpu_memory_gb:
        memory = t.gpu_memory_gb
    elif device.type == "cuda":
        memory = torch.cuda.get_device_properties(device.index or 0).total_memory / GIB
    else:
        memory = host_memory_gb()
    return Devices(device.type, max(1, world // max(per_node, 1)), per_node, float(memory))


# ----------------------------------------------------------------------------- the plan
@dataclass
class Phase:
    name: str
    parts: dict[str, float] = field(default_factory=dict)  # GiB per part on one device

    @property
    def peak(self) -> float:
        return sum(self.parts.values())


@dataclass
class Plan:
    devices: Devices
    phases: list[Phase]
    resolved: dict[str, str]  # the settings the plan assumed, `auto` resolved

    @property
    def budget_gb(self) -> float:
        """What one rank may use: the device, or on a CPU its share of the host."""
        d = self.devices
        return d.memory_gb / max(d.per_node, 1) if d.kind == "cpu" else d.memory_gb

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    @property
    def worst(self) -> Phase:
        return max(self.phases, key=lambda p: p.peak)

    @property
    def fits(self) -> bool:
        return self.worst.peak <= self.budget_gb

    def table(self) -> list[str]:
        """The plan as text: GiB per part (rows) and phase (columns), each phase's peak, the
        device, and whether it fits."""
        names = [p.name for p in self.phases]
        parts = list(dict.fromkeys(k for p in self.phases for k in p.parts))
        width = max(len(k) for k in [*parts, "peak per device"]) + 2
        lines = ["".join([f"{'GiB':<{width}}", *(f"{n:>12}" for n in names)])]
        for part in parts:
            cells = [f"{p.parts[part]:>12.2f}" if part in p.parts else f"{'-':>12}" for p in self.phases]
            lines.append("".join([f"{part:<{width}}", *cells]))
        lines.append("".join([f"{'peak per device':<{width}}", *(f"{p.peak:>12.2f}" for p in self.phases)]))
        share = f" (a 1/{self.devices.per_node} share of the host: {self.budget_gb:.1f} GiB)" if self.devices.kind == "cpu" and self.devices.per_node > 1 else ""
        verdict = "fits" if self.fits else f"DOES NOT FIT ({self.worst.name}: {self.worst.peak:.1f} GiB)"
        lines.append(f"devices: {self.devices.describe()}{share}: {verdict}")
        lines.append("assumed: " + ", ".join(f"{k}={v}" for k, v in self.resolved.items()))
        return lines

    def to_json(self) -> dict:
        return {
            "devices": asdict(self.devices),
            "budget_gb": round(self.budget_gb, 3),
            "fits": self.fits,
            "resolved": self.resolved,
            "phases": {p.name: {"parts": {k: round(v, 4) for k, v in p.parts.items()}, "peak_gb": round(p.peak, 4)} for p in self.phases},
        }

    def write(self, run_dir: Path) -> Path:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "memory_plan.json"
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def _bytes(dtype: torch.dtype | None, default: int) -> int:
    return default if dtype is None else torch.empty((), dtype=dtype).element_size()


def context_length(cfg: Config) -> int:
    """The longest sequence a trajectory can reach: the prompt and every policy and observation
    token after it (an agent's turns), capped by rollout.max_model_len when set."""
    r, a = cfg.rollout, cfg.agent
    if a.enabled:
        response = a.max_response_tokens or a.max_turns * r.max_response_length
        turns = a.max_turns
        total = cfg.data.max_prompt_length + response + turns * a.max_observation_tokens
    else:
        total = cfg.data.max_prompt_length + r.max_response_length
    return min(total, r.max_model_len) if r.max_model_len else total


def activation_bytes_per_token(shape: Shape, *, param_bytes: int, compute_bytes: int, lean: bool) -> int:
    """What autograd keeps for backward per token and decoder layer (no checkpointing), with
    attention by a fused kernel (flash / memory-efficient SDPA: no [T, T] scores kept), counted
    off transformers' Llama/Qwen2 layers (tests/trainer/test_memory.py holds the count against
    autograd's saved tensors). In elements of hidden size h, intermediate size i and key/value
    width kv:
    - float32 throughout: 8 h (each norm's input, normalised input and output, the queries, the
      attention's output), 4 i (gate, up, activation, product), 2 kv (keys, values);
    - bf16 autocast over float32 weights: the norms' input and normalised input stay float32
      (4 h), and 7 h in bf16: the first norm's output cast once for each of q, k, v, the second's
      once for each of gate and up, the queries and the attention's output; 4 i and 2 kv in bf16;
    - bf16 weights (model.dtype, or FSDP's gathered mixed precision): 2 h float32 inside the norms,
      6 h, 4 i and 2 kv in bf16.
    `lean` (a CPU's actor.lean_norm and lean_mlp) recomputes the normalised inputs (2 h float32)
    and the MLP's activation and product (2 i)."""
    h, i = shape.hidden, shape.intermediate
    kv = shape.kv_heads * shape.head_dim
    if param_bytes == 4 and compute_bytes == 4:
        total = 4 * (8 * h + 4 * i + 2 * kv)
    elif param_bytes == 4:
        total = 4 * 4 * h + compute_bytes * (7 * h + 4 * i + 2 * kv)
    else:
        total = 4 * 2 * h + param_bytes * (6 * h + 4 * i + 2 * kv)
    if lean:
        total -= 4 * 2 * h + compute_bytes * 2 * i
    return total


def _param_bytes(cfg: Config) -> int:
    return 2 if cfg.model.dtype in ("bfloat16", "float16") else 4


def _compute_bytes(cfg: Config, devices: Devices) -> int:
    """The update's compute precision (trainer.models.resolve_compute_dtype, for the planned
    devices): bf16 under actor.dtype=bfloat16, or auto over float32 weights where bf16 is native."""
    from grouprl.trainer.models import cpu_has_native_bf16

    param_bytes, a = _param_bytes(cfg), cfg.actor.dtype
    native = devices.kind == "cuda" or cpu_has_native_bf16()
    if a == "bfloat16" or (a == "auto" and param_bytes == 4 and native):
        return 2
    return param_bytes


def plan_memory(cfg: Config, shape: Shape, devices: Devices, runtime_gb: float | None = None) -> Plan:
    """Each phase's parts on one device (see the module docstring). `runtime_gb`: what the
    process holds besides the model (default: an estimate per device kind)."""
    cfg = settle_for_devices(cfg, shape, devices)  # `auto` settings as the devices make them
    m, r, a = cfg.model, cfg.rollout, cfg.actor
    on_cuda = devices.kind == "cuda"
    world = devices.world
    shards = world if a.fsdp_size in (-1, 0) else min(a.fsdp_size, world)
    param_bytes = _param_bytes(cfg)
    compute_bytes = _compute_bytes(cfg, devices)
    rollout_bytes = compute_bytes if r.dtype == "auto" else (2 if r.dtype == "bfloat16" else param_bytes)
    resolved = {
        "parameters": {4: "float32", 2: m.dtype if param_bytes == 2 else "float32"}[param_bytes],
        "compute": "bfloat16" if compute_bytes == 2 and param_bytes == 4 else "parameters'",
        "fsdp_shards": str(shards),
        "rollout_dtype": "bfloat16" if rollout_bytes == 2 else "float32",
        "engine": r.engine,
    }
    gb = 1 / GIB
    lora = m.lora.rank > 0
    quantized = m.quantization != "none"
    runtime = runtime_gb if runtime_gb is not None else CUDA_RUNTIME_GB if on_cuda else CPU_RUNTIME_GB

    # the trainer's own tensors (sharded over `shards` ranks when several)
    if quantized:  # bitsandbytes packs the language model's linear weights (4 bits + scales)
        per = 0.5 + 4 / 64 if m.quantization == "4bit" else 1 + 4 / 64
        base = shape.linear * per + (shape.params - shape.linear - shape.trainable) * compute_bytes
        weights = (base + shape.trainable * param_bytes) * gb
    else:
        weights = shape.params * param_bytes / shards * gb
    grads = shape.trainable * param_bytes / shards * gb
    optimizer = 2 * shape.trainable * param_bytes / shards * gb
    offloaded = a.fsdp_offload and world > 1 and on_cuda  # FSDP keeps the shards, their gradients and AdamW's state in host memory
    optimizer_here = 0.0 if offloaded else optimizer
    weights_here = 0.0 if offloaded else weights
    needs_ref = cfg.algorithm.kl_coef > 0 or a.kl_loss_coef > 0
    autocast_bytes = compute_bytes if compute_bytes != param_bytes else None
    if not needs_ref or lora:
        reference = 0.0
    elif world > 1:  # sharded like the policy
        reference = weights
    else:  # its linear weights in the compute dtype
        reference = shape.frozen_copy_bytes(param_bytes, autocast_bytes) * gb
    generation_autocast = rollout_bytes if rollout_bytes != param_bytes else None
    ahead_copy = shape.frozen_copy_bytes(param_bytes, generation_autocast) * gb if r.max_staleness else 0.0

    # the engine during generation
    rows = generation_rows(cfg, world)
    length = context_length(cfg)
    kv_need = kv_need_gb(cfg, shape, world, rollout_bytes)
    engine_weights = shape.params * rollout_bytes * gb
    generation_parts: dict[str, float] = {}
    if r.engine == "vllm":
        if r.kv_cache_gb:
            engine = engine_weights + r.kv_cache_gb
        elif on_cuda:
            engine = r.gpu_memory_utilization * devices.memory_gb
        else:  # vLLM's CPU build: the KV cache the rollout can fill (cpu_kv_cache_gb)
            engine = engine_weights + cpu_kv_cache_gb(kv_need)
        generation_parts["engine (vLLM)"] = engine
        asleep = r.sleep_level > 0 and on_cuda
        awake_in_update = 0.0 if asleep else engine
        resolved["vllm_in_update"] = f"asleep (level {r.sleep_level})" if asleep else "awake"
    else:
        logits = rows * shape.vocab * 4 * 2 * gb  # a decode step's float32 logits and their softmax
        generation_parts["KV cache"] = kv_need
        generation_parts["decode logits"] = logits
        if world == 1 and not r.max_staleness and rollout_bytes < param_bytes:
            # autocast keeps a cast of each trainable weight for as long as the rollout's autocast lasts
            generation_parts["weights cast for autocast"] = (shape.linear + shape.head) * rollout_bytes * gb
        if world > 1 and not r.max_staleness:  # the built-in engine decodes on the gathered policy:
            # FSDP's all-gathered copy (in the compute dtype), beside the shards
            generation_parts["gathered policy"] = shape.params * compute_bytes * gb
        awake_in_update = (kv_need + logits) if r.max_staleness else 0.0

    # the update: one micro-batch's activations. Under FSDP the whole weights are gathered in
    # the compute dtype (mixed precision), so the residual stream is in it too; in one process
    # autocast leaves it in the weights' dtype
    # a token budget's micro-batch holds at least one whole row (one over the budget goes alone)
    tokens = max(a.micro_batch_tokens, length) if a.micro_batch_tokens else a.micro_batch_size * length
    lean = devices.kind == "cpu" and a.lean_mlp and a.lean_norm
    stream_bytes = compute_bytes if world > 1 else param_bytes
    per_token = activation_bytes_per_token(shape, param_bytes=stream_bytes, compute_bytes=compute_bytes, lean=lean)
    if m.gradient_checkpointing:  # each layer's input kept, one layer's activations at a time
        activations = tokens * (shape.layers * shape.hidden * stream_bytes + per_token) * gb
    else:
        activations = tokens * shape.layers * per_token * gb
    chunk = min(a.logits_chunk_size or tokens, tokens)
    head = (chunk * shape.vocab * 4 * 3 + tokens * shape.hidden * stream_bytes * 2) * gb

    startup = Phase("startup", {"runtime": runtime})
    if world > 1:
        # sharded loading: rank 0 reads the weights into host memory, every rank makes its shards
        # on its device and fills them from rank 0's, one whole tensor at a time
        startup.parts["policy shard (offloaded to host)" if offloaded else "policy shard"] = weights_here
        largest = max(shape.vocab, shape.intermediate) * shape.hidden * param_bytes * gb
        startup.parts["one tensor whole (while filled)"] = largest
        if devices.kind == "cpu":  # the host is the device: rank 0's whole copy counts
            startup.parts["rank 0's whole copy (host)"] = shape.params * param_bytes * gb
            if shape.file_bytes != param_bytes:  # and the file it converts, mapped while read
                startup.parts["checkpoint file (mapped while converted)"] = shape.params * shape.file_bytes * gb
        if reference:
            startup.parts["reference shard"] = reference
    else:
        # one process loads the whole model, and copies it for the reference. On a CPU, weights
        # stored in their training dtype are mapped from the file, not copied: untouched until
        # used, unless a copy reads them
        mapped = devices.kind == "cpu" and shape.file_bytes == param_bytes and not quantized
        if mapped and not (reference or ahead_copy):
            startup.parts["policy (mapped from its file)"] = 0.0
        else:
            startup.parts["policy"] = shape.params * param_bytes * gb if not quantized else weights
            if devices.kind == "cpu" and shape.file_bytes != param_bytes and not quantized:
                # the file in another dtype (bf16 weights trained in float32), mapped while converted
                startup.parts["checkpoint file (mapped while converted)"] = shape.params * shape.file_bytes * gb
        if reference:
            startup.parts["reference"] = reference
    if ahead_copy:
        startup.parts["generation copy"] = ahead_copy

    held = {"policy (offloaded to host)": 0.0, "optimizer state (offloaded)": 0.0} if offloaded else {
        "policy": weights_here, "optimizer state": optimizer_here,
    }  # fmt: skip
    # actor.optimizer_offload: AdamW's state in host memory outside the update;
    # actor.reference_offload: the reference's weights outside its log-prob pass (trainer/offload.py)
    parked_optimizer = a.optimizer_offload is True and not offloaded
    parked_reference = bool(reference) and a.reference_offload is True
    generation = Phase("generation", {"runtime": runtime, **held})
    if parked_optimizer:
        del generation.parts["optimizer state"]
        generation.parts["optimizer state (in host memory)"] = 0.0
    if parked_reference:
        generation.parts["reference (in host memory)"] = 0.0
    elif reference:
        generation.parts["reference"] = reference
    if ahead_copy:
        generation.parts["generation copy"] = ahead_copy
    generation.parts.update(generation_parts)

    update = Phase("update", {"runtime": runtime, **held})
    if not offloaded:
        update.parts["gradients"] = grads
    if world > 1:  # the update's passes run on whole weights, gradients accumulating whole
        # (parallel.accumulating): FSDP keeps them in its reduce dtype (float32 by default)
        reduce_bytes = 4 if a.fsdp_reduce_dtype == "float32" else compute_bytes
        update.parts["whole weights and gradients (FSDP)"] = (
            shape.params * compute_bytes + shape.trainable * reduce_bytes
        ) * gb
    if reference and not parked_reference:
        update.parts["reference"] = reference
    if ahead_copy:
        update.parts["generation copy"] = ahead_copy
    update.parts["activations"] = activations
    update.parts["LM head chunk"] = head
    if parked_reference:  # on the device for its pass only, before the update's passes begin
        update.parts["reference (its pass, beyond the update's own)"] = max(0.0, reference - activations - head - grads)
    if world == 1 and compute_bytes < param_bytes:  # autocast's casts of the weights, kept for backward
        update.parts["weights cast for autocast"] = (shape.linear + shape.head) * compute_bytes * gb
    if a.shared_prefix and r.n_agent > 1 and micro_batches_per_step(cfg, world) > 1:
        # a micro-batch after the first: the decoder's weights serve two passes (the prompts'
        # and the responses'), and autograd holds the responses' weight gradients until the
        # prompts' backward adds theirs, beside the gradients accumulated so far
        whole_grad_bytes = compute_bytes if world > 1 else param_bytes  # FSDP accumulates whole grads in the compute dtype
        update.parts["gradient buffers (prompt pass)"] = min(shape.trainable, shape.layer * shape.layers) * whole_grad_bytes * gb
    if awake_in_update:
        update.parts["engine (awake)"] = awake_in_update
    resolved["gradient_checkpointing"] = str(m.gradient_checkpointing).lower()
    if reference:
        resolved["reference"] = "in host memory outside its pass" if parked_reference else "on the device"
    if parked_optimizer:
        resolved["optimizer state"] = "in host memory outside the update"
    resolved["tokens per micro-batch"] = str(tokens)
    return Plan(devices, [startup, generation, update], resolved)


def micro_batches_per_step(cfg: Config, world: int) -> int:
    """Micro-batches one rank accumulates before an optimizer step (the most, at full lengths)."""
    a = cfg.actor
    rows = max(1, (a.mini_batch_size or cfg.data.train_batch_size) // max(world, 1)) * cfg.rollout.n_agent
    if a.micro_batch_tokens:
        return -(-rows * context_length(cfg) // a.micro_batch_tokens)
    return -(-rows // a.micro_batch_size)


def generation_rows(cfg: Config, world: int) -> int:
    """The sequences one rank's engine decodes at once: its share of the batch's prompts (at
    most rollout.gen_batch_size) times n_agent."""
    r = cfg.rollout
    prompts = max(1, cfg.data.train_batch_size // max(world, 1))
    if r.gen_batch_size:
        prompts = min(prompts, r.gen_batch_size)
    return prompts * r.n_agent


def kv_need_gb(cfg: Config, shape: Shape, world: int, dtype_bytes: int) -> float:
    """The KV cache one rank's rollout can fill: every row at the run's context length."""
    return generation_rows(cfg, world) * context_length(cfg) * shape.kv_bytes_per_token(dtype_bytes) / GIB


def cpu_kv_cache_gb(need_gb: float) -> float:
    """vLLM's KV cache on a CPU, where its share of "GPU" memory is a share of the host (and
    several ranks' engines would each take it): what one rollout can fill, with room for a
    block's rounding, at least 0.25 GiB."""
    return max(0.25, need_gb * 1.1)


# ----------------------------------------------------------------------------- what would fit
def _variants(cfg: Config, devices: Devices):
    """Settings that lower the peak, each as (what to write, changed config, devices)."""
    m, a, r = cfg.model, cfg.actor, cfg.rollout
    if not m.gradient_checkpointing:
        yield "model.gradient_checkpointing=true", replace(cfg, model=replace(m, gradient_checkpointing=True)), devices
    length = context_length(cfg)
    budget = a.micro_batch_tokens or a.micro_batch_size * length
    if budget > length:
        yield (
            f"actor.micro_batch_tokens={length}",
            replace(cfg, actor=replace(a, micro_batch_tokens=length)),
            devices,
        )
    needs_ref = (cfg.algorithm.kl_coef > 0 or a.kl_loss_coef > 0) and m.lora.rank == 0
    if devices.kind == "cuda" and needs_ref and a.reference_offload is not True:
        yield "actor.reference_offload=true", replace(cfg, actor=replace(a, reference_offload=True)), devices
    if devices.kind == "cuda" and not a.optimizer_offload and not a.fsdp_offload:
        yield "actor.optimizer_offload=true", replace(cfg, actor=replace(a, optimizer_offload=True)), devices
    if devices.world > 1 and devices.kind == "cuda" and not a.fsdp_offload:
        yield "actor.fsdp_offload=true", replace(cfg, actor=replace(a, fsdp_offload=True)), devices
    if devices.world > 1 and a.fsdp_reduce_dtype == "float32" and _compute_bytes(cfg, devices) == 2:
        yield "actor.fsdp_reduce_dtype=compute", replace(cfg, actor=replace(a, fsdp_reduce_dtype="compute")), devices
    if r.engine == "vllm" and not r.kv_cache_gb and r.gpu_memory_utilization > 0.3:
        yield "rollout.gpu_memory_utilization=0.3", replace(cfg, rollout=replace(r, gpu_memory_utilization=0.3)), devices
    if m.lora.rank == 0:
        yield "model.lora.rank=64", replace(cfg, model=replace(m, lora=replace(m.lora, rank=64))), devices
    if devices.kind == "cuda":  # more GPUs on the node (up to 8), else more nodes
        for gpus in (2, 4, 8):
            if devices.per_node < gpus:
                yield f"trainer.n_gpus_per_node={gpus}", cfg, replace(devices, per_node=gpus)
        for nodes in (2, 4, 8):
            if devices.nodes < nodes:
                yield f"trainer.nnodes={nodes}", cfg, replace(devices, nodes=nodes)


def what_would_fit(cfg: Config, shape: Shape, devices: Devices, limit: int = 4) -> list[str]:
    """Settings that make the plan fit: each single change that does, else the changes taken
    together in the order tried (the first that fits with those before it)."""
    cfg = settle_for_devices(cfg, shape, devices)  # `auto` settings as the devices make them
    singles: dict[str, str] = {}  # the first that fits of each key (the fewest GPUs or nodes)
    for setting, c, d in _variants(cfg, devices):
        key = setting.split("=")[0]
        if key not in singles and plan_memory(c, _shape_for(c, cfg, shape), d).fits:
            singles[key] = setting
    if singles:
        return list(singles.values())[:limit]
    together: list[str] = []
    changed, devs = cfg, devices
    for _ in range(10):
        first = next(iter(_variants(changed, devs)), None)
        if first is None:
            return []
        setting, changed, devs = first
        together = [s for s in together if s.split("=")[0] != setting.split("=")[0]] + [setting]
        if plan_memory(changed, _shape_for(changed, cfg, shape), devs).fits:
            break
    else:
        return []
    for setting in list(together):  # what the others make fit without
        rest = [s for s in together if s != setting]
        c, d = _with(cfg, devices, rest)
        if plan_memory(c, _shape_for(c, cfg, shape), d).fits:
            together = rest
    return [" ".join(together)]


def _with(cfg: Config, devices: Devices, settings: list[str]) -> tuple[Config, Devices]:
    """`cfg` and `devices` with `settings` (names from _variants) applied in order."""
    for setting in settings:
        for name, changed, devs in _variants(cfg, devices):
            if name.split("=")[0] == setting.split("=")[0]:
                cfg, devices = changed, devs
                break
    return cfg, devices


def _shape_for(changed: Config, original: Config, shape: Shape) -> Shape:
    """The shape under `changed`'s LoRA setting: trainable parameters of rank-64 adapters on
    every linear layer, approximated from the linear weights' count when not built."""
    if changed.model.lora.rank == original.model.lora.rank:
        return shape
    rank = changed.model.lora.rank
    # rank r adapters on a [o, i] weight add r * (i + o); over the decoder's linear layers that
    # is close to r * linear / hidden * 2 (square-ish projections)
    adapters = int(rank * 2 * shape.linear / max(shape.hidden, 1))
    return replace(shape, trainable=adapters, params=shape.params + adapters)


# ----------------------------------------------------------------------------- checks and reports
def refusal(plan: Plan, cfg: Config, shape: Shape) -> str:
    """One line: the phase that does not fit, its figure, the device's, and what would fit."""
    worst = plan.worst
    biggest = sorted(worst.parts.items(), key=lambda kv: -kv[1])[:3]
    fixes = what_would_fit(cfg, shape, plan.devices)
    where = "per rank (a share of the host)" if plan.devices.kind == "cpu" and plan.devices.per_node > 1 else "per device"
    return (
        f"memory plan: the {worst.name} phase needs {worst.peak:.1f} GiB {where}, "
        f"{plan.devices.describe()} give {plan.budget_gb:.1f} "
        f"(largest: {', '.join(f'{k} {v:.1f}' for k, v in biggest)}); "
        + (f"would fit with: {' | '.join(fixes)}" if fixes else "no single setting here makes it fit")
        + "; trainer.memory_check=warn runs anyway"
    )


def lr_resolution_warning(cfg: Config) -> str | None:
    """A learning rate too small to move weights kept in bf16/fp16: an Adam step moves a weight
    by about lr, and a weight of typical size 0.02 changes only by more than half its ulp."""
    if cfg.model.dtype not in ("bfloat16", "float16"):
        return None
    eps = 2.0**-8 if cfg.model.dtype == "bfloat16" else 2.0**-11
    smallest = 0.02 * eps / 2  # half an ulp of a typical weight: a smaller step rounds away
    lr = cfg.actor.optim.lr
    if lr >= smallest:
        return None
    return (
        f"actor.optim.lr={lr:g} is below what {cfg.model.dtype} weights can move by (a weight of size 0.02 "
        f"changes only by more than {smallest:.1g}): the update will not change most weights; keep float32 "
        "master weights (model.dtype=float32, the default) with bf16 compute (actor.dtype=bfloat16 or auto)"
    )


# ----------------------------------------------------------------------------- measured peaks
_HWM = re.compile(r"VmHWM:\s+(\d+) kB")


class PeakMeter:
    """Each phase's measured peak: on CUDA the allocator's (max_memory_allocated, and reserved),
    on a CPU the process's resident set (VmHWM, reset at each phase's start through
    /proc/self/clear_refs). GiB, as `perf/peak_gb/<phase>`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    @staticmethod
    def reset_host() -> None:
        """The resident set's peak from now on (Linux; elsewhere the process's lifetime peak)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.reset_host()

    def read(self) -> dict[str, float]:
        """The peak since `start` (GiB): 'peak' (allocated on CUDA, resident on CPU) and, on
        CUDA, 'reserved' (what the caching allocator holds)."""
        if self.cuda:
            return {
                "peak": torch.cuda.max_memory_allocated(self.device) / GIB,
                "reserved": torch.cuda.max_memory_reserved(self.device) / GIB,
            }
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return {}
        found = _HWM.search(status)
        return {"peak": int(found.group(1)) * 1024 / GIB} if found else {}

    def measure(self, phase: str) -> dict[str, float]:
        """The peak since `start` as metrics of `phase`."""
        out = self.read()
        metrics = {f"perf/peak_gb/{phase}": out["peak"]} if "peak" in out else {}
        if "reserved" in out:
            metrics[f"perf/reserved_gb/{phase}"] = out["reserved"]
        return metrics


# ----------------------------------------------------------------------------- at a run's start
def current_rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / GIB


def settle_for_devices(cfg: Config, shape: Shape, devices: Devices) -> Config:
    """Settings that depend on the devices, made concrete: vLLM's CPU build takes its share of
    "GPU" memory from the host, where every rank's engine would take it (two ranks at 0.5 take
    all of it), so on a CPU its KV cache is what one rollout can fill (cpu_kv_cache_gb) and its
    longest sequence the run's context length."""
    from grouprl.rollout.engines import resolve_engine
    from grouprl.trainer.models import wants_checkpointing

    r, m, a = cfg.rollout, cfg.model, cfg.actor
    if r.engine == "auto":
        engine = resolve_engine("auto", devices.kind, quantized=m.quantization != "none", assume_installed=devices.named)
        # an asynchronous run's vLLM stays awake (it generates while the update runs)
        sleep = 0 if engine == "vllm" and r.max_staleness else r.sleep_level
        r = replace(r, engine=engine, sleep_level=sleep)
    if m.gradient_checkpointing == "auto":
        m = replace(m, gradient_checkpointing=wants_checkpointing("auto", torch.device(devices.kind), shape.params))
    if a.reference_offload == "auto":
        a = replace(a, reference_offload=devices.kind == "cuda")
    if a.micro_batch_tokens == "auto":
        a = replace(a, micro_batch_tokens=max(AUTO_MICRO_BATCH_TOKENS, context_length(cfg)) if devices.kind == "cuda" else 0)
    cfg = replace(cfg, rollout=r, model=m, actor=a)
    if r.engine == "vllm" and devices.kind == "cpu" and not r.kv_cache_gb:
        bf16 = r.dtype == "bfloat16" or (r.dtype == "auto" and _compute_bytes(cfg, devices) == 2)
        need = kv_need_gb(cfg, shape, devices.world, 2 if bf16 else 4)
        r = replace(r, kv_cache_gb=round(cpu_kv_cache_gb(need), 3), max_model_len=r.max_model_len or context_length(cfg))
        cfg = replace(cfg, rollout=r)
    return cfg


def plan_run(cfg: Config, config, run_dir: Path, *, write: bool) -> tuple[Config, Plan | None]:
    """At a run's start, before the model loads: the settings settled for the devices, and their
    plan, written to <run>/memory_plan.json (`write`: this rank writes); a plan that does not
    fit stops the run with one line (trainer.memory_check=refuse) or warns (warn)."""
    check = cfg.trainer.memory_check
    shape = model_shape(cfg.model, config)
    devices = devices_for(cfg)
    cfg = settle_for_devices(cfg, shape, devices)
    if check == "off":
        return cfg, None
    runtime = current_rss_gb() if devices.kind == "cpu" and not devices.named else None
    plan = plan_memory(cfg, shape, devices, runtime_gb=runtime)
    if write:
        plan.write(run_dir)
    if not plan.fits:
        line = refusal(plan, cfg, shape)
        if check == "refuse":
            raise UserError(line)
        log.warning(line)
    warning = lr_resolution_warning(cfg)
    if warning:
        log.warning(warning)
    return cfg, plan
