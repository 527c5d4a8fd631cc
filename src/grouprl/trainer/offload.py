"""Tensors kept in host memory between their uses, so that generation has the device's memory.

- `actor.reference_offload`: the KL reference's weights live in host memory and come to the
  device for its log-prob pass only (once a step). verl's examples do the same for a colocated
  vLLM (`actor_rollout_ref.ref.fsdp_config.param_offload=True`).
- `actor.optimizer_offload`: AdamW's state (twice the trainable weights, float32) lives in host
  memory outside the update (verl's `actor.fsdp_config.optimizer_offload`): generation runs
  without it, the update brings it back for its optimizer steps.

Moves are whole-tensor copies through `move` (blocking: the copy is done when the device's memory
is given back). A module moves with `nn.Module._apply`, the path `module.to` takes, which FSDP2
overrides to re-register its sharded parameters. On a CPU the host is the device: `move` returns
each tensor as it is and nothing is copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

HOST = torch.device("cpu")


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` (itself when it is there already)."""
    return tensor.to(device)


def wanted(setting, device: torch.device) -> bool:
    """actor.reference_offload made concrete: true / false as set; auto on CUDA."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return bool(setting)


class Parked:
    """Something kept in host memory (`out`) except inside `present()`. `where` says which."""

    def __init__(self, device: torch.device, *, enabled: bool):
        self.device, self.enabled = torch.device(device), enabled
        self.where = "device"

    def _to(self, device: torch.device, outward: bool) -> None:
        raise NotImplementedError

    def out(self) -> None:
        """Into host memory (nothing when disabled)."""
        if self.enabled and self.where == "device":
            self._to(HOST, outward=True)
            self.where = "host"

    def back(self) -> None:
        """Onto the device."""
        if self.where == "host":
            self._to(self.device, outward=False)
            self.where = "device"

    @contextlib.contextmanager
    def present(self) -> Iterator[None]:
        """On the device inside, in host memory after (when enabled), on errors too."""
        self.back()
        try:
            yield
        finally:
            self.out()


class ParkedModule(Parked):
    """A frozen module's parameters and buffers."""

    def __init__(self, module: torch.nn.Module | None, device: torch.device, *, enabled: bool):
        super().__init__(device, enabled=enabled and isinstance(module, torch.nn.Module))
        self.module = module

    def _to(self, device: torch.device, outward: bool) -> None:
        with torch.no_grad():
            self.module._apply(lambda t: move(t, device))


class ParkedOptimizer(Parked):
    """An optimizer's state tensors that live on the device (Adam's `step` counter, kept in host
    memory by torch unless fused or capturable, stays where it is)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, *, enabled: bool):
        super().__init__(device, enabled=enabled)
        self.optimizer = optimizer
        self._moved: list[tuple[torch.Tensor, str]] = []  # (param, state key) moved out

    def _to(self, device: torch.device, outward: bool) -> None:
        state = self.optimizer.state
        if outward:
            self._moved = [
                (p, k)
                for group in self.optimizer.param_groups
                for p in group["params"]
                for k, v in state.get(p, {}).items()
                if isinstance(v, torch.Tensor) and v.device == _concrete(self.device, v)
            ]
        for p, k in self._moved:
            state[p][k] = move(state[p][k], device)
        if not outward:
            self._moved = []


def _concrete(device: torch.device, tensor: torch.Tensor) -> torch.device:
    """`device` with the index `tensor`'s device has, when `device` names none (cuda = cuda:0...)."""
    if device.index is None and tensor.device.type == device.type:
        return tensor.device
    return device
