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

import torch

from grouprl.cpu.allocator import release_free_memory


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
