"""The rendezvous of a trainer's and an engine's two-process NCCL group, carried over the
connection they already share (a pipe, or TCP after both proved the key), so that forming the
group opens no port of its own.

torch.distributed's TCPStore listens on every interface and takes any client: whoever reached
its port could read, change or delete the rendezvous keys and take a rank. `ConnectionStore` is
a `torch.distributed.Store` whose keys live in the hosting process; the other process's store
asks over the connection. It answers for the group's whole life: NCCL may make a communicator
after the first (another stream or device, point-to-point), and its monitoring thread checks a
key now and then. From the moment the group starts to form, both processes read their
connection through a `Channel`: one thread reads every message, answers the store's requests
(the host's side) or hands the store its answers (the other side), and queues the rest (the
trainer's requests and the engine's answers) for `recv`. Every method c10d dispatches to a
Python store is here (set, get, add, compare_set, check, wait, append, multi_get, multi_set,
delete_key, num_keys, has_extended_api, clone); the ones it does not dispatch (list_keys, the
queue calls) fail in torch with an error naming them.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from multiprocessing.connection import Connection

import torch.distributed as dist

_END = ("channel-end",)  # what the reader queues when the connection ends


class Channel:
    """A connection shared by two processes' own messages and the rendezvous store's: a reader
    thread takes every message off it; `send` may be called from any thread."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.store: ConnectionStore | None = None  # set by the store over this channel
        self._sending = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()  # the processes' own messages
        self._answers: queue.Queue = queue.Queue()  # the host's answers to this side's store requests
        self._requests: queue.Queue = queue.Queue()  # the other side's store requests (host side)
        self._peeked = None
        self.ended = False
        threading.Thread(target=self._read, name="grouprl-channel", daemon=True).start()
        threading.Thread(target=self._answer, name="grouprl-rendezvous", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.ended = True
                for q in (self._inbox, self._answers, self._requests):
                    q.put(_END)
                if self.store is not None:
                    self.store.peer_failed("the engine process ended while the weights' group formed", ended=True)
                return
            kind = message[0] if isinstance(message, tuple) and message else None
            if kind == "store":
                self._requests.put(message)  # answered on a thread of its own: a wait may block
            elif kind in ("store-ok", "store-error"):
                self._answers.put(message)
            else:
                if kind == "error" and self.store is not None and len(message) >= 3:  # the engine's failure
                    self.store.peer_failed(f"the engine process failed while the weights' group formed: {message[2]}")
                self._inbox.put(message)

    def _answer(self) -> None:
        while (message := self._requests.get()) is not _END:
            _, op, args = message
            try:
                self.send(("store-ok", getattr(self.store, "_" + op)(*args)))
            except Exception as e:  # noqa: BLE001 - the asking side raises it
                self.send(("store-error", f"{type(e).__name__}: {e}"))

    def send(self, message) -> None:
        with self._sending:
            self.conn.send(message)

    def ask(self, request, timeout_s: float):
        """The host's answer to a store request."""
        self.send(request)
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the rendezvous store's {request[1]} had no answer within {timeout_s:.0f} s") from None
        if answer is _END:
            raise RuntimeError(f"the rendezvous store's {request[1]}: the other process has gone")
        return answer

    def poll(self, timeout: float = 0.0) -> bool:
        if self._peeked is None:
            try:
                self._peeked = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            except queue.Empty:
                return False
        return True

    def recv(self):
        message = self._peeked if self._peeked is not None else self._inbox.get()
        self._peeked = None
        if message is _END:
            self._inbox.put(_END)  # every later read ends too
            raise EOFError("the connection ended")
        return message

    def close(self) -> None:
        self.conn.close()


class ConnectionStore(dist.Store):
    """Keys on the host side (its channel answers the other side's requests); on the other side
    each call is a request over the channel."""

    def __init__(self, channel: Channel, *, host: bool, timeout_s: float = 300.0):
        super().__init__()
        self.channel, self.host = channel, host
        self.keys: dict[str, bytes] = {}
        self.changed = threading.Condition()
        self.failed, self.unseen, self.ended = "", False, False  # host side: the other side's failures
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._asking = threading.Lock()  # other side: one request on the channel at a time
        channel.store = self

    def peer_failed(self, why: str, ended: bool = False) -> None:
        """The other process failed (a request's error: the next wait, or the one in progress,
        ends with `why`) or `ended` (every wait from now on ends with it)."""
        with self.changed:
            self.unseen = True
            self.failed = why
            self.ended = self.ended or ended
            self.changed.notify_all()

    # ------------------------------------------------------------------ the Store interface
    def _call(self, op: str, *args):
        if self.host:
            return getattr(self, "_" + op)(*args)
        with self._asking:  # the main thread's calls and a monitoring thread's do not interleave
            kind, value = self.channel.ask(("store", op, args), self._timeout.total_seconds() + 5)
        if kind == "store-error":
            raise RuntimeError(value)
        return value

    def set(self, key, value):
        self._call("set", key, bytes(value))

    def get(self, key):
        return self._call("get", key)

    def add(self, key, value):
        return self._call("add", key, int(value))

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, bytes(expected), bytes(desired))

    def check(self, keys):
        return self._call("check", list(keys))

    def wait(self, keys, timeout=None):
        self._call("wait", list(keys), None if timeout is None else timeout.total_seconds())

    def append(self, key, value):
        self._call("append", key, bytes(value))

    def multi_get(self, keys):
        return self._call("multi_get", list(keys))

    def multi_set(self, keys, values):
        self._call("multi_set", list(keys), [bytes(v) for v in values])

    def delete_key(self, key):
        return self._call("delete_key", key)

    def num_keys(self):
        return self._call("num_keys")

    def has_extended_api(self):
        return True  # append, multi_get, multi_set

    def clone(self):
        return self  # thread-safe as it is: a clone would ask over the same channel

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
                if self.ended or self.unseen:
                    self.unseen = False  # one wait reports a failure; an end, every wait
                    raise RuntimeError(self.failed)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"rendezvous keys {keys} did not come (timeout)")
                self.changed.wait(min(left, 1.0))

    def _get(self, key: str) -> bytes:
        self._wait_for([key], None)
        return self.keys[key]

    def _append(self, key: str, value: bytes) -> None:
        with self.changed:
            self.keys[key] = self.keys.get(key, b"") + value
            self.changed.notify_all()

    def _multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait_for(keys, None)
        with self.changed:
            return [self.keys[k] for k in keys]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self.changed:
            self.keys.update(zip(keys, values))
            self.changed.notify_all()

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
