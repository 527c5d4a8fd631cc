"""What the loop asks of its device at a phase boundary: give back memory that the allocator
keeps cached, so the next phase (or a colocated engine) has it.

On CUDA, PyTorch's caching allocator keeps the blocks of the update's peak reserved after their
tensors are gone. vLLM, waking for the next rollout, allocates through its own allocator and
cannot reuse them: at a 7B model the weights' wake (about 16 GB) and the KV cache would not fit
beside what the update left reserved. verl empties the cache before each of the two wakes; so
does grouprl (rollout/engines/vllm.py), and after each update (trainer/step.py).

On a CPU the same role falls to malloc's heap, which keeps freed activation memory resident
(cpu/allocator.py): giving it back at the update's end lowers what generation starts from.
"""

from __future__ import annotations

import contextlib
import os

import torch

from grouprl.cpu.allocator import release_free_memory
from grouprl.errors import UserError


def release_cached_memory(device: torch.device | str) -> None:
    """Free what the allocator of `device` holds cached beyond live tensors: CUDA's caching
    allocator (`torch.cuda.empty_cache`), or on a CPU malloc's free heap pages (glibc)."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_initialized():
            with torch.cuda.device(device):
                torch.cuda.empty_cache()
    elif device.type == "cpu":
        release_free_memory()


def use_device(device: torch.device | str) -> None:
    """Make `device` the calling thread's current CUDA device (every new thread starts on
    cuda:0, whatever device its process set); nothing for other devices."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def own_device(device: torch.device | str, environ=None) -> torch.device:
    """In a process of its own that has not started CUDA yet: make `device` the only GPU it sees
    (CUDA_VISIBLE_DEVICES, read through any list already set) and return its name there,
    cuda:0. vLLM in one process takes cuda:0 whatever device it is given (its device config
    carries no index), so an engine process meant for cuda:1 must see cuda:1 alone. Other
    devices are returned as they are."""
    import os

    environ = os.environ if environ is None else environ
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        return device
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and device.index >= len(visible):
        raise UserError(f"{device} is not among the GPUs this process may use (CUDA_VISIBLE_DEVICES={','.join(visible)})")
    physical = visible[device.index] if visible else str(device.index)
    environ["CUDA_VISIBLE_DEVICES"] = physical
    return torch.device("cuda", 0)


def host_share(ranks_per_node: int) -> int:
    """The CPU cores one of `ranks_per_node` ranks may use: those this process may run on (its
    affinity), split evenly; at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, ranks_per_node))


@contextlib.contextmanager
def host_threads(threads: int | None):
    """torch's intra-op threads set to `threads` inside the block, as they were after (None:
    left as they are). Ranks under torchrun run one thread each (OMP_NUM_THREADS=1), right for
    a GPU's work but not for host work such as the optimizer step on offloaded shards."""
    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
