"""Swapping a module's forward for the duration of a `with` block (decode-time products, lean MLPs)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable

import torch


def on_cpu(model: torch.nn.Module) -> bool:
    """Whether the model's (first) parameters live on the CPU."""
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu"


@contextlib.contextmanager
def forward_replaced(model: torch.nn.Module, forward: Callable, take: Callable[[torch.nn.Module], bool]):
    """Within the block, every module of `model` for which `take(module)` holds runs
    `forward(module, *args)` instead of its own; a module whose instance already has a forward of
    its own (an outer block, a test's patch) is left as it is. Yields the number of modules
    swapped; all are restored on leaving, also on an exception."""
    patched = [m for m in model.modules() if "forward" not in m.__dict__ and take(m)]
    for module in patched:
        module.forward = forward.__get__(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward


@functools.cache
def forward_source(cls: type) -> str:
    """The source of `cls.forward` without any whitespace ("" when it cannot be read): patches
    recognise the modules they replace by the exact computation, not by class name."""
    try:
        return "".join(inspect.getsource(cls.forward).split())
    except (OSError, TypeError):
        return ""
