"""Give freed activation memory back to the OS during the update (Linux, glibc).

A CPU tensor's memory comes from malloc. glibc serves blocks below an adaptive threshold (it
rises to 32 MiB once such a block is freed) from its heap, growing the heap when no free chunk
fits, and a heap keeps freed memory for reuse. The blocks the next micro-batch asks for do not
fit the holes the last one left, so the heap grows past the live tensors: in a default run the
peak RSS, reached in backward, was 0.5 GiB above what malloc had handed out. Within
`mapped_large_blocks(threshold)` a block of `threshold` bytes or more that the heap's free chunks
cannot serve is mmapped instead of growing the heap, and unmapped when freed, so the heap stops
growing in the update. Leaving the block restores the threshold to glibc's ceiling (32 MiB),
where the adaptive threshold settles after the first large free anyway.

Elsewhere (another libc, macOS, Windows) the block does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
GLIBC_CEILING = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


@functools.cache
def _mallopt():
    """glibc's mallopt, or None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only  # noqa: B018
        return libc.mallopt
    except (OSError, AttributeError):
        return None


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
