"""A server's port checked before its slow start (an index or runs to load), so that a port in use
is one line rather than a bind traceback after the wait."""

from __future__ import annotations

import socket

from grouprl.errors import ConfigError


def check_port_free(host: str, port: int) -> None:
    """One ConfigError line for a port out of range, in use, or on an address this machine lacks."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be from 0 to 65535, got {port}")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
