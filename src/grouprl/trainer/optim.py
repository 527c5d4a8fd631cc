"""AdamW with linear warm-up and a constant, cosine or linear schedule."""

from __future__ import annotations

import math

import torch

from grouprl.config import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch's AdamW, fused (one vectorised pass per tensor instead of ~10 elementwise ops) where
    every parameter is a floating-point tensor on CPU or CUDA."""
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    fused = bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused
    )


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak lr after `step` optimizer steps out of `total`."""
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.scheduler == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if cfg.scheduler == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(optimizer, cfg: OptimConfig, total_optimizer_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_optimizer_steps, cfg))
