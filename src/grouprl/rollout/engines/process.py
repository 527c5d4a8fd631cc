"""A rollout engine in a process of its own (`rollout.engine_process: true`): generation on a
device of its own (`rollout.engine_device`: another GPU of the node, or the CPU), fed the
policy's weights over torch.distributed, while the trainer's process updates.

    trainer process: EngineProcess (a RolloutEngine)        engine process: serve()
    generate / open_session / turns / begin/end_rollout --> the configured engine (built-in or
        (pickled over a pipe)                                vLLM) over its own copy of the policy
    on_group_done(i, generations)                       <-- each group as soon as it has ended
    weights_updated(model): each tensor's bytes over    --> received into the copy, then the
        the connection, or NCCL (`weights_backend`)          engine's own weights_updated

The first push sends every weight (the copy was loaded from the same files, but a resumed run's
or a trained tower's may differ), later ones the weights an update changes (`changing`).
Sampling randomness travels with each request (row streams) and comes back advanced, so a row
continues its stream across turns as in one process: the same seed samples the same tokens as
the in-process engine. A request waits for its answer while the process lives: an engine
process that ends (killed, out of memory) is one error naming its exit code, never a hang.

The engine process starts beside the trainer's (over a pipe), or, with an `address`, started
on another machine by `grouprl engine serve` (`service.py`): the same requests then travel over
TCP, after both sides prove they hold the same key (GROUPRL_ENGINE_KEY). The weights travel over
that same connection (nothing else listens: no port of the engine's or the trainer's takes a
connection without the key), or, from one GPU to another, over a two-process NCCL group whose
rendezvous is carried over the connection too (rendezvous.py; NCCL's own bootstrap sockets are
NCCL's). A connection that goes quiet is probed (TCP keep-alive), so an engine machine that goes
away is an error within a minute, not a wait.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import multiprocessing
import os
import pickle
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from typing import Any

import torch
import torch.distributed as dist

import grouprl
from grouprl.errors import ModelLoadError, UserError
from grouprl.processes import start_fresh
from grouprl.rollout.engines.base import Generation, GroupDone, SamplingParams, WeightOffers
from grouprl.rollout.engines.rendezvous import Channel, ConnectionStore
from grouprl.rollout.engines.streams import Randomness, RowStreams

HOST = "127.0.0.1"  # an engine process started here runs beside the trainer's, on the same machine
START_TIMEOUT_S = 1800  # loading a large model (and vLLM's warm-up) may take minutes
KEY_ENV = "GROUPRL_ENGINE_KEY"  # the secret a trainer and an engine service share
PROTOCOL = 2  # what a trainer and an engine service speak; both sides check it (2: turns one by one, versions)
PRELOAD = ["torch", "transformers", "grouprl.rollout.engines.hf", "grouprl.rollout.engines.process"]
WEIGHTS_TIMEOUT_S = 300  # the two processes' group (formed once the engine is loaded): one tensor's push
HANDSHAKE_TIMEOUT_S = 30  # connecting and proving the key, whole; a peer that takes longer is gone
KEY_MIN_CHARS = 32


class EngineProcessError(RuntimeError):
    """A request failed in the engine process (its traceback in the message)."""


class EngineProcessEnded(UserError):
    """The engine process ended (killed, out of memory), never started, or its service cannot be
    reached: the run stops, saved. `resume`: what the run's one line says about resuming."""

    resume = "(a new engine process starts)"


def weights_backend(trainer_device, engine_device, same_machine: bool = True) -> str:
    """How the weights travel: NCCL from one GPU to another; over the two processes' connection
    (through host memory) where either side is a CPU or both are the same GPU (NCCL joins one
    rank per device)."""
    a, b = torch.device(trainer_device), torch.device(engine_device)
    if a.type == b.type == "cuda" and (not same_machine or (a.index or 0) != (b.index or 0)):
        return "nccl"
    return "connection"


def engine_key() -> bytes:
    """The secret from GROUPRL_ENGINE_KEY (never a config key: it would be in config dumps), at
    least KEY_MIN_CHARS long: whoever listens at the address sees an HMAC of the key, and a short
    one can be guessed from it."""
    key = os.environ.get(KEY_ENV, "")
    make = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
    if not key:
        raise UserError(
            f"set {KEY_ENV} to a secret of your choosing on both machines (at least {KEY_MIN_CHARS} characters, "
            f"e.g. from `{make}`): the engine service and the trainers it serves prove to each other that they hold it"
        )
    if len(key) < KEY_MIN_CHARS:
        raise UserError(f"{KEY_ENV} has {len(key)} characters; use at least {KEY_MIN_CHARS} (e.g. from `{make}`)")
    return key.encode()


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (an IPv6 host in brackets) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"an engine service address is host:port (got {address!r})")
    return host.strip("[]"), int(port)


def keep_alive(conn: Connection, idle_s: int = 20, interval_s: int = 10, probes: int = 3) -> None:
    """Probe a quiet TCP connection, so that a peer whose machine went away is found (an error on
    the next read) within idle + interval x probes seconds instead of never."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", probes)):
            if hasattr(socket, name):  # Linux; other systems keep their defaults
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


@contextlib.contextmanager
def read_timeout(conn: Connection, seconds: float):
    """Reads on `conn` fail after `seconds` of silence (the handshake: a peer that connects and
    says nothing must not hold the other side)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))
        try:
            yield
        finally:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))


def local_address(conn: Connection) -> str:
    """This side's IP address on `conn` (the one the other side reaches it at)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        return s.getsockname()[0]


def _group(store, rank: int, timeout_s: float, backend: str = "gloo", host: str = HOST):
    """The two processes' group over `store`: gloo over `host`'s interface, or NCCL between two GPUs."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def form_group(conn, rank: int, backend: str, device: torch.device, host: str = HOST):
    """The two processes' group, its rendezvous over `conn` (the trainer, rank 0, keeps the keys;
    rendezvous.py) and formed now (one broadcast: NCCL makes its first communicator). From here
    the process reads `conn` through the returned channel, which keeps the rendezvous answering
    for the group's life: (group, store, channel)."""
    channel = Channel(conn)
    store = ConnectionStore(channel, host=rank == 0, timeout_s=WEIGHTS_TIMEOUT_S)
    try:
        group = _group(store, rank, WEIGHTS_TIMEOUT_S, backend, host)
        _broadcast(group, torch.zeros(1, device=device))
    except Exception as e:  # the other side's failure (the host's store knows it), else the group's own
        if store.failed:
            raise EngineProcessError(store.failed) from None
        raise EngineProcessError(f"the weights' group ({backend}) did not form: {e}".splitlines()[0]) from None
    return group, store, channel


def _receive_weights(conn, meta, params: dict, device: torch.device, group=None) -> None:
    """The engine's side of a push: each tensor's bytes from `group` (NCCL) or `conn`, copied
    into `params`; every tensor is read even after a copy fails (the stream stays in step), then
    the first failure is raised."""
    failed = None
    with torch.no_grad():
        for name, shape, dtype in meta:
            nbytes = math.prod(shape) * dtype.itemsize
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device if group is not None else "cpu")
            if group is not None:
                _broadcast(group, buffer)  # the bytes, whatever the dtype
            else:
                conn.recv_bytes_into(buffer.numpy())
            try:
                params[name].copy_(buffer.view(dtype).view(shape))
            except Exception as e:  # noqa: BLE001 - raised once every byte is read
                failed = failed or e
    if failed is not None:
        raise failed


def _drawn(generator: Randomness):
    """How far the request's row streams went (`RowStreams.state`), for the trainer's side."""
    return generator.state() if isinstance(generator, RowStreams) else None


def serve(conn, build: Callable[[], tuple[Any, torch.nn.Module, Callable]], backend: str = "connection",
          host: str = HOST) -> None:  # fmt: skip
    """The engine process: `build()` gives (engine, its model, a context each request runs in);
    then requests from `conn` until "close" or the trainer's end. The weights come over `conn`
    (backend "connection") or a two-process group formed with the trainer over `conn`."""
    try:
        engine, model, context = build()
        device = next(model.parameters()).device if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ready = {"eos_token_ids": engine.eos_token_ids, "pad_token_id": engine.pad_token_id}
        conn.send(("ready", {**ready, "backend": backend, "pid": os.getpid()}))
        group = None
        if backend != "connection":  # the connection read through the group's channel from here
            group, _, conn = form_group(conn, 1, backend, device, host)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
        conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        return
    sessions: dict[int, Any] = {}
    generators: dict[int, Randomness] = {}  # each session's randomness, as the trainer's side last said
    params = dict(model.named_parameters())
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):  # the trainer has gone
            return
        try:
            result, drawn = None, None
            if op == "close":
                conn.send(("ok", None, None, engine.prefill_tokens))
                return
            if op == "weights":
                meta, version = args
                _receive_weights(conn, meta, params, device, group)
                engine.weights_updated(model, version)
            elif op in ("begin_rollout", "end_rollout"):
                getattr(engine, op)()
            elif op == "generate":
                prompts, n, sampling, generator, images, stream = args
                on_group = (lambda i, generations: conn.send(("group", i, generations))) if stream else None
                with context():
                    result = engine.generate(prompts, n, sampling, generator, on_group_done=on_group, **images)
                drawn = _drawn(generator)
            elif op == "open_session":
                key, prompts, n, reuse, images = args
                sessions.clear()  # one rollout's session at a time: the one before has ended
                generators.clear()
                sessions[key] = engine.open_session(prompts, n, reuse_cache=reuse, **images)
            elif op == "turn":
                key, rows, new_tokens, sampling, generator, new_images = args
                with context():
                    result = sessions[key].generate(rows, new_tokens, sampling, generator, new_images)
                drawn = _drawn(generator)
            elif op == "step":
                key, admitted, generator = args
                held = generators.setdefault(key, generator)
                if isinstance(held, RowStreams) and held is not generator:
                    held.restore(generator.state())  # the streams as the trainer's side has them
                for row, new_tokens, sampling, new_images in admitted:
                    sessions[key].submit(row, new_tokens, sampling, held, **new_images)
                with context():
                    result = sessions[key].step()
                drawn = _drawn(held)
            elif op == "release":
                key, row = args
                sessions[key].release(row)
            else:
                raise ValueError(f"unknown request {op!r}")
            conn.send(("ok", result, drawn, engine.prefill_tokens))
        except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))


class _Session:
    """A multi-turn session whose contexts live in the engine process. Submitted turns travel
    with the next step; newer weights offered to the engine wait (here, where they are pushed
    from) until none of the session's turns runs there."""

    def __init__(self, owner: EngineProcess, key: int):
        self.owner, self.key = owner, key
        self.waiting: list[tuple[int, list[int], SamplingParams, dict]] = []
        self.running: set[int] = set()  # rows whose turn is in the engine process
        self.generator: Randomness = None

    def generate(self, rows, new_tokens, params, generator=None, new_images=None) -> list[Generation]:
        self.owner.between_turns()
        return self.owner._ask("turn", (self.key, rows, new_tokens, params, generator, new_images), generator)

    def submit(self, row, new_tokens, params, generator=None, new_images=None) -> None:
        self.generator = generator if generator is not None else self.generator
        self.waiting.append((row, list(new_tokens), params, {"new_images": new_images} if new_images else {}))

    def step(self) -> list[tuple[int, Generation]]:
        owner, admitted = self.owner, []
        if self.waiting and not (owner.offers.pending and self.running):
            owner.between_turns()
            admitted, self.waiting = self.waiting, []
            self.running |= {row for row, *_ in admitted}
            owner.running_turns += len(admitted)
        ended = owner._ask("step", (self.key, admitted, self.generator), self.generator)
        for row, _ in ended:
            self.running.discard(row)
        owner.running_turns -= len(ended)
        return ended

    def release(self, row: int) -> None:
        self.waiting = [turn for turn in self.waiting if turn[0] != row]
        if row in self.running:
            self.running.discard(row)
            self.owner.running_turns -= 1
        self.owner._ask("release", (self.key, row))


def connect(address: str, key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:
    """A connection to the engine service at `address`, each side having proved it holds `key`.
    Every failure is one line: unreachable, refused, or a key that differs."""
    host, port = split_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise EngineProcessEnded(
            f"cannot reach the rollout engine service at {address} ({e.strerror or e}): start it there "
            "with `grouprl engine serve`, or check rollout.engine_address"
        ) from None
    sock.settimeout(None)
    conn = Connection(sock.detach())
    keep_alive(conn)
    try:
        with read_timeout(conn, timeout_s):
            answer_challenge(conn, key)
            deliver_challenge(conn, key)
    except AuthenticationError:
        conn.close()
        raise UserError(f"the rollout engine service at {address} holds another key: set {KEY_ENV} to its key") from None
    except (OSError, EOFError) as e:
        conn.close()
        raise EngineProcessEnded(f"the rollout engine service at {address} did not answer ({e})") from None
    return conn


class EngineProcess:
    """The RolloutEngine the trainer's process talks to (see the module docstring). `model`: the
    trainer-side copy whose weights are pushed; `changing`: the names of the weights an update
    changes (pushed after the first, whole push); `build`: a picklable callable the engine
    process runs to load its copy and engine (called with `device=` the service's, where
    `address` names one); `device`: the trainer's."""

    reads_trainer_weights = False  # RolloutEngine: the engine process holds a copy of its own
    last_sleep_freed_bytes = 0  # a sleep there frees that process's device memory, not measured here

    def __init__(self, model: torch.nn.Module, tokenizer, build: Callable, changing: list[str], device,
                 engine_device=None, address: str | None = None, weights: str | None = None):  # fmt: skip
        self.model, self.tokenizer, self.changing = model, tokenizer, list(changing)
        self._device = torch.device(device)
        self.address, self.process = address, None
        self._lock = threading.RLock()  # one request on the pipe at a time
        self.prefill_tokens = 0
        self.push_seconds = 0.0
        self.policy_version: int | None = None  # RolloutEngine: the version weights_updated named
        self.offers = WeightOffers()  # newer weights offered between turns, pushed from here
        self.running_turns = 0  # sessions' turns in the engine process: offers wait for them
        self._pushed_once = False
        self._sessions = 0
        if address:  # an engine service's, on another machine
            self.conn = connect(address, engine_key())
            hello = {"protocol": PROTOCOL, "version": grouprl.__version__, "trainer_device": str(self._device),
                     "build": pickle.dumps(build)}  # fmt: skip
            self._send("hello", hello)
            first = self._receive(START_TIMEOUT_S, starting=True)
            here = local_address(self.conn)
        else:  # started here (from the forkserver: grouprl.processes), over a pipe (no port)
            # `weights`: how they travel, where not as weights_backend decides (the tests run the
            # group path, NCCL's, over gloo on a CPU)
            backend = weights or weights_backend(device, engine_device or device)
            self.conn, child = multiprocessing.Pipe()
            self.process = start_fresh(serve, (child, build, backend), "grouprl-engine", PRELOAD)
            child.close()
            first = self._receive(START_TIMEOUT_S, starting=True)
            here = HOST
        self.backend, self.pid = first["backend"], first["pid"]
        self.group = None
        if self.backend != "connection":
            warm = self._device if self.backend == "nccl" else torch.device("cpu")
            self.group, self._store, self.conn = form_group(self.conn, 0, self.backend, warm, here)
        self.eos_token_ids, self.pad_token_id = first["eos_token_ids"], first["pad_token_id"]

    @property
    def device(self) -> torch.device:
        return self._device

    # ------------------------------------------------------------------ the engine interface
    def generate(self, prompts, n, params: SamplingParams, generator: Randomness = None,
                 on_group_done: GroupDone | None = None, images=None) -> list[Generation]:  # fmt: skip
        images_arg = {"images": images} if images is not None else {}
        args = (prompts, n, params, generator, images_arg, on_group_done is not None)
        self.between_turns()
        return self._ask("generate", args, generator, on_group_done)

    def open_session(self, prompts, n, reuse_cache: bool = True, images=None) -> _Session:
        self._sessions += 1
        images_arg = {"images": images} if images is not None else {}
        self._ask("open_session", (self._sessions, prompts, n, reuse_cache, images_arg))
        return _Session(self, self._sessions)

    def offer_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Loaded into `model` and pushed where no turn runs (`between_turns`)."""
        self.offers.put(version, weights)

    def between_turns(self) -> None:
        """No turn of this call runs yet: offered weights are taken (and pushed) unless a
        session's turns still run in the engine process."""
        if self.offers.pending and self.running_turns == 0:
            self.offers.take(self)

    def weights_updated(self, model: torch.nn.Module, version: int | None = None) -> None:
        """Push `model`'s weights (every one the first time, then those an update changes); the
        engine process samples from them as policy version `version`."""
        t0 = time.perf_counter()
        params = dict(model.named_parameters())
        names = list(params) if not self._pushed_once else [n for n in self.changing if n in params]
        tensors = [params[n].detach() for n in names]
        with self._lock:
            self._send("weights", ([(n, tuple(t.shape), t.dtype) for n, t in zip(names, tensors)], version))
            answered = False
            try:
                for t in tensors:
                    t = t.contiguous() if self.backend == "nccl" else t.to("cpu").contiguous()
                    flat = t.reshape(-1).view(torch.uint8)
                    if self.group is None:
                        self.conn.send_bytes(flat.numpy())
                    else:
                        answered = self._push(flat)
            except OSError:  # the connection closed mid-push: the engine has gone
                raise self._ended() from None
            except RuntimeError:  # the other side went away mid-push: say so, not the group's words
                if self._gone(wait_s=5):
                    raise self._ended() from None
                raise
            if not answered:
                self._receive()
        self._pushed_once = True
        self.policy_version = version
        self.push_seconds += time.perf_counter() - t0

    def _push(self, tensor: torch.Tensor) -> bool:
        """One tensor to the engine, waiting on the engine as well as on the group: a kill in the
        middle of a push once left gloo's broadcast waiting on a peer that was gone, so the wait
        ends with the engine's end, or with its error (its last word on the connection). True
        when the engine's answer to the push came during the wait: it may, for the last tensor,
        before this side sees its send complete (the answer is then not waited for again)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self.group.broadcast([tensor], options)
        pause, answered = 1e-4, False
        while not work.is_completed():
            if not self._alive():
                raise self._ended()
            if not answered and self.conn.poll(0):  # its error (raised), or its answer: it has every byte
                self._receive()
                answered = True
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        work.wait()  # raises what the broadcast ended with
        return answered

    def begin_rollout(self) -> None:
        self._ask("begin_rollout", ())

    def end_rollout(self) -> None:
        self._ask("end_rollout", ())

    def close(self) -> None:
        """Stop the engine process (at the run's end; it also ends with the trainer's, and a
        service's engine with its trainer's connection)."""
        if self.process is None:  # a service's: closed once its end closes the connection (its device free)
            with contextlib.suppress(Exception):
                self._ask("close", ())
                if self.conn.poll(30):
                    self.conn.recv()
            self.conn.close()
            return
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self._ask("close", ())
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()

    # ------------------------------------------------------------------ the pipe
    def _ask(self, op: str, args, generator: Randomness = None, on_group: GroupDone | None = None):
        with self._lock:
            self._send(op, args)
            return self._receive(generator=generator, on_group=on_group)

    def _send(self, op: str, args) -> None:
        try:
            self.conn.send((op, args))
        except (BrokenPipeError, OSError):
            raise self._ended() from None

    def _receive(self, timeout_s: float | None = None, *, starting=False, generator=None, on_group=None):
        """The answer to the last request; the groups the engine reports on the way go to
        `on_group`. Raises EngineProcessEnded once the process has ended."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if not self.conn.poll(1.0):
                if not self._alive():
                    raise self._ended()
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineProcessEnded(f"the rollout engine process did not start within {timeout_s:.0f} s")
                continue
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                raise self._ended() from None
            kind = message[0]
            if kind == "group":
                if on_group is not None:
                    on_group(message[1], message[2])
                continue
            if kind == "error":
                _, name, text, trace = message
                where = f" at {self.address}" if self.address else ""
                if name == "EngineProcessEnded":  # a service that cannot take this trainer
                    raise EngineProcessEnded(text)
                if name in ("ModelLoadError", "UserError"):
                    raise ModelLoadError(f"{text} (the rollout engine{where})" if where else text)
                raise EngineProcessError(f"rollout engine process{where}: {name}: {text}\n{trace}")
            if kind == "ready" and starting:
                return message[1]
            _, result, drawn, prefill = message
            if drawn is not None and isinstance(generator, RowStreams):  # the rows' streams went on there
                generator.restore(drawn)
            self.prefill_tokens = prefill
            return result

    def _alive(self) -> bool:
        """A process started here: its liveness; a service's engine is found gone by its connection's end
        (a closed socket, or keep-alive probes unanswered)."""
        return self.process is None or self.process.is_alive()

    def _gone(self, wait_s: float) -> bool:
        """Whether the engine process has ended, waiting up to `wait_s` for its end to show (a
        service's: its connection closed)."""
        if self.process is not None:
            self.process.join(timeout=wait_s)
            return not self.process.is_alive()
        try:
            if self.conn.poll(wait_s):
                self.conn.recv()  # a last word: it is there still
        except (EOFError, OSError):
            return True
        return False

    def _ended(self) -> EngineProcessEnded:
        if self.process is None:
            ended = EngineProcessEnded(
                f"the rollout engine at {self.address} closed the connection (its engine process ended, or the "
                "machine went away: see the engine service's output)"
            )
            ended.resume = f"once the engine service at {self.address} answers (it starts a new engine)"
            return ended
        self.process.join(timeout=5)
        return EngineProcessEnded(f"the rollout engine process ended (exit code {self.process.exitcode})")
