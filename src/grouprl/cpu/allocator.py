"""Give freed activation memory back to the OS during the update (Linux, glibc).

A CPU tensor's memory comes from malloc. glibc serves blocks below an adaptive threshold (it
rises to 32 MiB once such a block is freed) from its heap, growing the heap when no free chunk
fits, and a heap keeps freed memory resident for reuse. The blocks the next micro-batch asks for
do not fit the holes the last one left, so the heap grows past the live tensors: in a default
run the peak RSS, reached in backward, was about 0.5 GiB above what malloc had handed out.

Two remedies, both doing nothing where the C library is not glibc:
- `release_free_memory()`, before each backward (`actor.update_malloc_trim`, on by default):
  `malloc_trim(0)` hands the pages of the heap's free chunks back. The heap keeps its layout,
  so a reused hole is faulted in again. About 0.01-0.05 s a call here.
- `trim_during_backward(model, every)`: the same call when backward reaches every `every`-th
  decoder layer (`actor.update_trim_every_layers`). Backward frees a layer's activations and
  allocates its gradients' temporaries in other sizes, so without it the holes backward leaves
  stay resident until the next micro-batch; in a default run the peak fell by 0.3 GiB.
- `trim_during_forward(model, every)`: the same after every `every`-th decoder layer's forward,
  for layers whose weights FSDP gathers into buffers of their own and frees after them (several
  ranks): in a 2-rank run of a 30-layer model the forward's heap held 1.5 GiB of such holes.
- `mapped_large_blocks(threshold)` around the update (`actor.update_mmap_threshold_kb`, off by
  default): a block of `threshold` bytes or more that the heap's free chunks cannot serve is
  mmapped instead of growing the heap, and unmapped when freed. The lowest peak, but each such
  block is faulted in fresh. Leaving the block sets the threshold to glibc's ceiling (32 MiB),
  where the adaptive threshold settles after the first large free anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math

import torch

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
GLIBC_CEILING = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


@functools.cache
def _glibc():
    """The C library when it is glibc, else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


def _mallopt():
    libc = _glibc()
    return libc.mallopt if libc is not None else None


def release_free_memory() -> bool:
    """Give the pages of malloc's free chunks back to the OS (glibc's `malloc_trim(0)`); False
    where that is not available."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@contextlib.contextmanager
def mapped_large_blocks(threshold: int):
    """Within the block, malloc serves blocks of `threshold` bytes and more by mmap (0: leave
    malloc as it is). Yields whether the setting took effect."""
    mallopt = _mallopt() if threshold > 0 else None
    ok = bool(mallopt and mallopt(M_MMAP_THRESHOLD, int(threshold)))
    try:
        yield ok
    finally:
        if ok:
            mallopt(M_MMAP_THRESHOLD, GLIBC_CEILING)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes its `_no_split_modules` names
    (transformers' decoder layers), found through wrappers such as peft's and FSDP's."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    # FSDP2 gives a sharded layer a class of its own that derives from the layer's
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


@contextlib.contextmanager
def trim_during_backward(model: torch.nn.Module, every: int):
    """Within the block, backward calls `release_free_memory()` when it reaches the output of
    every `every`-th decoder layer (0, or no glibc: nothing). Yields the number of layers hooked."""
    layers = decoder_layers(model)[every - 1 :: every] if every > 0 and _glibc() is not None else []

    def on_output(_grad):
        release_free_memory()

    def after_forward(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(on_output)

    handles = [layer.register_forward_hook(after_forward) for layer in layers]
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def trim_during_forward(model: torch.nn.Module, every: int):
    """Within the block, a forward calls `release_free_memory()` after every `every`-th decoder
    layer (0, or no glibc: nothing): where FSDP gathers each layer's weights into a buffer of its
    own and frees it after the layer, the heap keeps those buffers' holes through the forward.
    Yields the number of layers hooked."""
    layers = decoder_layers(model)[every - 1 :: every] if every > 0 and _glibc() is not None else []

    def after_forward(_module, _args, _output) -> None:  # returns nothing: the output stays
        release_free_memory()

    handles = [layer.register_forward_hook(after_forward) for layer in layers]
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()


def _mapped_empty(size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty whose block, where the heap's free chunks cannot serve it, is mmapped (and
    unmapped when freed) rather than grown into the heap."""
    mallopt = _mallopt()
    nbytes = math.prod(int(s) for s in size) * torch.empty((), dtype=dtype).element_size()
    ok = bool(mallopt and 0 < nbytes < GLIBC_CEILING and mallopt(M_MMAP_THRESHOLD, nbytes))
    try:
        return torch.empty(*size, dtype=dtype, device=device)
    finally:
        if ok:
            mallopt(M_MMAP_THRESHOLD, GLIBC_CEILING)


@contextlib.contextmanager
def mapped_collective_buffers(model: torch.nn.Module):
    """Within the block, the flat buffers FSDP2 allocates for each layer's all-gather and
    reduce-scatter (a layer's weights or gradients, world x shard) are mmapped and unmapped when
    freed: below glibc's 32 MiB ceiling they would come from the heap, whose freed chunks stay
    resident between the activations (tens of MB a layer, every layer of every pass). Does
    nothing without glibc or where the model has no FSDP module. Yields the modules set."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:  # a torch without FSDP2's custom collectives
        yield 0
        return

    class Mapped:  # a host buffer mapped; elsewhere the collective's own allocation
        def allocate(self, size, *, dtype, device):
            if device.type == "cpu":
                return _mapped_empty(size, dtype=dtype, device=device)
            return super().allocate(size, dtype=dtype, device=device)

    class MappedAllGather(Mapped, DefaultAllGather):
        pass

    class MappedReduceScatter(Mapped, DefaultReduceScatter):
        pass

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if _glibc() is not None else []
    done = []
    try:
        for module in modules:
            try:
                module.set_custom_all_gather(MappedAllGather())
                module.set_custom_reduce_scatter(MappedReduceScatter())
            except (ValueError, AssertionError):  # several parameter groups, or no FSDP state: left alone
                continue
            done.append(module)
        yield len(done)
    finally:
        for module in done:
            module.set_custom_all_gather(DefaultAllGather())
            module.set_custom_reduce_scatter(DefaultReduceScatter())
