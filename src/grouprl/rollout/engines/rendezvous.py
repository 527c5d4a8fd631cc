"""The rendezvous of a trainer's and an engine's two-process NCCL group, carried over the
connection they already share (a pipe, or TCP after both proved the key), so that forming the
group opens no port of its own.

torch.distributed's TCPStore listens on every interface and takes any client: whoever reached
its port could read, change or delete the rendezvous keys and take a rank. `ConnectionStore` is
a `torch.distributed.Store` whose keys live in the hosting process; the other process's store
asks over the connection. It is live only while the group forms (`formed()`): after that
nothing travels for it, and a late call (NCCL's monitoring thread checking for a dump signal)
is answered from what the hosting side's keys were, or as absent.
"""

from __future__ import annotations

import datetime
import threading
import time
from multiprocessing.connection import Connection

import torch.distributed as dist

DONE = "store-done"


class ConnectionStore(dist.Store):
    """Keys on the host side (`serve()` answers the other side's requests on a thread until it
    says it is done); on the other side each call is a request over `conn`."""

    def __init__(self, conn: Connection, *, host: bool, timeout_s: float = 300.0):
        super().__init__()
        self.conn, self.host = conn, host
        self.keys: dict[str, bytes] = {}
        self.changed = threading.Condition()
        self.live = True
        self.failed = ""  # host side: why the other side stopped while the group formed
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._thread: threading.Thread | None = None
        self._asking = threading.Lock()  # other side: one request on the connection at a time

    # ------------------------------------------------------------------ host side
    def serve(self) -> None:
        """Answer the other process's requests on a thread until it sends DONE."""
        self._thread = threading.Thread(target=self._serve, name="grouprl-rendezvous", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._fail("the engine process ended while the weights' group formed")
                return
            if message == DONE:
                return
            if not (isinstance(message, tuple) and len(message) == 3 and message[0] == "store"):
                # the engine's error while forming (its ("error", name, text, trace)), or anything else
                text = message[2] if isinstance(message, tuple) and len(message) >= 3 else repr(message)[:200]
                self._fail(f"the engine process failed while the weights' group formed: {text}")
                return
            _, op, args = message
            try:
                self.conn.send(("store-ok", getattr(self, "_" + op)(*args)))
            except Exception as e:  # noqa: BLE001 - the asking side raises it
                self.conn.send(("store-error", f"{type(e).__name__}: {e}"))

    def _fail(self, why: str) -> None:
        with self.changed:
            self.failed = why
            self.changed.notify_all()

    def formed(self) -> None:
        """The group has formed: the other side says so (its side), or its DONE is awaited (the
        host's); no call goes over the connection after this."""
        if self.host:
            if self._thread is not None:
                self._thread.join()
            self.live = False
            return
        with self._asking:  # after a request in flight; none after DONE
            if self.live:
                self.live = False
                self.conn.send(DONE)

    # ------------------------------------------------------------------ the Store interface
    def _call(self, op: str, *args):
        if self.host:
            return getattr(self, "_" + op)(*args)
        with self._asking:  # the main thread's get and a monitoring thread's check do not interleave
            if not self.live:  # formed: only the monitoring threads' checks come late
                return {"get": None, "check": False, "num_keys": 0, "add": 0, "delete_key": False}.get(op)
            self.conn.send(("store", op, args))
            kind, value = self.conn.recv()
        if kind == "store-error":
            raise RuntimeError(value)
        return value

    def set(self, key, value):
        self._call("set", key, bytes(value))

    def get(self, key):
        value = self._call("get", key)
        if value is None:
            raise RuntimeError(f"rendezvous key {key!r} is not there (the group has formed)")
        return value

    def add(self, key, value):
        return self._call("add", key, int(value))

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, bytes(expected), bytes(desired))

    def check(self, keys):
        return self._call("check", list(keys))

    def wait(self, keys, timeout=None):
        self._call("wait", list(keys), None if timeout is None else timeout.total_seconds())

    def delete_key(self, key):
        return self._call("delete_key", key)

    def num_keys(self):
        return self._call("num_keys")

    def set_timeout(self, timeout):
        self._timeout = timeout

    @property
    def timeout(self):
        return self._timeout

    # ------------------------------------------------------------------ the keys (host side)
    def _set(self, key: str, value: bytes) -> None:
        with self.changed:
            self.keys[key] = value
            self.changed.notify_all()

    def _wait_for(self, keys: list[str], timeout_s: float | None) -> None:
        deadline = time.monotonic() + (self._timeout.total_seconds() if timeout_s is None else timeout_s)
        with self.changed:
            while not all(k in self.keys for k in keys):
                if self.failed:
                    raise RuntimeError(self.failed)
                left = deadline - time.monotonic()
                if left <= 0 or not self.live:
                    raise RuntimeError(f"rendezvous keys {keys} did not come (timeout)")
                self.changed.wait(min(left, 1.0))

    def _get(self, key: str) -> bytes | None:
        if not self.live and key not in self.keys:
            return None
        self._wait_for([key], None)
        return self.keys[key]

    def _add(self, key: str, value: int) -> int:
        with self.changed:
            total = int(self.keys.get(key, b"0")) + value
            self.keys[key] = str(total).encode()
            self.changed.notify_all()
            return total

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.changed:
            current = self.keys.get(key)
            if (current is None and not expected) or current == expected:
                self.keys[key] = desired
                self.changed.notify_all()
                return desired
            return current if current is not None else expected

    def _check(self, keys: list[str]) -> bool:
        with self.changed:
            return all(k in self.keys for k in keys)

    def _wait(self, keys: list[str], timeout_s: float | None) -> None:
        self._wait_for(keys, timeout_s)

    def _delete_key(self, key: str) -> bool:
        with self.changed:
            return self.keys.pop(key, None) is not None

    def _num_keys(self) -> int:
        with self.changed:
            return len(self.keys)
