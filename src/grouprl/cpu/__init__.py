"""CPU-only memory and speed devices, behind one switch per phase.

On a CPU the update's peak memory is the process's resident set, which malloc's heap inflates,
and a decode step multiplies a few rows by every weight matrix, which some BLAS builds take
slowly. The devices here answer those two costs; none changes a number (each is tested against
the plain computation), and on any other device every switch is a no-op, so the training loop
reads the same on a GPU:

- `lean_update(model, actor_cfg)` around an update: gated MLPs and RMSNorms keep fewer tensors
  for backward (lean_mlp.py, lean_norm.py), grouped-query attention runs on unrepeated keys and
  values (lean_attention.py), and freed activation memory goes back to the OS (allocator.py).
  It yields `before_backward`, to call before each backward.
- `lean_scoring(model, actor_cfg)` around a no-grad scoring pass (old / reference log-probs).
- `fast_decode(model)` around a decode loop: few-row products in the fastest of a few equal forms,
  timed per shape (small_matmul.py), and the attention mask in SDPA's float form once per forward
  pass instead of once per layer (lean_attention.py).

Each device has its own switch in the actor config (`actor.lean_mlp`, `lean_norm`,
`lean_attention`, `update_malloc_trim`, `update_trim_every_layers`, `update_mmap_threshold_kb`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from grouprl.cpu.allocator import (
    mapped_collective_buffers,
    mapped_large_blocks,
    release_free_memory,
    trim_during_backward,
    trim_during_forward,
)
from grouprl.cpu.lean_attention import attention_named, decode_attention, lean_attention
from grouprl.cpu.lean_mlp import lean_mlp
from grouprl.cpu.lean_norm import lean_norm
from grouprl.cpu.module_patch import on_cpu
from grouprl.cpu.small_matmul import small_batch_linear

__all__ = ["attention_named", "fast_decode", "lean_scoring", "lean_update", "on_cpu"]


def _sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP gathers the model's layers (several ranks): each gathered layer's buffers are
    freed after it, holes the heap keeps through the forward unless trimmed."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _nothing() -> None:
    return None


@contextlib.contextmanager
def lean_update(model: torch.nn.Module, cfg: Any) -> Iterator[Callable[[], None]]:
    """Within the block, the update of a CPU model keeps fewer activations and hands freed memory
    back (see the module docstring). Yields the call to make before each backward (a no-op off
    the CPU or with `update_malloc_trim` off). `cfg` is the actor config."""
    if not on_cpu(model):
        yield _nothing
        return
    trim_every = cfg.update_trim_every_layers if cfg.update_malloc_trim else 0
    with (
        lean_mlp(model, enabled=cfg.lean_mlp),
        lean_norm(model, enabled=cfg.lean_norm),
        lean_attention(model, enabled=cfg.lean_attention),
        mapped_large_blocks(cfg.update_mmap_threshold_kb << 10),
        trim_during_forward(model, trim_every if _sharded(model) else 0),
        trim_during_backward(model, trim_every),
        mapped_collective_buffers(model) if cfg.update_malloc_trim else contextlib.nullcontext(),
    ):
        yield release_free_memory if cfg.update_malloc_trim else _nothing


def lean_scoring(model: torch.nn.Module, cfg: Any) -> contextlib.AbstractContextManager:
    """Within the block, a CPU model's no-grad scoring attends on unrepeated keys/values."""
    return lean_attention(model, enabled=cfg.lean_attention and on_cpu(model))


@contextlib.contextmanager
def fast_decode(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, a CPU model's plain linear layers take few-row products in their fastest
    form (timed per shape on the first calls) and its attention gets its mask converted once a
    forward pass; elsewhere nothing changes."""
    with small_batch_linear(model), decode_attention(model):
        yield
