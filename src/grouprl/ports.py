"""What the project's HTTP servers (`grouprl view`, the retrieval service) share: the port checked
before a slow start (an index or runs to load), so that a port in use is one line rather than a
bind traceback after the wait; and the Host check every route of theirs goes through
(`TrustedHosts`), against DNS rebinding."""

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


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(header: str) -> str:
    """The name a Host header gives, without its port or an IPv6 address's brackets, lower case;
    "" for what a browser never sends (a bare IPv6 address, a port that is not a number)."""
    header = header.strip().lower()
    if header.startswith("["):
        close = header.find("]")
        rest = header[close + 1 :] if close > 0 else ":x"
        return header[1:close] if rest == "" or (rest[:1] == ":" and rest[1:].isdigit()) else ""
    name, colon, port = header.rpartition(":")
    if not colon:
        return header
    return name if port.isdigit() and ":" not in name else ""


def is_address(name: str) -> bool:
    """`name` is an IP address written out (IPv4 or IPv6), not a name DNS answers for."""
    import ipaddress

    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class TrustedHosts:
    """ASGI middleware: a server on this machine answers a request only when its Host header is
    this machine's loopback (localhost, 127.0.0.1, ::1), the address it was told to listen on
    (`hosts`), or any address written out. A page elsewhere that makes its own name resolve to
    127.0.0.1 (DNS rebinding) sends that name, so it is refused (403); an address written out
    cannot be rebound, and a page at another address is another origin, which the browser keeps
    from reading the answers."""

    def __init__(self, app, hosts: tuple[str, ...] = (), what: str = "this server"):
        self.app = app
        self.names = {host_name(h) or h.lower().strip("[]") for h in (*LOOPBACK_NAMES, *hosts)}
        self.what = what

    def trusted(self, header: str) -> bool:
        name = host_name(header)
        return bool(name) and (name in self.names or is_address(name))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            hosts = [value.decode("latin-1") for key, value in scope["headers"] if key == b"host"]
            if len(hosts) != 1 or not self.trusted(hosts[0]):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                names = ", ".join(sorted(self.names))
                body = (f"{self.what} answers requests for {names} or an address, not for the host this "
                        "request names (a page elsewhere whose name points here)\n").encode()  # fmt: skip
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                        (b"content-length", str(len(body)).encode())]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
