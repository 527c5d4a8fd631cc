"""The plan: each phase's parts on one device, for settings settled for the devices."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from grouprl.config import Config
from grouprl.trainer.memory.inputs import (
    AUTO_MICRO_BATCH_TOKENS,
    CPU_RUNTIME_GB,
    CUDA_RUNTIME_GB,
    FRAGMENTATION,
    GIB,
    VLLM_ASLEEP_EAGER_GB,
    VLLM_ASLEEP_GB,
    Devices,
    Shape,
)
from grouprl.trainer.memory.update import MicroBatch, PassSettings, activation_parts, micro_batch


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
    vllm_share: float | None = None  # the most of the device vLLM may take beside the trainer (CUDA)
    gpu_share: float = 0.0  # rollout.gpu_memory_utilization as planned

    @property
    def budget_gb(self) -> float:
        """What one rank may use: the device as it reports its memory, or on a CPU its share of
        the host."""
        d = self.devices
        return d.memory_gb / max(d.per_node, 1) if d.kind == "cpu" else d.memory_gb

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    @property
    def worst(self) -> Phase:
        return max(self.phases, key=lambda p: p.peak)

    @property
    def checked(self) -> bool:
        """Whether the devices' memory is known, so that the fit could be checked."""
        return self.devices.known

    @property
    def fits(self) -> bool:
        """The worst phase within the budget (True where the memory is unknown: not checked)."""
        return not self.checked or self.worst.peak <= self.budget_gb

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
        if not self.checked:
            verdict = "set trainer.gpu_memory_gb to check the fit"
        elif self.fits:
            verdict = f"fits, {self.budget_gb - self.worst.peak:.1f} GiB to spare ({self.worst.name})"
        else:
            verdict = f"DOES NOT FIT ({self.worst.name}: {self.worst.peak:.1f} GiB)"
        lines.append(f"devices: {self.devices.describe()}{share}: {verdict}")
        if not self.checked and "engine (vLLM)" in self.phase("generation").parts:
            lines.append(
                f"generation: vLLM takes rollout.gpu_memory_utilization={self.gpu_share:.2f} of each device beside the "
                f"trainer's {self.resident_in_generation:.1f} GiB"
            )
        if self.vllm_share is not None:
            lines.append(
                f"generation: the trainer keeps {self.resident_in_generation:.1f} GiB resident beside vLLM, which "
                f"may take up to rollout.gpu_memory_utilization={self.vllm_share:.2f} of the device"
            )
        lines.append("assumed: " + ", ".join(f"{k}={v}" for k, v in self.resolved.items()))
        return lines

    @property
    def resident_in_generation(self) -> float:
        """What the trainer keeps on the device while generating: the generation phase without vLLM."""
        parts = self.phase("generation").parts
        return sum(v for k, v in parts.items() if k != "engine (vLLM)")

    def to_json(self) -> dict:
        return {
            "devices": asdict(self.devices),
            "budget_gb": round(self.budget_gb, 3),
            "fits": self.fits,
            "checked": self.checked,
            "resolved": self.resolved,
            "vllm_share": self.vllm_share,
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
    token after it (an agent's turns: an observation is bounded in tokens with its images,
    `agent.max_observation_tokens`), capped by rollout.max_model_len when set."""
    r, a = cfg.rollout, cfg.agent
    if a.enabled:
        # every turn's response and observation (image tokens and turn markers included), and
        # the frozen generator's answer appended after <search_complete> (its text and a newline)
        turns = a.max_turns * r.max_response_length + (a.max_turns - 1) * a.max_observation_tokens
        answer = a.answer_max_tokens + 1 if a.answer_generator != "none" else 0
        # a trajectory stops taking observations at max_response_tokens; its turn then runs on
        response = min(a.max_response_tokens - 1 + r.max_response_length, turns) if a.max_response_tokens else turns
        total = cfg.data.max_prompt_length + response + answer
    else:
        total = cfg.data.max_prompt_length + r.max_response_length
    return min(total, r.max_model_len) if r.max_model_len else total


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


def plan_memory(
    cfg: Config, shape: Shape, devices: Devices, runtime_gb: float | None = None, longest_prompt: int | None = None
) -> Plan:
    """Each phase's parts on one device (see the module docstring). `runtime_gb`: what the
    process holds besides the model (default: an estimate per device kind); `longest_prompt`:
    the data's longest prompt in tokens, images counted (None: data not read, the limit)."""
    cfg = settle_for_devices(cfg, shape, devices)  # `auto` settings as the devices make them
    sizes = _Sizes(cfg, shape, devices, runtime_gb, longest_prompt)
    phases = [with_margin(phase, devices) for phase in (sizes.startup(), sizes.generation(), sizes.update())]
    plan = Plan(devices, phases, sizes.resolved(), gpu_share=cfg.rollout.gpu_memory_utilization)
    if cfg.rollout.engine == "vllm" and devices.kind == "cuda" and devices.known and not cfg.rollout.kv_cache_gb:
        free = (plan.budget_gb - plan.resident_in_generation) / devices.memory_gb
        plan.vllm_share = max(0.0, math.floor(free * 100) / 100)
    return plan


def with_margin(phase: Phase, devices: Devices) -> Phase:
    """On CUDA, the caching allocator's fragmentation: FRAGMENTATION of what PyTorch allocates in
    the phase (vLLM's share has its own allocator; the runtime is outside it)."""
    if devices.kind != "cuda":
        return phase
    allocated = sum(v for k, v in phase.parts.items() if k not in ("runtime", "engine (vLLM)"))
    phase.parts[f"allocator margin ({FRAGMENTATION:.0%}, fragmentation)"] = FRAGMENTATION * allocated
    return phase


class _Sizes:
    """The figures (GiB per device) the phases are made of, for settled settings."""

    def __init__(self, cfg: Config, shape: Shape, devices: Devices, runtime_gb: float | None, longest_prompt: int | None):
        self.cfg, self.shape, self.devices = cfg, shape, devices
        self.longest_prompt = longest_prompt
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
        self.asleep_in_update = 0.0
        if r.engine == "vllm":
            if r.kv_cache_gb:
                engine = shape.params * rollout_bytes * gb + r.kv_cache_gb
            elif self.on_cuda and self.devices.known:
                engine = r.gpu_memory_utilization * self.devices.memory_gb
            elif self.on_cuda:  # the device's memory unknown: its share of it is unknown too (see Plan.table)
                engine = 0.0
            else:  # vLLM's CPU build: the KV cache the rollout can fill (cpu_kv_cache_gb)
                engine = shape.params * rollout_bytes * gb + cpu_kv_cache_gb(kv_need)
            self.generation_parts["engine (vLLM)"] = engine
            asleep = r.sleep_level > 0 and self.on_cuda
            self.awake_in_update = 0.0 if asleep else engine
            # asleep, vLLM still holds its CUDA graphs' memory pool and buffers of its own
            self.asleep_in_update = (VLLM_ASLEEP_EAGER_GB if r.enforce_eager else VLLM_ASLEEP_GB) if asleep else 0.0
            self.vllm_in_update = f"asleep (level {r.sleep_level})" if asleep else "awake"
            return
        logits = generation_rows(cfg, world) * shape.vocab * 4 * 2 * gb  # a decode step's float32 logits and their softmax
        self.generation_parts["KV cache"] = kv_need
        self.generation_parts["decode logits"] = logits
        if world == 1 and not r.max_staleness and rollout_bytes < self.param_bytes:
            # autocast keeps a cast of each trainable weight for as long as the rollout's autocast lasts
            # (the LM head's weight among them, tied to the embeddings or not)
            self.generation_parts["weights cast for autocast"] = (shape.linear + shape.vocab * shape.hidden) * rollout_bytes * gb
        if world > 1 and not r.max_staleness:  # the built-in engine decodes on the gathered policy:
            # FSDP's all-gathered copy (in the compute dtype), beside the shards, and the buffer a
            # module's all-gather lands in before it is copied out (the largest: the root's)
            self.generation_parts["gathered policy"] = shape.params * self.compute_bytes * gb
            self.generation_parts["all-gather buffer"] = max(shape.root, shape.layer) * self.compute_bytes * gb
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
            # each rank reads only its shards' slices of the checkpoint (slices.py), straight to
            # where they live, a tensor at a time, through a buffer of the slice where it lives on
            # the device or in another dtype (on a CPU in the file's dtype the read lands in the
            # shard itself: the slice is then a margin). FSDP's root is set up without gathering
            # its weights (parallel.init_root): nothing is whole
            parts["policy shard (offloaded to host)" if self.offloaded else "policy shard"] = self.weights_here
            largest = max(shape.vocab, shape.intermediate) * shape.hidden * param_bytes * gb
            parts["one tensor's slice in flight"] = largest / self.shards
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

    def micro_batch(self) -> MicroBatch:
        return micro_batch(self.cfg, self.world, context_length(self.cfg), self.longest_prompt)

    def _pass_settings(self) -> PassSettings:
        """How the update's passes compute: under FSDP the weights are gathered in the compute
        dtype (mixed precision), so the residual stream is in it too; in one process autocast
        leaves it in the weights' dtype. A CPU's lean layers and attention patch the MLP, norm
        and attention modules, inside the layers FSDP wraps as in one process (cpu.lean_update)."""
        a = self.cfg.actor
        lean = self.devices.kind == "cpu"
        return PassSettings(
            stream=self.compute_bytes if self.world > 1 else self.param_bytes,
            compute=self.compute_bytes,
            checkpointing=bool(self.cfg.model.gradient_checkpointing),
            lean_layers=lean and a.lean_mlp and a.lean_norm,
            lean_attention=lean and a.lean_attention,
            logits_chunk=a.logits_chunk_size,
        )

    def _sharded_parts(self) -> dict[str, float]:
        """ZeRO-3 (several ranks): the gradients reduce-scattered into shards each micro-batch
        (or whole between reductions, actor.fsdp_reduce_every), the layers FSDP gathers one at a
        time (in backward the running one and its gradient with the reduce-scatter's buffer), the
        root's own weights (embeddings, head, norms) whole through the pass, and the LM head's
        gradient whole from its backward on."""
        a, shape, gb, c = self.cfg.actor, self.shape, 1 / GIB, self.compute_bytes
        reduce_bytes = 4 if a.fsdp_reduce_dtype == "float32" else c
        parts = {"gradient shard": 0.0 if self.offloaded else self.grads}
        if getattr(a, "fsdp_reduce_every", 1) != 1:
            parts["gradients whole (between reductions)"] = shape.trainable * reduce_bytes * gb
        # the layer whose backward runs, whole, and its gradient with the reduce-scatter's buffer
        # (in forward: it and the layer prefetched, less)
        parts["decoder layers gathered (FSDP)"] = shape.layer * (2 * c + reduce_bytes) * gb
        parts["root weights whole (FSDP)"] = shape.root * c * gb
        if self._lm_trains():
            parts["LM head gradient whole"] = shape.vocab * shape.hidden * c * gb
        return parts

    def _lm_trains(self) -> bool:
        """Whether the language model's own weights train (not LoRA's adapters, not frozen)."""
        return self.cfg.model.lora.rank == 0 and not self.cfg.model.freeze_language_model

    def _resident_in_update(self) -> dict[str, float]:
        """What the update holds besides its passes' activations."""
        shape, gb, c = self.shape, 1 / GIB, self.compute_bytes
        parts = {"runtime": self.runtime, **self._held()}
        if self.world > 1:
            parts.update(self._sharded_parts())
        elif not self.offloaded:
            parts["gradients"] = self.grads
        if self.reference and not self.parked_reference:
            parts["reference"] = self.reference
        if self.ahead_copy:
            parts["generation copy"] = self.ahead_copy
        if self.world == 1 and c < self.param_bytes:  # autocast's casts of the weights, kept for backward
            parts["weights cast for autocast"] = (shape.linear + shape.vocab * shape.hidden) * c * gb
        if self.awake_in_update:
            parts["engine (awake)"] = self.awake_in_update
        if self.asleep_in_update:
            parts["vLLM asleep (CUDA graphs, buffers)"] = self.asleep_in_update
        return parts

    def update(self) -> Phase:
        """The larger of two moments of a pass: its backward's start (every activation held, the
        top layer's backward running), and, with the shared prefix, the end of the responses'
        backward, where the decoder's weight gradients of the responses' pass wait in autograd's
        buffers for the prompts' pass to add its own (one process, from the second micro-batch
        on, beside the gradients accumulated so far) next to the prompts' activations. Under
        ZeRO-3 a micro-batch's prompts run as their own pass before its responses', their
        gradients reduced by their own backward: nothing waits."""
        cfg, shape, gb = self.cfg, self.shape, 1 / GIB
        mb, settings = self.micro_batch(), self._pass_settings()
        resident = self._resident_in_update()
        phases = [Phase("update", {**resident, **activation_parts(shape, mb, settings)})]
        waits = mb.shared and self.world == 1 and micro_batches_per_step(cfg, self.world, mb) > 1
        if waits:
            prompts_only = replace(mb, rows=0, bins=0, width=0)
            boundary = {**resident, **activation_parts(shape, prompts_only, settings, heads=False)}
            # the decoder's, in the compute dtype (autocast's cached cast of a weight, or FSDP's
            # gathered bf16 weight, is what both passes use), and the input embeddings' in the
            # residual stream's (a dense [vocab, hidden] gradient from each pass; in one process
            # the second is summed into the first in a copy, beside the accumulated .grad)
            embeddings = shape.vocab * shape.hidden if self._lm_trains() else 0
            decoder = min(shape.trainable - embeddings, shape.layer * shape.layers)
            waiting = decoder * self.compute_bytes + 2 * embeddings * settings.stream
            boundary["gradients waiting for the prompts' pass"] = waiting * gb
            phases.append(Phase("update", boundary))
        if self.parked_reference:  # on the device for its pass only, before the update's passes begin
            for phase in phases:
                passes = sum(v for k, v in phase.parts.items() if k not in resident)
                phase.parts["reference (its pass, beyond the update's own)"] = max(0.0, self.reference - passes)
        self.update_peak_at = "the backward's start" if phases[0].peak >= phases[-1].peak else "the prompts' backward"
        return max(phases, key=lambda p: p.peak)

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
        mb = self.micro_batch()
        prompt = f"{mb.prompt_len} (the data's longest)" if self.longest_prompt else f"{mb.prompt_len} (the limit)"
        resolved["micro-batch"] = (
            f"{mb.rows} rows of {mb.response_len} response tokens on {mb.prompts} prompt(s) of {prompt}: {mb.tokens} tokens"
        )
        resolved["update peak at"] = self.update_peak_at
        return resolved


def micro_batches_per_step(cfg: Config, world: int, mb: MicroBatch | None = None) -> int:
    """Micro-batches one rank accumulates before an optimizer step (the most, at full lengths)."""
    a = cfg.actor
    rows = max(1, -(-(a.mini_batch_size or cfg.data.train_batch_size) // max(world, 1))) * cfg.rollout.n_agent
    mb = mb or micro_batch(cfg, world, context_length(cfg))
    return -(-rows // max(mb.rows, 1))


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
    """Settings that depend on the devices, made concrete: vLLM's longest sequence is the run's
    context length (within the model's positions), and vLLM's CPU build takes its share of
    "GPU" memory from the host, where every rank's engine would take it (two ranks at 0.5 take
    all of it), so on a CPU its KV cache is what one rollout can fill (cpu_kv_cache_gb)."""
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
    if r.engine == "vllm" and not r.max_model_len:  # the run's longest sequence, at most the model's
        longest = min(context_length(cfg), shape.positions) if shape.positions else context_length(cfg)
        r = replace(r, max_model_len=longest)
        cfg = replace(cfg, rollout=r)
    if r.engine == "vllm" and devices.kind == "cpu" and not r.kv_cache_gb:
        bf16 = r.dtype == "bfloat16" or (r.dtype == "auto" and _compute_bytes(cfg, devices) == 2)
        need = kv_need_gb(cfg, shape, devices.world, 2 if bf16 else 4)
        cfg = replace(cfg, rollout=replace(r, kv_cache_gb=round(cpu_kv_cache_gb(need), 3)))
    return cfg
