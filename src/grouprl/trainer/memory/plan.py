"""The plan: each phase's parts on one device, for settings settled for the devices."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from grouprl.config import Config
from grouprl.trainer.memory.inputs import (
    AUTO_MICRO_BATCH_TOKENS,
    CPU_RUNTIME_GB,
    CUDA_RUNTIME_GB,
    GIB,
    Devices,
    Shape,
)


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
    sizes = _Sizes(cfg, shape, devices, runtime_gb)
    phases = [sizes.startup(), sizes.generation(), sizes.update()]
    return Plan(devices, phases, sizes.resolved())


class _Sizes:
    """The figures (GiB per device) the phases are made of, for settled settings."""

    def __init__(self, cfg: Config, shape: Shape, devices: Devices, runtime_gb: float | None):
        self.cfg, self.shape, self.devices = cfg, shape, devices
        m, r, a = cfg.model, cfg.rollout, cfg.actor
        self.on_cuda = devices.kind == "cuda"
        self.world = world = devices.world
        self.shards = world if a.fsdp_size in (-1, 0) else min(a.fsdp_size, world)
        self.param_bytes = param_bytes = _param_bytes(cfg)
        self.compute_bytes = compute_bytes = _compute_bytes(cfg, devices)
        self.rollout_bytes = compute_bytes if r.dtype == "auto" else (2 if r.dtype == "bfloat16" else param_bytes)
        self.quantized = m.quantization != "none"
        self.runtime = runtime_gb if runtime_gb is not None else CUDA_RUNTIME_GB if self.on_cuda else CPU_RUNTIME_GB
        self._trainer_tensors()
        # actor.optimizer_offload: AdamW's state in host memory outside the update;
        # actor.reference_offload: the reference's weights outside its log-prob pass (trainer/offload.py)
        self.parked_optimizer = a.optimizer_offload is True and not self.offloaded
        self.parked_reference = bool(self.reference) and a.reference_offload is True
        self._engine()

    def _trainer_tensors(self) -> None:
        """The trainer's own tensors (sharded over `shards` ranks when several)."""
        cfg, shape, gb = self.cfg, self.shape, 1 / GIB
        m, a = cfg.model, cfg.actor
        param_bytes, compute_bytes, shards = self.param_bytes, self.compute_bytes, self.shards
        if self.quantized:  # bitsandbytes packs the language model's linear weights (4 bits + scales)
            per = 0.5 + 4 / 64 if m.quantization == "4bit" else 1 + 4 / 64
            base = shape.linear * per + (shape.params - shape.linear - shape.trainable) * compute_bytes
            self.weights = (base + shape.trainable * param_bytes) * gb
        else:
            self.weights = shape.params * param_bytes / shards * gb
        self.grads = shape.trainable * param_bytes / shards * gb
        optimizer = 2 * shape.trainable * param_bytes / shards * gb
        # FSDP keeps the shards, their gradients and AdamW's state in host memory
        self.offloaded = a.fsdp_offload and self.world > 1 and self.on_cuda
        self.optimizer_here = 0.0 if self.offloaded else optimizer
        self.weights_here = 0.0 if self.offloaded else self.weights
        needs_ref = cfg.algorithm.kl_coef > 0 or a.kl_loss_coef > 0
        autocast_bytes = compute_bytes if compute_bytes != param_bytes else None
        if not needs_ref or m.lora.rank > 0:
            self.reference = 0.0
        elif self.world > 1:  # sharded like the policy
            self.reference = self.weights
        else:  # its linear weights in the compute dtype
            self.reference = shape.frozen_copy_bytes(param_bytes, autocast_bytes) * gb
        generation_autocast = self.rollout_bytes if self.rollout_bytes != param_bytes else None
        staleness = cfg.rollout.max_staleness
        self.ahead_copy = shape.frozen_copy_bytes(param_bytes, generation_autocast) * gb if staleness else 0.0

    def _engine(self) -> None:
        """The engine during generation, and what of it stays awake in the update."""
        cfg, shape, gb, r = self.cfg, self.shape, 1 / GIB, self.cfg.rollout
        world, rollout_bytes = self.world, self.rollout_bytes
        kv_need = kv_need_gb(cfg, shape, world, rollout_bytes)
        self.generation_parts: dict[str, float] = {}
        self.vllm_in_update: str | None = None
        if r.engine == "vllm":
            if r.kv_cache_gb:
                engine = shape.params * rollout_bytes * gb + r.kv_cache_gb
            elif self.on_cuda:
                engine = r.gpu_memory_utilization * self.devices.memory_gb
            else:  # vLLM's CPU build: the KV cache the rollout can fill (cpu_kv_cache_gb)
                engine = shape.params * rollout_bytes * gb + cpu_kv_cache_gb(kv_need)
            self.generation_parts["engine (vLLM)"] = engine
            asleep = r.sleep_level > 0 and self.on_cuda
            self.awake_in_update = 0.0 if asleep else engine
            self.vllm_in_update = f"asleep (level {r.sleep_level})" if asleep else "awake"
            return
        logits = generation_rows(cfg, world) * shape.vocab * 4 * 2 * gb  # a decode step's float32 logits and their softmax
        self.generation_parts["KV cache"] = kv_need
        self.generation_parts["decode logits"] = logits
        if world == 1 and not r.max_staleness and rollout_bytes < self.param_bytes:
            # autocast keeps a cast of each trainable weight for as long as the rollout's autocast lasts
            self.generation_parts["weights cast for autocast"] = (shape.linear + shape.head) * rollout_bytes * gb
        if world > 1 and not r.max_staleness:  # the built-in engine decodes on the gathered policy:
            # FSDP's all-gathered copy (in the compute dtype), beside the shards
            self.generation_parts["gathered policy"] = shape.params * self.compute_bytes * gb
        self.awake_in_update = (kv_need + logits) if r.max_staleness else 0.0

    def _held(self) -> dict[str, float]:
        if self.offloaded:
            return {"policy (offloaded to host)": 0.0, "optimizer state (offloaded)": 0.0}
        return {"policy": self.weights_here, "optimizer state": self.optimizer_here}

    def startup(self) -> Phase:
        shape, gb, param_bytes = self.shape, 1 / GIB, self.param_bytes
        on_cpu = self.devices.kind == "cpu"
        startup = Phase("startup", {"runtime": self.runtime})
        parts = startup.parts
        if self.world > 1:
            # sharded loading: each rank reads its shards' slices of the files (trainer/slices.py),
            # a slice at a time through a buffer when converted or bound for a device
            parts["policy shard (offloaded to host)" if self.offloaded else "policy shard"] = self.weights_here
            largest = max(shape.vocab, shape.intermediate) * shape.hidden * param_bytes * gb
            parts["one slice in transit"] = largest / self.shards
            if self.reference:
                parts["reference shard"] = self.reference
        else:
            # one process loads the whole model, and copies it for the reference. On a CPU, weights
            # stored in their training dtype are mapped from the file, not copied: untouched until
            # used, unless a copy reads them
            mapped = on_cpu and shape.file_bytes == param_bytes and not self.quantized
            if mapped and not (self.reference or self.ahead_copy):
                parts["policy (mapped from its file)"] = 0.0
            else:
                parts["policy"] = shape.params * param_bytes * gb if not self.quantized else self.weights
                if on_cpu and shape.file_bytes != param_bytes and not self.quantized:
                    # the file in another dtype (bf16 weights trained in float32), mapped while converted
                    parts["checkpoint file (mapped while converted)"] = shape.params * shape.file_bytes * gb
            if self.reference:
                parts["reference"] = self.reference
        if self.ahead_copy:
            parts["generation copy"] = self.ahead_copy
        return startup

    def generation(self) -> Phase:
        generation = Phase("generation", {"runtime": self.runtime, **self._held()})
        parts = generation.parts
        if self.parked_optimizer:
            del parts["optimizer state"]
            parts["optimizer state (in host memory)"] = 0.0
        if self.parked_reference:
            parts["reference (in host memory)"] = 0.0
        elif self.reference:
            parts["reference"] = self.reference
        if self.ahead_copy:
            parts["generation copy"] = self.ahead_copy
        parts.update(self.generation_parts)
        return generation

    def micro_batch_tokens(self) -> int:
        """A micro-batch's tokens: a token budget's holds at least one whole row (one over the
        budget goes alone)."""
        a, length = self.cfg.actor, context_length(self.cfg)
        return max(a.micro_batch_tokens, length) if a.micro_batch_tokens else a.micro_batch_size * length

    def _activations(self) -> tuple[float, float]:
        """One micro-batch's activations and the LM head's chunk. Under FSDP the whole weights are
        gathered in the compute dtype (mixed precision), so the residual stream is in it too; in
        one process autocast leaves it in the weights' dtype."""
        cfg, shape, gb, a = self.cfg, self.shape, 1 / GIB, self.cfg.actor
        tokens = self.micro_batch_tokens()
        lean = self.devices.kind == "cpu" and a.lean_mlp and a.lean_norm
        stream_bytes = self.compute_bytes if self.world > 1 else self.param_bytes
        per_token = activation_bytes_per_token(shape, param_bytes=stream_bytes, compute_bytes=self.compute_bytes, lean=lean)
        if cfg.model.gradient_checkpointing:  # each layer's input kept, one layer's activations at a time
            activations = tokens * (shape.layers * shape.hidden * stream_bytes + per_token) * gb
        else:
            activations = tokens * shape.layers * per_token * gb
        chunk = min(a.logits_chunk_size or tokens, tokens)
        head = (chunk * shape.vocab * 4 * 3 + tokens * shape.hidden * stream_bytes * 2) * gb
        return activations, head

    def update(self) -> Phase:
        cfg, shape, gb, a = self.cfg, self.shape, 1 / GIB, self.cfg.actor
        compute_bytes, world = self.compute_bytes, self.world
        update = Phase("update", {"runtime": self.runtime, **self._held()})
        parts = update.parts
        if not self.offloaded:
            parts["gradients"] = self.grads
        if world > 1:  # ZeRO-3 (trainer/lockstep.py): the root's own weights (embeddings, head) and a
            # layer or two whole at a time (the running one, the one fetched ahead), with their
            # gradients before the reduce-scatter, in FSDP's reduce dtype (float32 by default)
            reduce_bytes = 4 if a.fsdp_reduce_dtype == "float32" else compute_bytes
            whole = shape.params - shape.layers * shape.layer + 2 * shape.layer
            parts["root and two layers whole (FSDP)"] = whole * (compute_bytes + reduce_bytes) * gb
        if self.reference and not self.parked_reference:
            parts["reference"] = self.reference
        if self.ahead_copy:
            parts["generation copy"] = self.ahead_copy
        activations, head = self._activations()
        parts["activations"] = activations
        parts["LM head chunk"] = head
        if self.parked_reference:  # on the device for its pass only, before the update's passes begin
            parts["reference (its pass, beyond the update's own)"] = max(0.0, self.reference - activations - head - self.grads)
        if world == 1 and compute_bytes < self.param_bytes:  # autocast's casts of the weights, kept for backward
            parts["weights cast for autocast"] = (shape.linear + shape.head) * compute_bytes * gb
        if world == 1 and a.shared_prefix and cfg.rollout.n_agent > 1 and micro_batches_per_step(cfg, world) > 1:
            # a micro-batch after the first: the decoder's weights serve two passes (the prompts'
            # and the responses'), and autograd holds the responses' weight gradients until the
            # prompts' backward adds theirs, beside the gradients accumulated so far
            whole_grad_bytes = compute_bytes if world > 1 else self.param_bytes  # FSDP accumulates whole grads in the compute dtype
            parts["gradient buffers (prompt pass)"] = min(shape.trainable, shape.layer * shape.layers) * whole_grad_bytes * gb
        if self.awake_in_update:
            parts["engine (awake)"] = self.awake_in_update
        return update

    def resolved(self) -> dict[str, str]:
        """The settings the plan assumed, `auto` resolved."""
        m, param_bytes = self.cfg.model, self.param_bytes
        resolved = {
            "parameters": {4: "float32", 2: m.dtype if param_bytes == 2 else "float32"}[param_bytes],
            "compute": "bfloat16" if self.compute_bytes == 2 and param_bytes == 4 else "parameters'",
            "fsdp_shards": str(self.shards),
            "rollout_dtype": "bfloat16" if self.rollout_bytes == 2 else "float32",
            "engine": self.cfg.rollout.engine,
        }
        if self.vllm_in_update is not None:
            resolved["vllm_in_update"] = self.vllm_in_update
        resolved["gradient_checkpointing"] = str(m.gradient_checkpointing).lower()
        if self.reference:
            resolved["reference"] = "in host memory outside its pass" if self.parked_reference else "on the device"
        if self.parked_optimizer:
            resolved["optimizer state"] = "in host memory outside the update"
        resolved["tokens per micro-batch"] = str(self.micro_batch_tokens())
        return resolved


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
