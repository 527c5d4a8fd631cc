"""Each phase's measured peak, logged as perf/peak_gb/<phase>."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from grouprl.trainer.memory.inputs import GIB

_HWM = re.compile(r"VmHWM:\s+(\d+) kB")


class PeakMeter:
    """Each phase's measured peak: on CUDA the allocator's (max_memory_allocated, and reserved),
    on a CPU the process's resident set (VmHWM, reset at each phase's start through
    /proc/self/clear_refs). GiB, as `perf/peak_gb/<phase>`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    @staticmethod
    def reset_host() -> None:
        """The resident set's peak from now on (Linux; elsewhere the process's lifetime peak)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.reset_host()

    def read(self) -> dict[str, float]:
        """The peak since `start` (GiB): 'peak' (allocated on CUDA, resident on CPU) and, on
        CUDA, 'reserved' (what the caching allocator holds)."""
        if self.cuda:
            return {
                "peak": torch.cuda.max_memory_allocated(self.device) / GIB,
                "reserved": torch.cuda.max_memory_reserved(self.device) / GIB,
            }
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return {}
        found = _HWM.search(status)
        return {"peak": int(found.group(1)) * 1024 / GIB} if found else {}

    def measure(self, phase: str) -> dict[str, float]:
        """The peak since `start` as metrics of `phase`."""
        out = self.read()
        metrics = {f"perf/peak_gb/{phase}": out["peak"]} if "peak" in out else {}
        if "reserved" in out:
            metrics[f"perf/reserved_gb/{phase}"] = out["reserved"]
        return metrics
