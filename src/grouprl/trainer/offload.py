"""Tensors kept in host memory between their uses, so that generation has the device's memory.

- `actor.reference_offload`: the KL reference's weights live in host memory and come to the
  device for its log-prob pass only (once a step). verl's examples do the same for a colocated
  vLLM (`actor_rollout_ref.ref.fsdp_config.param_offload=True`).
- `actor.optimizer_offload`: AdamW's state (twice the trainable weights, float32) lives in host
  memory outside the update (verl's `actor.fsdp_config.optimizer_offload`): generation runs
  without it, the update brings it back for its optimizer steps.

A tensor is parked by its storage: its bytes are copied into a pinned host buffer (made once, the
first time, and reused at every step) without blocking, and its device storage is resized to
nothing; coming back, the storage is resized and the bytes copied in, again without blocking.
The tensors themselves never change, so whatever holds them (FSDP's sharded parameters and their
padded storage, the optimizer's state dict) sees the same objects, and the copies are ordered
with the work around them on the device's stream. Under FSDP's own offload (`actor.fsdp_offload`)
the shards and the optimizer's state live in host memory already: the setup turns parking off
(`parks_beside`). On a CPU the host is the device: nothing moves (`parks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def wanted(setting, device: torch.device) -> bool:
    """actor.reference_offload made concrete: true / false as set; auto on CUDA."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return bool(setting)


def parks(device: torch.device) -> bool:
    """Whether tensors on `device` have anywhere else to go (not on a CPU, whose host is it)."""
    return torch.device(device).type != "cpu"


def parks_beside(fsdp_offload: bool, distributed: bool, device: torch.device) -> bool:
    """Whether parking has anything to do beside FSDP: not when FSDP's own offload keeps the
    shards and the optimizer's state in host memory (several ranks on GPUs, actor.fsdp_offload)."""
    return not (fsdp_offload and distributed and torch.device(device).type == "cuda")


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Parked:
    """Something kept in host memory (`out`) except inside `present()`. `where` says which."""

    def __init__(self, device: torch.device, *, enabled: bool):
        self.device, self.enabled = torch.device(device), enabled
        self.where = "device"
        self._host: dict = {}  # key -> the pinned host buffer of its storage, made once
        self._parked: list[tuple[torch.UntypedStorage, object]] = []

    def _tensors(self) -> Iterator[tuple[object, torch.Tensor]]:
        """(a stable key, tensor) of what parks."""
        raise NotImplementedError

    def out(self) -> None:
        """Into host memory (nothing when disabled)."""
        if not (self.enabled and self.where == "device" and parks(self.device)):
            return
        seen: set[int] = set()
        for key, tensor in self._tensors():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            storage = local.untyped_storage()
            if local.device.type != self.device.type or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue  # elsewhere already (Adam's step counter), empty, or one storage under two names
            if not storage.resizable():  # a file's mapped bytes (host memory: nowhere to go)
                continue
            seen.add(storage.data_ptr())
            host = self._host.get(key)
            if host is None or host.numel() != storage.nbytes():
                pin = torch.cuda.is_available()
                host = self._host[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes(storage), non_blocking=True)
            # freed to the allocator, whose next user on this stream runs after the copy
            storage.resize_(0)
            self._parked.append((storage, key))
        self.where = "host"

    def back(self) -> None:
        """Onto the device."""
        if self.where != "host":
            return
        for storage, key in self._parked:
            host = self._host[key]
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=True)
        self._parked = []
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

    def _tensors(self):
        yield from self.module.named_parameters(remove_duplicate=False)
        yield from self.module.named_buffers(remove_duplicate=False)


class ParkedOptimizer(Parked):
    """An optimizer's state tensors that live on the device (Adam's `step` counter, kept in host
    memory by torch unless fused or capturable, stays where it is)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, *, enabled: bool):
        super().__init__(device, enabled=enabled)
        self.optimizer = optimizer

    def _tensors(self):
        state = self.optimizer.state
        for g, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                for k, v in state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        yield (g, i, k), v
