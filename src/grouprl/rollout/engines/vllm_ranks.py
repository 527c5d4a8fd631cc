"""The vLLM engine on several ranks: each rank runs an engine of its own on its own groups
(data-parallel engines, tensor parallel 1), on the trainer's device.

In-process vLLM does not start a world of its own where a process group exists: it builds its
groups from the default group, the trainer's. Its "external_launcher" executor is made for that
(torchrun ranks, verl's layout): rank and device from RANK and LOCAL_RANK (set here to the
trainer's, `launcher_env`), no process group or port of its own; its world group spans the
trainer's ranks, used at start-up only (node count, the smallest KV budget), and with tensor
parallel 1 every model-parallel group is the rank alone, so the engines never wait on each other.
(The default "uni" executor would build the same groups, but puts the engine on cuda:0 on every
rank.) Starting is a collective: every rank starts its engine at the same point. vLLM's
teardown ends by destroying the default group; it runs without that step
(`vllm_shims.leave_groups_to_the_trainer`).
"""

from __future__ import annotations

import contextlib
import os

import torch


def beside_ranks() -> bool:
    """Whether this process is one rank of several in a process group the trainer joined."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def launcher_env(device: torch.device):
    """RANK and LOCAL_RANK as vLLM's external launcher reads them while the engine starts: this
    process's rank, and the index of the trainer's device (cuda:LOCAL_RANK is where the engine
    lives), whatever the launcher wrote."""
    import torch.distributed as dist

    local = device.index if device.type == "cuda" and device.index is not None else None
    if local is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
    wanted = {"RANK": str(dist.get_rank()), "LOCAL_RANK": str(local)}
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
