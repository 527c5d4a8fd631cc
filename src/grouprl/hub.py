"""Whether the Hugging Face hub can be reached, for the dry run's memory plan: offline, the
hub's client reads its cache only instead of retrying for about 25 s."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def hub_offline(path: str) -> bool:
    """A hub id (not a folder, not built in) on a machine that cannot reach the hub: the hub's
    client is told to read its cache only (it would retry for about 25 s otherwise)."""
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
    if reached:
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import huggingface_hub.constants as hub_constants

        hub_constants.HF_HUB_OFFLINE = True  # read at import: set it where it was read
    except ImportError:  # pragma: no cover
        pass
    return True
