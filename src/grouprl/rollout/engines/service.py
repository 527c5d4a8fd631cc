"""`grouprl engine serve`: rollout engines on a machine of their own, for trainers on others.

    engine machine:  GROUPRL_ENGINE_KEY=... grouprl engine serve --host 10.0.0.2 --port 7100 --devices cuda:0,cuda:1
    trainer machine: GROUPRL_ENGINE_KEY=... grouprl train ... rollout.max_staleness=1 rollout.engine_address=10.0.0.2:7100

Each trainer process (each rank) that connects gets an engine process of its own on one of the
`--devices` (one engine a device entry; list `cpu` twice for two CPU engines), for as long as its
connection lasts: the trainer sends how to load the policy (its config and model path, which
must resolve here too: a hub id, or a shared filesystem), the engine loads it, then serves the
requests and weight pushes of `process.EngineProcess` (see process.py). A trainer that resumes
after its engine ended gets a new one. The service itself loads no model.

Both sides prove they hold GROUPRL_ENGINE_KEY (at least 32 characters) before anything else
travels, and everything travels over that one connection: requests, answers and weights (from
one GPU to another over NCCL, whose rendezvous goes over the connection too). The service
listens on its --host and port only; its engines open no port. What travels is pickled and not
encrypted: the key is as good as a shell on the engine machine; serve on a network you trust, or
bind 127.0.0.1 and reach it through an SSH tunnel (docs/guide/async.md, "Engine service"). A peer has
KEY_PROOF_S (5 s) to prove the key (a few small messages: a trainer takes milliseconds plus its
round trips) and HANDSHAKE_TIMEOUT_S (30 s) for the whole handshake, its hello (the config and
how to load the policy) included; at most MAX_HANDSHAKES handshakes run at once, MAX_PER_PEER
from one address, so connections that send nothing hold a trainer from their address off for
5 s at most, not 30 (one that keeps opening them still can: hence the tunnel); a trainer that
goes away frees its device.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
from multiprocessing.connection import (
    AuthenticationError,
    Connection,
    answer_challenge,
    deliver_challenge,
)

import torch

import grouprl
from grouprl.errors import UserError
from grouprl.processes import start_fresh, start_server
from grouprl.rollout.engines.process import (
    HANDSHAKE_TIMEOUT_S,
    PRELOAD,
    PROTOCOL,
    engine_key,
    keep_alive,
    local_address,
    serve,
    weights_backend,
)

log = logging.getLogger("grouprl.engine")
SLOT_WAIT_S = 3  # how long a trainer waits for a device (one whose trainer went away may be ending)
MAX_HELLO_BYTES = 64 * 2**20  # the trainer's hello (its config and how to load the policy)


KEY_PROOF_S = 5.0  # to prove the key, of HANDSHAKE_TIMEOUT_S: a peer that sends nothing is gone after it
MAX_HANDSHAKES = 16  # handshakes in flight (each a thread and a descriptor until it ends)
MAX_PER_PEER = 4  # of them from one address
BACKLOG = 64  # connections the kernel queues before they are accepted


def _engine(conn: Connection, build: bytes, device: str, backend: str, host: str) -> None:
    """An engine process of the service: the trainer's loading code on `device`, then `serve`."""
    serve(conn, lambda: pickle.loads(build)(device=device), backend, host)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host` only (an IPv6 address too), with a real backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=BACKLOG)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}") from None


@contextlib.contextmanager
def deadline(conn: Connection, seconds: float):
    """The connection is shut down `seconds` from now unless the block has ended: one limit for
    the whole handshake (a per-read timeout lets a peer that sends a byte now and then stay)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    timer = threading.Timer(seconds, lambda: _shut(sock))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        sock.close()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class EngineService:
    """Accepts trainers on (host, port) and gives each an engine process on a free device."""

    def __init__(self, host: str, port: int, devices: list[str]):
        if not devices:
            raise UserError("--devices names at least one device (cpu, cuda or cuda:N)")
        visible = torch.cuda.device_count()
        for device in devices:
            if device != "cpu" and (torch.device(device).index or 0) >= visible:
                raise UserError(f"--devices: {device} is not on this machine ({visible} CUDA devices visible)")
        self.key = engine_key()
        self.devices = devices
        self.slots: list[multiprocessing.Process | None] = [None] * len(devices)
        self.lock = threading.Lock()
        self.handshakes: dict[str, int] = {}  # address -> handshakes in flight from it
        self.listener = listen(host, port)  # the key is checked per connection, on a thread
        self.host, self.port = host, self.listener.getsockname()[1]
        start_server(PRELOAD)  # now, so that the first trainer does not wait for its imports
        self._stopped = False

    def serve_forever(self) -> None:
        while not self._stopped:
            try:
                sock, address = self.listener.accept()
            except OSError:  # closed (stop), or a connection reset before it was accepted
                continue
            host, port = address[:2]
            peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            with self.lock:
                busy = sum(self.handshakes.values()) >= MAX_HANDSHAKES or self.handshakes.get(host, 0) >= MAX_PER_PEER
                if not busy:
                    self.handshakes[host] = self.handshakes.get(host, 0) + 1
            if busy:  # a flood of silent connections must not crowd out a trainer
                log.warning("refused %s: %d handshakes in flight (%d from it)", peer, sum(self.handshakes.values()),
                            self.handshakes.get(host, 0))  # fmt: skip
                sock.close()
                continue
            conn = Connection(sock.detach())
            threading.Thread(target=self._admit, args=(conn, peer, host), name=f"admit-{peer}", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            for process in self.slots:
                if process is not None and process.is_alive():
                    process.terminate()

    def _admit(self, conn: Connection, peer: str, host: str) -> None:
        """The key, the trainer's hello, a free device, then the engine process (this thread
        waits for it to end and frees its device)."""
        try:
            hello = self._handshake(conn, peer)
        finally:
            with self.lock:
                self.handshakes[host] -= 1
                if not self.handshakes[host]:
                    del self.handshakes[host]
        if hello is None:
            return
        if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL:
            theirs = hello.get("version", "an older version") if isinstance(hello, dict) else "an older version"
            self._refuse(conn, f"the engine service at {self.host}:{self.port} runs grouprl {grouprl.__version__}, the "
                               f"trainer {theirs}, and they speak differently: install the same version on both machines")  # fmt: skip
            return
        until = time.monotonic() + SLOT_WAIT_S
        while True:
            with self.lock:
                slot = next((i for i, p in enumerate(self.slots) if p is None or not p.is_alive()), None)
                if slot is not None:
                    process = self.slots[slot] = self._start(conn, slot, hello, host)
                    break
            if time.monotonic() > until:
                busy = ", ".join(self.devices)
                self._refuse(conn, f"the engine service at {self.host}:{self.port} has no free device (its "
                                   f"{len(self.devices)} engines, on {busy}, each serve a trainer): start it with more --devices")  # fmt: skip
                return
            time.sleep(0.1)
        conn.close()  # the engine process holds the connection: its end closes it for the trainer
        device = self.devices[slot]
        log.info("engine on %s for %s (pid %d)", device, peer, process.pid)
        process.join()
        log.info("engine on %s for %s ended (exit code %s)", device, peer, process.exitcode)

    def _handshake(self, conn: Connection, peer: str) -> dict | None:
        """The key proved both ways within KEY_PROOF_S and the trainer's hello read, within
        HANDSHAKE_TIMEOUT_S in all; None (the connection closed, a line logged) otherwise."""
        try:
            with deadline(conn, HANDSHAKE_TIMEOUT_S):
                with deadline(conn, KEY_PROOF_S):  # a silent peer holds its slot this long, not 30 s
                    deliver_challenge(conn, self.key)
                    answer_challenge(conn, self.key)
                message = conn.recv_bytes(MAX_HELLO_BYTES)  # before the key, nothing is unpickled
                op, hello = pickle.loads(message)
        except AuthenticationError as e:
            log.warning("refused %s: it does not hold the key (%s)", peer, e)
            conn.close()
            return None
        except Exception as e:  # noqa: BLE001 - a broken or foreign hello (after the key), a reset, the deadline
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            log.warning("dropped %s before its hello (%s; %g s to prove the key, %g s for the whole handshake)",
                        peer, why, KEY_PROOF_S, HANDSHAKE_TIMEOUT_S)  # fmt: skip
            conn.close()
            return None
        if op != "hello":
            log.warning("dropped %s: it sent %r before its hello", peer, op)
            conn.close()
            return None
        return hello if isinstance(hello, dict) else {}

    def _start(self, conn: Connection, slot: int, hello: dict, host: str) -> multiprocessing.Process:
        """The engine process of device `slot` for the trainer at `host` on `conn`."""
        device, here = self.devices[slot], local_address(conn)
        backend = weights_backend(hello["trainer_device"], device, host in ("127.0.0.1", "::1", here))
        keep_alive(conn)  # a trainer whose machine goes away frees the device
        return start_fresh(_engine, (conn, hello["build"], device, backend, here), f"grouprl-engine-{slot}", PRELOAD)

    @staticmethod
    def _refuse(conn: Connection, why: str) -> None:
        log.warning("%s", why)
        try:
            conn.send(("error", "EngineProcessEnded", why, ""))
        except OSError:
            pass
        conn.close()


def run(host: str, port: int, devices: list[str]) -> int:
    """The CLI's `grouprl engine serve`: until Ctrl-C or SIGTERM."""
    service = EngineService(host, port, devices)
    print(f"engine service on {service.host}:{service.port} ({len(devices)} engines: {', '.join(devices)})", flush=True)

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
    return 0
