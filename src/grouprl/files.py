"""Folders that are written whole, then renamed into place.

`tempfile.mkdtemp` makes its folder owner-only (0700) whatever the umask, and a folder renamed
into place keeps that mode: an exported model, a cached built-in model or a curriculum would be
unreadable to a serving process running as another user. `temp_folder` gives the folder the mode
an ordinary `mkdir` would (0777 less the process's umask), `with_umask_modes` its files too.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def umask() -> int:
    """The process's umask, read without changing it where Linux shows it (else set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def with_umask_modes(folder: Path) -> Path:
    """Every file and folder under `folder` (itself included) given the mode an ordinary
    open/mkdir would (some writers, e.g. safetensors through a temp file, make files 0600)."""
    mask = umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    return folder


def temp_folder(prefix: str, dir: Path) -> Path:
    """A new folder in `dir` named `prefix` + a random part, with a mkdir's mode."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    folder.chmod(0o777 & ~umask())
    return folder
