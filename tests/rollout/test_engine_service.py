"""The rollout engine service (`grouprl engine serve`, a process of its own, here on 127.0.0.1
as it would be on another machine): each trainer that proves the key gets an engine process on
a device of its own that samples what the engine in the trainer's process samples, weights
pushed over the two processes' group reaching it; every way a connection can go wrong is one
line (no key, another key, nobody listening, no free device, the engine killed), and the
service goes on serving: a silent peer holds nobody, a freed device serves the next trainer."""

import functools
import os
import re
import signal
import socket
import time

import pytest
import torch

from grouprl.cli import main
from grouprl.errors import UserError
from grouprl.rollout.engines.base import SamplingParams
from grouprl.rollout.engines.hf import HFEngine
from grouprl.rollout.engines.process import EngineProcess, EngineProcessEnded, split_address
from grouprl.rollout.engines.streams import RowStreams
from helpers import (
    ENGINE_KEY,
    free_port,
    generation_rows,
    random_prompts,
    start_engine_service,
    tiny_model_and_tokenizer,
)

KEY = ENGINE_KEY
SERVICE = {}  # the module's service process: its pid
SAMPLE = SamplingParams(max_new_tokens=6, temperature=1.0)


def build_engine(device):
    """What the service's engine runs (the trainer sends it): the tiny model of seed 0 on `device`."""
    import contextlib

    model, tokenizer = tiny_model_and_tokenizer(dtype=torch.float64, seed=0)
    return HFEngine(model.to(device), tokenizer, report_log_probs=True), model, contextlib.nullcontext


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    log = tmp_path_factory.mktemp("service") / "service.log"
    address, proc = start_engine_service(log)
    SERVICE["pid"] = proc.pid
    yield address, log
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0  # stopped cleanly, its engines with it


@pytest.fixture(scope="module")
def local():
    model, tokenizer = tiny_model_and_tokenizer(dtype=torch.float64, seed=0)
    return HFEngine(model, tokenizer, report_log_probs=True)


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("GROUPRL_ENGINE_KEY", KEY)


def connect(local, address) -> EngineProcess:
    changing = [name for name, _ in local.model.named_parameters() if "layers.1." in name]
    return EngineProcess(local.model, local.tokenizer, build_engine, changing, "cpu", address=address)


@pytest.mark.slow
def test_a_service_engine_samples_what_the_engine_here_does(service, local, key):
    address, _ = service
    silent = socket.create_connection(split_address(address))
    remote = connect(local, address)  # the silent peer before it holds nobody
    try:
        assert remote.process is None and remote.backend == "connection" and remote.pid != os.getpid()
        prompts = random_prompts([3, 5, 2], len(local.tokenizer), seed=4)
        remote.weights_updated(local.model)
        here, there = RowStreams(7, range(6)), RowStreams(7, range(6))
        groups = []
        want = local.generate(prompts, 2, SAMPLE, here)
        got = remote.generate(prompts, 2, SAMPLE, there, on_group_done=lambda i, gens: groups.append((i, generation_rows(gens))))
        assert generation_rows(got) == generation_rows(want) and len({tuple(g.token_ids) for g in want}) > 3
        assert sorted(groups) == [(i, generation_rows(want[2 * i : 2 * i + 2])) for i in range(3)]
        assert (there.state() == here.state()).all()
        # new weights (the changing ones) reach the engine there before the next request
        original = {n: p.detach().clone() for n, p in local.model.named_parameters()}
        try:
            with torch.no_grad():
                for name, p in local.model.named_parameters():
                    if "layers.1." in name:
                        p.mul_(3.0)
            remote.weights_updated(local.model)
            moved = generation_rows(local.generate(prompts, 2, SAMPLE, here))
            assert generation_rows(remote.generate(prompts, 2, SAMPLE, there)) == moved
        finally:
            with torch.no_grad():
                for name, p in local.model.named_parameters():
                    p.copy_(original[name])
    finally:
        remote.close()
        silent.close()


@pytest.mark.slow
def test_each_trainer_gets_an_engine_of_its_own_until_the_devices_run_out(service, local, key):
    address, log = service
    first, second = connect(local, address), connect(local, address)
    try:
        assert first.pid != second.pid
        with pytest.raises(EngineProcessEnded, match=r"has no free device \(its 2 engines, on cpu, cpu, each serve a trainer\)"):
            connect(local, address)
    finally:
        first.close()
    third = connect(local, address)  # the device the first freed
    third.conn.close()  # a trainer gone without a word (killed): its engine ends, its device frees
    fourth = connect(local, address)
    fourth.close()
    second.close()
    assert re.search(r"engine on cpu for 127\.0\.0\.1:\d+ ended \(exit code 0\)", log.read_text())


def test_an_engine_killed_there_is_one_line_and_the_next_trainer_gets_a_new_one(service, local, key):
    address, _ = service
    remote = connect(local, address)
    remote.weights_updated(local.model)
    os.kill(remote.pid, signal.SIGKILL)  # an engine that ran out of memory, say
    started = time.monotonic()
    with pytest.raises(EngineProcessEnded) as ended:
        remote.generate(random_prompts([3], len(local.tokenizer), seed=1), 2, SAMPLE, RowStreams(1, range(2)))
    assert time.monotonic() - started < 10
    assert str(ended.value) == (
        f"the rollout engine at {address} closed the connection (its engine process ended, or the machine went "
        "away: see the engine service's output)"
    )
    assert ended.value.resume == f"once the engine service at {address} answers (it starts a new engine)"
    remote.close()
    again = connect(local, address)
    again.close()


def test_the_key_and_the_address_are_one_line_each(service, local, monkeypatch):
    address, log = service
    monkeypatch.delenv("GROUPRL_ENGINE_KEY", raising=False)
    with pytest.raises(UserError, match=r"^set GROUPRL_ENGINE_KEY to a secret of your choosing on both machines"):
        connect(local, address)
    monkeypatch.setenv("GROUPRL_ENGINE_KEY", "not-" + KEY)
    with pytest.raises(UserError) as refused:
        connect(local, address)
    assert str(refused.value) == (
        f"the rollout engine service at {address} holds another key: set GROUPRL_ENGINE_KEY to its key"
    )
    assert KEY not in str(refused.value) and KEY not in log.read_text()
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(EngineProcessEnded) as unreachable:
        connect(local, nobody)
    assert str(unreachable.value) == (
        f"cannot reach the rollout engine service at {nobody} (Connection refused): start it there with "
        "`grouprl engine serve`, or check rollout.engine_address"
    )
    monkeypatch.setenv("GROUPRL_ENGINE_KEY", KEY[:31])  # a key short enough to guess from its HMAC
    with pytest.raises(UserError, match=r"^GROUPRL_ENGINE_KEY has 31 characters; use at least 32"):
        connect(local, address)
    monkeypatch.setenv("GROUPRL_ENGINE_KEY", KEY)
    connect(local, address).close()  # the service went on serving
    assert "does not hold the key (digest received was wrong)" in log.read_text()


def test_serve_refuses_what_it_cannot_serve_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("GROUPRL_ENGINE_KEY", KEY)
    assert main(["engine", "serve", "--devices", "cpu,gpu:1", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == "grouprl: error: --devices: 'gpu:1' is not cpu, cuda or cuda:N"
    if not torch.cuda.is_available():
        assert main(["engine", "serve", "--devices", "cpu,cuda:0", "--port", "0"]) == 2
        assert capsys.readouterr().err.strip() == "grouprl: error: --devices: cuda:0 is not on this machine (0 CUDA devices visible)"
    monkeypatch.delenv("GROUPRL_ENGINE_KEY")
    assert main(["engine", "serve", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip().startswith("grouprl: error: set GROUPRL_ENGINE_KEY")
    monkeypatch.setenv("GROUPRL_ENGINE_KEY", KEY)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["engine", "serve", "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip() == f"grouprl: error: cannot listen on 127.0.0.1:{port}: Address already in use"


# ------------------------------------------------------------------------- what can be reached
def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses the process `pid` and its children listen on (as `ss -ltnp` shows)."""
    import psutil

    process = psutil.Process(pid)
    found = set()
    for p in [process, *process.children(recursive=True)]:
        try:
            found |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    return found


def test_nothing_but_the_services_own_port_listens_and_the_weights_go_over_the_connection(service, local, key):
    """The service's --host:port is the only port its process tree listens on while an engine
    serves a trainer and takes its weights (the two processes' TCPStore and gloo group once
    listened on every interface, keyless); the trainer's side opens none either."""
    address, _ = service
    host, port = split_address(address)
    service_pid = SERVICE["pid"]
    here_before = listening(os.getpid())
    remote = connect(local, address)
    try:
        remote.weights_updated(local.model)  # every weight, over the connection
        remote.generate(random_prompts([3], len(local.tokenizer), seed=5), 1, SAMPLE, RowStreams(1, [0]))
        assert listening(service_pid) == {(host, port)}
        assert listening(os.getpid()) == here_before
    finally:
        remote.close()


@pytest.mark.slow
def test_an_engine_process_here_listens_on_nothing(local):
    before = listening(os.getpid())
    remote = EngineProcess(local.model, local.tokenizer, functools.partial(build_engine, "cpu"), [], "cpu")
    try:
        remote.weights_updated(local.model)
        assert remote.backend == "connection" and listening(remote.process.pid) == set()
        assert listening(os.getpid()) == before
    finally:
        remote.close()


@pytest.fixture
def quick_service(monkeypatch, key):
    """An engine service in this process (1 s for a whole handshake), serving on a thread."""
    import threading

    import grouprl.rollout.engines.service as service_module

    monkeypatch.setattr(service_module, "HANDSHAKE_TIMEOUT_S", 1.0)

    def start(host="127.0.0.1"):
        running = service_module.EngineService(host, 0, ["cpu"])
        threading.Thread(target=running.serve_forever, daemon=True).start()
        started.append(running)
        return running

    started = []
    yield start
    for running in started:
        running.stop()


def test_a_peer_trickling_bytes_is_dropped_at_the_handshakes_deadline(quick_service, caplog):
    import struct

    running = quick_service()
    with socket.create_connection(("127.0.0.1", running.port)) as peer:
        assert peer.recv(1024)[4:].startswith(b"#CHALLENGE#")
        t0 = time.monotonic()
        peer.sendall(struct.pack("!i", 200))  # an answer of 200 bytes is coming... a byte at a time
        peer.settimeout(0.2)
        closed = False
        while not closed and time.monotonic() - t0 < 10:  # one byte now and then kept it 30 s a read
            try:
                peer.sendall(b"x")
                closed = peer.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed and time.monotonic() - t0 < 3  # the whole handshake's 1 s, not 30 s per read
    deadline = time.monotonic() + 5
    while running.handshakes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running.handshakes == {}


def test_a_silent_peer_is_dropped_at_the_key_proofs_deadline_a_keyed_one_has_the_handshakes(quick_service, monkeypatch):
    """Four silent connections from one address fill its share of handshakes: they hold it for
    KEY_PROOF_S (here 0.5 s), not for the whole handshake's deadline (here 30 s, as served); a
    peer that proved the key and is slow with its hello is still heard after that."""
    import pickle
    from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

    import grouprl.rollout.engines.service as service_module

    monkeypatch.setattr(service_module, "KEY_PROOF_S", 0.5)
    monkeypatch.setattr(service_module, "HANDSHAKE_TIMEOUT_S", 30.0)
    running = quick_service()
    t0 = time.monotonic()
    silent = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(service_module.MAX_PER_PEER)]
    try:
        for s in silent:
            s.settimeout(5)
            assert s.recv(1024)[4:].startswith(b"#CHALLENGE#")
        for s in silent:  # each closed by the service once its 0.5 s to prove the key ran out
            assert s.recv(1024) == b""
        assert time.monotonic() - t0 < 3
    finally:
        for s in silent:
            s.close()
    deadline = time.monotonic() + 2
    while running.handshakes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running.handshakes == {}
    with socket.create_connection(("127.0.0.1", running.port)) as sock:
        conn = Connection(os.dup(sock.fileno()))
        answer_challenge(conn, KEY.encode())
        deliver_challenge(conn, KEY.encode())
        time.sleep(1.0)  # past the key proof's deadline, inside the handshake's
        conn.send_bytes(pickle.dumps(("hello", {"protocol": -1, "version": "0.0"})))
        assert conn.poll(5)
        kind, _, why, _ = conn.recv()
        conn.close()
    assert kind == "error" and "runs grouprl" in why and "the trainer 0.0" in why


@pytest.mark.slow
def test_silent_connections_cannot_crowd_out_a_trainer(quick_service, local):
    """At most 4 handshakes from one address: a fifth is closed at once, while a trainer from
    another address (127.0.0.2, loopback too) still gets its engine."""
    import grouprl.rollout.engines.service as service_module

    running = quick_service()
    silent = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(service_module.MAX_PER_PEER)]
    try:
        for s in silent:
            assert s.recv(1024)[4:].startswith(b"#CHALLENGE#")  # each is in its handshake
        with socket.create_connection(("127.0.0.1", running.port)) as fifth:
            fifth.settimeout(0.5)
            assert fifth.recv(1024) == b""  # closed, not handshaking
        assert running.handshakes == {"127.0.0.1": service_module.MAX_PER_PEER}
        # another address is still served while the four wait
        with socket.create_connection(("127.0.0.1", running.port), source_address=("127.0.0.2", 0)) as other:
            assert other.recv(1024)[4:].startswith(b"#CHALLENGE#")
    finally:
        for s in silent:
            s.close()
    time.sleep(1.5)  # their deadline
    assert running.handshakes == {}
    remote = connect(local, f"127.0.0.1:{running.port}")
    try:
        prompts = random_prompts([3], len(local.tokenizer), seed=11)
        remote.weights_updated(local.model)
        assert generation_rows(remote.generate(prompts, 1, SAMPLE, RowStreams(1, [0]))) == generation_rows(
            local.generate(prompts, 1, SAMPLE, RowStreams(1, [0]))
        )
    finally:
        remote.close()


@pytest.mark.slow
def test_an_ipv6_address_is_served(quick_service, local):
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    running = quick_service("::1")
    remote = connect(local, f"[::1]:{running.port}")
    try:
        remote.weights_updated(local.model)
        prompts = random_prompts([4], len(local.tokenizer), seed=12)
        assert generation_rows(remote.generate(prompts, 1, SAMPLE, RowStreams(1, [0]))) == generation_rows(
            local.generate(prompts, 1, SAMPLE, RowStreams(1, [0]))
        )
    finally:
        remote.close()
