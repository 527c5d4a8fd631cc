"""The memory plan: what each device holds at its peak in each phase of a run, worked out from
the model's config.json and the run's settings alone (the model is built on the meta device to
count its parameters; no weight is read), before anything loads.

Phases, per rank (every rank holds the same, so one is planned):
- start-up: what loading materialises before the engine starts: one process loads the whole
  model; on several ranks each rank reads only its shards' slices of the checkpoint;
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

from grouprl.trainer.memory.fit import (
    current_rss_gb,
    lr_resolution_warning,
    plan_run,
    refusal,
    what_would_fit,
)
from grouprl.trainer.memory.inputs import (
    AUTO_MICRO_BATCH_TOKENS,
    CPU_RUNTIME_GB,
    CUDA_RUNTIME_GB,
    GIB,
    PHASES,
    Devices,
    Shape,
    devices_for,
    host_memory_gb,
    model_shape,
)
from grouprl.trainer.memory.peaks import PeakMeter
from grouprl.trainer.memory.plan import (
    Phase,
    Plan,
    context_length,
    cpu_kv_cache_gb,
    generation_rows,
    kv_need_gb,
    micro_batches_per_step,
    plan_memory,
    settle_for_devices,
)
from grouprl.trainer.memory.update import MicroBatch, activation_bytes_per_token, longest, micro_batch

__all__ = [
    "AUTO_MICRO_BATCH_TOKENS", "CPU_RUNTIME_GB", "CUDA_RUNTIME_GB", "GIB", "PHASES", "Devices", "MicroBatch", "PeakMeter",
    "Phase", "Plan", "Shape", "activation_bytes_per_token", "context_length", "cpu_kv_cache_gb", "current_rss_gb",
    "devices_for", "generation_rows", "host_memory_gb", "kv_need_gb", "longest", "lr_resolution_warning",
    "micro_batch", "micro_batches_per_step", "model_shape", "plan_memory", "plan_run", "refusal", "settle_for_devices",
    "what_would_fit",
]  # fmt: skip
