"""mapped_large_blocks: inside the block large tensors are mmapped (and unmapped when freed),
outside it they come from malloc's heap; the setting is undone on leaving, also on an error."""

import ctypes

import pytest
import torch

from grouprl.trainer import allocator

pytestmark = pytest.mark.skipif(allocator._mallopt() is None, reason="glibc only")

MiB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _mmapped_bytes() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().hblkhd


def _mapped_by(nbytes: int) -> int:
    """How many mmapped bytes a live tensor of `nbytes` adds."""
    before = _mmapped_bytes()
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    added = _mmapped_bytes() - before
    del t
    return added


def test_blocks_over_the_threshold_are_mapped_and_given_back_inside_only():
    with allocator.mapped_large_blocks(1 * MiB) as ok:
        assert ok
        assert _mapped_by(4 * MiB) >= 4 * MiB
        before = _mmapped_bytes()
        t = torch.ones(MiB, dtype=torch.float32)
        del t
        assert _mmapped_bytes() == before  # unmapped on free, not kept
        assert _mapped_by(MiB // 2) == 0  # below the threshold: heap
    assert _mapped_by(4 * MiB) == 0  # back at the 32 MiB ceiling: heap


def test_setting_is_undone_on_an_error_and_zero_leaves_malloc_alone(monkeypatch):
    with pytest.raises(RuntimeError, match="boom"):
        with allocator.mapped_large_blocks(1 * MiB):
            raise RuntimeError("boom")
    assert _mapped_by(4 * MiB) == 0
    calls = []
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda *a: calls.append(a) or 1)
    with allocator.mapped_large_blocks(0) as ok:
        assert not ok
    assert calls == []
    with allocator.mapped_large_blocks(3 * MiB) as ok:
        assert ok
    assert calls == [(allocator.M_MMAP_THRESHOLD, 3 * MiB), (allocator.M_MMAP_THRESHOLD, allocator.GLIBC_CEILING)]
