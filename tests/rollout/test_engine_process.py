"""The engine in a process of its own (rollout.engine_process) against the same engine in this
process: the same samples from the same row streams, single calls and turns, each group handed
back as it ends, weights pushed between turns reaching the next turn (the contexts stay there),
an error there raised here with its traceback (the process goes on), and a process that ends
one error naming its exit code, never a wait. Also how the weights travel (over the pipe, or a
group: NCCL's between GPUs), and a push whose answer comes before this side sees its last send
complete."""

import contextlib
import functools
import os
import threading
import time

import pytest
import torch

from grouprl.processes import start_server
from grouprl.rollout.engines.base import SamplingParams
from grouprl.rollout.engines.hf import HFEngine
from grouprl.rollout.engines.process import (
    PRELOAD,
    EngineProcess,
    EngineProcessEnded,
    EngineProcessError,
    weights_backend,
)
from grouprl.rollout.engines.streams import RowStreams
from helpers import generation_rows, random_prompts, tiny_model_and_tokenizer

SAMPLE = SamplingParams(max_new_tokens=6, temperature=1.0)


def build_engine():
    """What the engine process runs: the tiny model of seed 0 (the one the tests build here)."""
    model, tokenizer = tiny_model_and_tokenizer(dtype=torch.float64, seed=0)
    return HFEngine(model, tokenizer, report_log_probs=True), model, contextlib.nullcontext


@pytest.fixture(scope="module")
def local():
    model, tokenizer = tiny_model_and_tokenizer(dtype=torch.float64, seed=0)
    return HFEngine(model, tokenizer, report_log_probs=True)


@pytest.fixture(scope="module")
def remote(local):
    changing = [name for name, _ in local.model.named_parameters() if "layers.1." in name]
    engine = EngineProcess(local.model, local.tokenizer, build_engine, changing, "cpu")
    yield engine
    engine.close()


def test_weights_travel_by_nccl_between_two_gpus_only():
    assert weights_backend("cpu", "cpu") == "connection"
    assert weights_backend("cuda:0", "cuda:1") == "nccl"
    assert weights_backend("cuda:1", "cuda:0") == "nccl"
    assert weights_backend("cuda", "cuda:0") == "connection"  # one GPU: one NCCL rank per device
    assert weights_backend("cuda:0", "cpu") == weights_backend("cpu", "cuda:0") == "connection"


@pytest.mark.slow
def test_the_same_samples_and_groups_as_the_engine_here(local, remote):
    prompts = random_prompts([3, 5, 2], len(local.tokenizer), seed=4)
    assert remote.eos_token_ids == local.eos_token_ids and remote.pad_token_id == local.pad_token_id
    remote.weights_updated(local.model)  # the first push: every weight
    here, there = RowStreams(7, range(6)), RowStreams(7, range(6))
    groups = []
    want = local.generate(prompts, 2, SAMPLE, here)
    got = remote.generate(prompts, 2, SAMPLE, there, on_group_done=lambda i, gens: groups.append((i, generation_rows(gens))))
    assert generation_rows(got) == generation_rows(want) and len({tuple(g.token_ids) for g in want}) > 3
    assert sorted(groups) == [(i, generation_rows(want[2 * i : 2 * i + 2])) for i in range(3)]  # each group, as it ended
    assert (there.state() == here.state()).all() and here.state().sum() > 0  # the streams went on as here
    # a second call continues the streams where the first left them
    assert generation_rows(remote.generate(prompts, 2, SAMPLE, there)) == generation_rows(local.generate(prompts, 2, SAMPLE, here))


def test_the_engine_process_answers_what_callers_ask(local, remote):
    from grouprl.rollout.engines.base import RolloutEngine

    assert isinstance(remote, RolloutEngine)  # every member of the interface
    assert remote.reads_trainer_weights is False and remote.last_sleep_freed_bytes == 0
    pushed = remote.push_seconds
    remote.weights_updated(local.model)
    assert remote.push_seconds > pushed


def test_turns_keep_their_contexts_there_while_new_weights_arrive(local, remote):
    prompts = random_prompts([4, 2], len(local.tokenizer), seed=5)
    remote.weights_updated(local.model)
    original = {n: p.detach().clone() for n, p in local.model.named_parameters()}
    here, there = RowStreams(3, range(4)), RowStreams(3, range(4))
    a, b = local.open_session(prompts, 2), remote.open_session(prompts, 2)
    assert generation_rows(b.generate([0, 1, 2, 3], [[]] * 4, SAMPLE, there)) == generation_rows(a.generate([0, 1, 2, 3], [[]] * 4, SAMPLE, here))
    try:
        with torch.no_grad():  # an update of the weights the push sends after the first (layer 1's)
            for name, p in local.model.named_parameters():
                if "layers.1." in name:
                    p.add_(0.05 * torch.randn_like(p))
        remote.weights_updated(local.model)
        local.weights_updated(local.model)
        turn = [[5, 6], [7], [8, 9, 10]]
        want = a.generate([0, 2, 3], turn, SAMPLE, here)
        got = b.generate([0, 2, 3], turn, SAMPLE, there)
        assert generation_rows(got) == generation_rows(want)
        b.release(1)
    finally:
        with torch.no_grad():
            for name, p in local.model.named_parameters():
                p.copy_(original[name])
        remote.weights_updated(local.model)


def test_an_error_there_is_raised_here_and_the_process_goes_on(local, remote):
    with pytest.raises(EngineProcessError, match=r"rollout engine process: \w+Error") as raised:
        remote.generate([[1000000]], 1, SAMPLE)  # a token id past the vocabulary
    assert "Traceback" in str(raised.value)
    prompts = random_prompts([3], len(local.tokenizer), seed=6)
    assert generation_rows(remote.generate(prompts, 1, SAMPLE, RowStreams(1, [0]))) == generation_rows(
        local.generate(prompts, 1, SAMPLE, RowStreams(1, [0]))
    )


@pytest.mark.slow
def test_a_process_that_ends_is_one_error_not_a_wait(local):
    engine = EngineProcess(local.model, local.tokenizer, build_engine, [], "cpu")
    engine.process.kill()
    engine.process.join(timeout=10)
    with pytest.raises(EngineProcessEnded, match=r"^the rollout engine process ended \(exit code -9\)$"):
        engine.generate([[3, 4]], 1, SAMPLE)
    with pytest.raises(EngineProcessEnded, match="exit code -9"):
        engine.weights_updated(local.model)
    engine.close()  # nothing left to stop


class LateLastSend:
    """The weights' group as a busy machine can show it: the push's last broadcast seen complete
    here only after the engine has answered the push (it has every byte by then)."""

    def __init__(self, group, conn, sends: int):
        self.group, self.conn, self.left = group, conn, sends

    def broadcast(self, tensors, options):
        self.left -= 1
        work = self.group.broadcast(tensors, options)
        return LateWork(work, self.conn) if self.left == 0 else work


class LateWork:
    """Complete 50 ms after the engine's answer was first seen waiting (20 s if it never is)."""

    def __init__(self, work, conn):
        self.work, self.conn, self.since, self.answer_seen = work, conn, time.monotonic(), None

    def is_completed(self):
        if self.answer_seen is None and self.conn.poll(0):
            self.answer_seen = time.monotonic()
        late = self.answer_seen is not None and time.monotonic() - self.answer_seen > 0.05
        return self.work.is_completed() and (late or time.monotonic() - self.since > 20)

    def wait(self):
        return self.work.wait()


@pytest.mark.slow
def test_an_answer_that_comes_before_the_last_send_shows_complete_ends_the_push(local):
    """The push's answer read while it waited on its last send is its answer (it was once read
    there and then waited for again: a run that never ended). The group path (NCCL's between
    GPUs) runs here over gloo, its rendezvous carried over the pipe."""
    changing = [name for name, _ in local.model.named_parameters() if "layers.1." in name]
    engine = EngineProcess(local.model, local.tokenizer, build_engine, changing, "cpu", weights="gloo")
    assert engine.backend == "gloo" and sorted(engine._store.keys) == ["0/0", "0/1"]  # the rendezvous, here
    try:
        engine.weights_updated(local.model)  # the first, whole push
        engine.group = LateLastSend(engine.group, engine.conn, len(changing))
        push = threading.Thread(target=engine.weights_updated, args=(local.model,), daemon=True)
        push.start()
        push.join(timeout=60)
        assert not push.is_alive(), "the push waited for an answer it had read"
        assert engine.group.left == 0  # every changing weight went by the group
        prompts = random_prompts([3, 4], len(local.tokenizer), seed=8)
        assert generation_rows(engine.generate(prompts, 2, SAMPLE, RowStreams(2, range(4)))) == generation_rows(
            local.generate(prompts, 2, SAMPLE, RowStreams(2, range(4)))
        )
    finally:
        engine.process.kill()  # a push still waiting (a failure) sees the end and returns
        engine.close()


def build_seeing(name, value):
    """build_engine, where the environment has `name` = `value` (else the start fails)."""
    if os.environ.get(name) != value:
        raise RuntimeError(f"{name} is {os.environ.get(name)!r} here")
    return build_engine()


@pytest.mark.slow
def test_an_engine_takes_the_environment_of_its_start(local, monkeypatch):
    """Engines fork from a server that imported torch once, maybe before the environment
    changed (a variable set since): the engine still sees the trainer's environment as it is."""
    start_server(PRELOAD)
    monkeypatch.setenv("GROUPRL_TEST_SET_LATE", "yes")
    engine = EngineProcess(local.model, local.tokenizer, functools.partial(build_seeing, "GROUPRL_TEST_SET_LATE", "yes"), [], "cpu")
    try:
        engine.weights_updated(local.model)
        prompts = random_prompts([3], len(local.tokenizer), seed=9)
        assert generation_rows(engine.generate(prompts, 1, SAMPLE, RowStreams(1, [0]))) == generation_rows(
            local.generate(prompts, 1, SAMPLE, RowStreams(1, [0]))
        )
    finally:
        engine.close()
