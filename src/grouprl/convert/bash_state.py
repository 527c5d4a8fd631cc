"""What the shell's parts share: its limits, the machine its probes answer for, and the
exceptions that carry bash's control flow (exit, return, break/continue) and an undecidable
condition through the walk."""

from __future__ import annotations

import os
import posixpath

MAX_STEPS = 100_000
MAX_CALLS = 60
GPUS = 8  # the machine probes are answered for


class _Exit(Exception):
    pass


class _Return(Exception):
    pass


class _Break(Exception):
    def __init__(self, levels: int, again: bool):
        self.levels, self.again = levels, again


class _Undecided(Exception):
    """A condition reads a value only bash would know."""


def os_user() -> str:
    return os.environ.get("USER", "user")


def normalise(cwd: str, path: str) -> str:
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(cwd, path))
