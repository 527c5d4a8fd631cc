"""`grouprl engine serve`: rollout engines on a machine of their own, for trainers on others.

    engine machine:  GROUPRL_ENGINE_KEY=... grouprl engine serve --host 10.0.0.2 --port 7100 --devices cuda:0,cuda:1
    trainer machine: GROUPRL_ENGINE_KEY=... grouprl train ... rollout.max_staleness=1 rollout.engine_address=10.0.0.2:7100

Each trainer process (each rank) that connects gets an engine process of its own on one of the
`--devices` (one engine a device entry; list `cpu` twice for two CPU engines), for as long as its
connection lasts: the trainer sends how to load the policy (its config and model path, which
must resolve here too: a hub id, or a shared filesystem), the engine loads it, then serves the
requests and weight pushes of `process.EngineProcess` (see process.py). A trainer that resumes
after its engine ended gets a new one. The service itself loads no model.

Both sides prove they hold GROUPRL_ENGINE_KEY before anything else travels (what travels is
pickled: serve only to trainers on a network you trust, with a key only they know). A peer that
connects and stays silent is dropped after 30 s; a trainer that goes away frees its device.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import threading
import time
from multiprocessing.connection import (
    AuthenticationError,
    Connection,
    Listener,
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
    read_timeout,
    serve,
    weights_backend,
)

log = logging.getLogger("grouprl.engine")
SLOT_WAIT_S = 3  # how long a trainer waits for a device (one whose trainer went away may be ending)


def _engine(conn: Connection, build: bytes, device: str, backend: str, host: str) -> None:
    """An engine process of the service: the trainer's loading code on `device`, then `serve`."""
    serve(conn, lambda: pickle.loads(build)(device=device), None, backend, host)


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
        try:
            self.listener = Listener((host, port))  # the key is checked per connection, on a thread
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.host, self.port = host, self.listener.address[1]
        start_server(PRELOAD)  # now, so that the first trainer does not wait for its imports
        self._stopped = False

    def serve_forever(self) -> None:
        while not self._stopped:
            try:
                conn = self.listener.accept()
            except OSError:  # closed (stop), or a connection reset before it was accepted
                continue
            host, port = self.listener.last_accepted[:2]
            peer = f"{host}:{port}"
            threading.Thread(target=self._admit, args=(conn, peer), name=f"admit-{peer}", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        self.listener.close()
        with self.lock:
            for process in self.slots:
                if process is not None and process.is_alive():
                    process.terminate()

    def _admit(self, conn: Connection, peer: str) -> None:
        """The key, the trainer's hello, a free device, then the engine process (this thread
        waits for it to end and frees its device)."""
        try:
            with read_timeout(conn, HANDSHAKE_TIMEOUT_S):
                deliver_challenge(conn, self.key)
                answer_challenge(conn, self.key)
                op, hello = conn.recv()
        except AuthenticationError:
            log.warning("refused %s: it holds another key", peer)
            conn.close()
            return
        except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as e:
            log.warning("dropped %s before it said hello (%s)", peer, e.__class__.__name__)
            conn.close()
            return
        if op != "hello" or not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL:
            theirs = hello.get("version", "an older version") if isinstance(hello, dict) else "an older version"
            self._refuse(conn, f"the engine service at {self.host}:{self.port} runs grouprl {grouprl.__version__}, the "
                               f"trainer {theirs}, and they speak differently: install the same version on both machines")  # fmt: skip
            return
        deadline = time.monotonic() + SLOT_WAIT_S
        while True:
            with self.lock:
                slot = next((i for i, p in enumerate(self.slots) if p is None or not p.is_alive()), None)
                if slot is not None:
                    process = self.slots[slot] = self._start(conn, slot, hello, peer)
                    break
            if time.monotonic() > deadline:
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

    def _start(self, conn: Connection, slot: int, hello: dict, peer: str) -> multiprocessing.Process:
        """The engine process of device `slot` for the trainer on `conn`."""
        device, here = self.devices[slot], local_address(conn)
        backend = weights_backend(hello["trainer_device"], device, peer.split(":")[0] in ("127.0.0.1", here))
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
