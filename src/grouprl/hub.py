"""Whether the Hugging Face hub can be reached, for the dry run's memory plan: offline, the
hub's client reads its cache only instead of retrying for about 25 s."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def hub_offline(path: str) -> bool:
    """Whether `path` is a hub id (not a folder, not built in) on a machine that cannot reach
    the hub (or is told it is offline)."""
    import socket

    if path.startswith("builtin:") or Path(path).expanduser().exists() or os.environ.get("HF_HUB_OFFLINE") == "1":
        return os.environ.get("HF_HUB_OFFLINE") == "1"
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    reached: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, 443), timeout=2).close()
            reached.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)  # a name lookup has no timeout of its own
    probe.start()
    probe.join(3)
    return not reached


@contextlib.contextmanager
def cache_only_when_offline(path: str):
    """Inside: the hub's client reads its cache only when `path` is a hub id the hub cannot be
    reached for (yields whether it is); outside, as it was."""
    offline = hub_offline(path)
    if not offline or os.environ.get("HF_HUB_OFFLINE") == "1":
        yield offline
        return
    import huggingface_hub.constants as hub_constants

    before = hub_constants.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub_constants.HF_HUB_OFFLINE = True  # read at import: set it where it was read
    try:
        yield True
    finally:
        os.environ.pop("HF_HUB_OFFLINE", None)
        hub_constants.HF_HUB_OFFLINE = before
