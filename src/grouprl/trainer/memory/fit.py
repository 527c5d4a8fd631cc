"""At a run's start: the plan checked, what would fit when it does not, and the refusal."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from pathlib import Path

from grouprl.config import Config
from grouprl.errors import UserError
from grouprl.trainer.memory.inputs import GIB, Devices, Shape, devices_for, model_shape
from grouprl.trainer.memory.plan import Plan, _compute_bytes, context_length, settle_for_devices
from grouprl.trainer.memory.plan import plan_memory as _plan_memory

log = logging.getLogger(__name__)


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


def what_would_fit(
    cfg: Config, shape: Shape, devices: Devices, limit: int = 4, longest_prompt: int | None = None
) -> list[str]:
    """Settings that make the plan fit: each single change that does, else the changes taken
    together in the order tried (the first that fits with those before it)."""
    cfg = settle_for_devices(cfg, shape, devices)  # `auto` settings as the devices make them
    plan_memory = functools.partial(_plan_memory, longest_prompt=longest_prompt)
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
def refusal(plan: Plan, cfg: Config, shape: Shape, longest_prompt: int | None = None) -> str:
    """One line: the phase that does not fit, its figure, the device's, and what would fit."""
    worst = plan.worst
    biggest = sorted(worst.parts.items(), key=lambda kv: -kv[1])[:3]
    fixes = what_would_fit(cfg, shape, plan.devices, longest_prompt=longest_prompt)
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


def current_rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / GIB


def plan_run(
    cfg: Config, config, run_dir: Path, *, write: bool, longest_prompt: int | None = None
) -> tuple[Config, Plan | None]:
    """At a run's start, before the model loads: the settings settled for the devices, and their
    plan (from the data's longest prompt, images counted), written to <run>/memory_plan.json
    (`write`: this rank writes); a plan that does not fit stops the run with one line
    (trainer.memory_check=refuse) or warns (warn)."""
    check = cfg.trainer.memory_check
    shape = model_shape(cfg.model, config)
    devices = devices_for(cfg)
    cfg = settle_for_devices(cfg, shape, devices)
    if check == "off":
        return cfg, None
    runtime = current_rss_gb() if devices.kind == "cpu" and not devices.named else None
    plan = _plan_memory(cfg, shape, devices, runtime_gb=runtime, longest_prompt=longest_prompt)
    if write:
        plan.write(run_dir)
    if not plan.checked:
        log.warning("memory plan: %s of unknown memory: set trainer.gpu_memory_gb to check the fit", devices.describe())
    elif not plan.fits:
        line = refusal(plan, cfg, shape, longest_prompt)
        if check == "refuse":
            raise UserError(line)
        log.warning(line)
    warning = lr_resolution_warning(cfg)
    if warning:
        log.warning(warning)
    return cfg, plan
