"""Rollout engines behind one interface (`base.RolloutEngine`): `hf`, the built-in decode loop
over the trainer's own transformers model, and `vllm`, vLLM in-process with its own copy of the
weights (pushed after every update). `process.EngineProcess` runs either in a process of its
own, fed the weights over torch.distributed (asynchronous training's rollout.engine_process).
The agent loop and the trainer talk to the interface only."""

import torch

from grouprl.rollout.engines.base import (
    Generation,
    ReprefillSession,
    RolloutEngine,
    SamplingParams,
    Session,
    rollout_phase,
)

__all__ = [
    "Generation",
    "ReprefillSession",
    "RolloutEngine",
    "SamplingParams",
    "Session",
    "build_engine",
    "resolve_engine",
    "rollout_phase",
]


def resolve_engine(name: str, device_type: str, *, quantized: bool = False, assume_installed: bool = False) -> str:
    """rollout.engine made concrete: `auto` is vLLM on CUDA where it is installed (or, planning
    for another machine, assumed there) and the policy is not bitsandbytes-quantised, else the
    built-in engine; a named engine stays."""
    if name != "auto":
        return name
    if device_type != "cuda" or quantized:
        return "hf"
    import importlib.util

    return "vllm" if assume_installed or importlib.util.find_spec("vllm") is not None else "hf"


def build_engine(
    cfg,
    model,
    tokenizer,
    *,
    model_path: str = "",
    seed: int = 0,
    dtype=None,
    vision=None,
    report_log_probs=None,
    sharded=None,
    device=None,
) -> RolloutEngine:
    """The engine `cfg.engine` names (cfg: the rollout config; None: the built-in engine with its
    defaults, for greedy answers outside a run's rollout) over the policy `model`, loaded
    from `model_path`; `dtype` is the generation precision (None: the parameters'); `vision`
    the VLM family of a policy that reads images; `report_log_probs`: the built-in engine records
    each sampled token's log-prob (None: as cfg.check_log_probs says; vLLM always does);
    `sharded`: the FSDP2 root over `model` on several ranks (vLLM gathers its pushes layer by
    layer from it; the built-in engine generates inside the trainer's `gathered`); `device`: the
    trainer's (None: the parameters')."""
    where = torch.device(device) if device is not None else next(model.parameters()).device
    engine = "hf" if cfg is None else resolve_engine(cfg.engine, where.type)
    if engine == "hf":
        from grouprl.rollout.engines.hf import HFEngine

        if cfg is None:
            return HFEngine(model, tokenizer, vision=vision, report_log_probs=bool(report_log_probs))
        return HFEngine(
            model,
            tokenizer,
            share_prompt_prefill=cfg.share_prompt_prefill,
            max_batch=cfg.gen_batch_size,
            vision=vision,
            report_log_probs=cfg.check_log_probs if report_log_probs is None else report_log_probs,
        )
    if engine == "vllm":
        from grouprl.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(
            model,
            tokenizer,
            model_path,
            cfg,
            seed=seed,
            dtype=dtype or next(model.parameters()).dtype,
            max_model_len=cfg.max_model_len or None,
            vision=vision,
            sharded=sharded,
            device=device,
        )
    raise ValueError(f"unknown rollout engine {engine!r}")  # config validation names the choices
