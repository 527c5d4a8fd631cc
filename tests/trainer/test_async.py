"""Asynchronous training (rollout.max_staleness = k): generation runs ahead of the update on a
thread of its own. Fixed lag: step s trains on the rollout of weights max(0, s - k), whatever
the timing, so two runs are the same run and a killed run resumes exactly; newest: batches and
an agent's later turns take the newest weights; either way no batch is staler than k; the
update corrects with the behaviour policy's log-probs; a slow judge no longer holds generation
up; a tiny model still learns."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from tiny import A_FRACTION, LOWER_FRACTION, tiny_model_dir, write_run_config

from grouprl.config import load_config
from grouprl.errors import ConfigError
from grouprl.trainer.trainer import Trainer
from helpers import assert_metrics_agree, assert_weights_agree, train_here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def metrics_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "actor/pg_loss" in line]


def rollouts_of(run):
    return [
        (r["step"], r["uid"], r["sample"], r["response"], r["reward"], r["version"], round(r["advantage"], 6))
        for r in map(json.loads, (run / "rollouts.jsonl").read_text().splitlines())
    ]


COMMON = ["data.val_files=[]", "trainer.save_final=true", "trainer.save_best=false", "actor.dtype=float32"]


def test_fixed_lag_trains_step_s_on_the_weights_of_step_s_minus_k(tmp_path, model_dir):
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    for name in ("a", "b"):
        Trainer(
            load_config(config, [*COMMON, "rollout.max_staleness=2", "trainer.total_steps=5", f"trainer.experiment_name={name}"])
        ).fit()
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    steps = metrics_of(a)
    assert [m["rollout/policy_version"] for m in steps] == [0, 0, 0, 1, 2]
    assert [m["rollout/staleness_max"] for m in steps] == [0, 1, 2, 2, 2]
    assert all(m["rollout/staleness_mean"] == m["rollout/staleness_max"] for m in steps)
    assert {r[5] for r in rollouts_of(a) if r[0] == 4} == {1}  # rollouts.jsonl: each trajectory's version
    # the behaviour policy is not the update's: its log-probs are recorded and correct the loss
    assert all("rollout/is_mean" in m for m in steps)
    assert max(m["rollout/mismatch_max"] for m in steps[1:]) > 1e-3  # older weights sampled them
    assert all(abs(m["rollout/is_mean"] - 1) > 1e-5 for m in steps[2:])  # weights away from 1 reach the loss
    assert all(m["rollout/mismatch_max"] < 1e-4 for m in steps[:1])  # step 1: the very weights that sampled it
    # the schedule does not depend on timing: a second run (this process, same threads) is the same run
    assert rollouts_of(b) == rollouts_of(a)
    wa, wb = (load_file(str(run / "final" / "model.safetensors")) for run in (a, b))
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_no_staleness_is_the_synchronous_loop(tmp_path, model_dir):
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    trainer = Trainer(load_config(config, [*COMMON, "trainer.total_steps=2"]))
    assert trainer.parts.ahead is None
    trainer.fit()
    assert all("rollout/staleness_max" not in m for m in metrics_of(tmp_path / "runs" / "run"))


def test_a_tiny_model_learns_one_step_off_policy(tmp_path, model_dir):
    config = write_run_config(tmp_path, model_dir, reward=A_FRACTION)
    overrides = [*COMMON, "rollout.max_staleness=1", "trainer.total_steps=12", "actor.optim.lr=3e-2", "rollout.n_agent=8"]
    Trainer(load_config(config, overrides)).fit()
    rewards = [m["reward/mean"] for m in metrics_of(tmp_path / "runs" / "run")]
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 > 0.2, rewards


def test_asynchronous_runs_refuse_what_they_cannot_do(tmp_path, model_dir):
    config = write_run_config(tmp_path, model_dir)
    with pytest.raises(ConfigError, match="'rollout.max_staleness' must be >= 0"):
        load_config(config, ["rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="'rollout.sleep_level' must be 0 with rollout.max_staleness > 0"):
        load_config(config, ["rollout.max_staleness=1", "rollout.engine=vllm", "rollout.sleep_level=2"])
    with pytest.raises(ConfigError, match="must be 0 with model.quantization=4bit"):
        load_config(config, ["rollout.max_staleness=1", "model.quantization=4bit", "model.lora.rank=8"])
    with pytest.raises(ConfigError, match="'rollout.engine_process' needs rollout.max_staleness >= 1"):
        load_config(config, ["rollout.engine_process=true"])
    with pytest.raises(ConfigError, match="'rollout.engine_device' is for rollout.engine_process=true"):
        load_config(config, ["rollout.max_staleness=1", "rollout.engine_device=cpu"])
    with pytest.raises(ConfigError, match=r"'rollout.engine_device' must be cpu, cuda or cuda:N \(got 'gpu1'\)"):
        load_config(config, ["rollout.max_staleness=1", "rollout.engine_process=true", "rollout.engine_device=gpu1"])
    with pytest.raises(ConfigError, match="'rollout.engine_address' needs rollout.max_staleness >= 1"):
        load_config(config, ["rollout.engine_address=10.0.0.2:7100"])
    with pytest.raises(ConfigError, match="'rollout.engine_address' and 'rollout.engine_process' name two places"):
        load_config(config, ["rollout.max_staleness=1", "rollout.engine_process=true", "rollout.engine_address=h:7100"])
    with pytest.raises(ConfigError, match=r"'rollout.engine_address' must be host:port \(got 'http://h:7100'\)"):
        load_config(config, ["rollout.max_staleness=1", "rollout.engine_address=http://h:7100"])
    for fine in ("engine-1.cluster:7100", "10.0.0.2:7100", "[fd00::2]:7100"):
        assert load_config(config, ["rollout.max_staleness=1", f"rollout.engine_address={fine}"]).rollout.engine_address == fine


@pytest.mark.slow
def test_one_step_off_policy_two_batches_are_in_flight_at_once(tmp_path, model_dir, monkeypatch):
    """A judge that takes 0.8 s a call. Synchronously a batch is drawn only once the previous
    one's judge calls have all come back: no two batches are ever in flight (started, not yet
    scored) together. One step off policy (fixed lag 1) batches 0 and 1 both sample from the
    starting weights and 2 and 3 from the first two updates', so each pair is generated and
    judged together: half the judge waits leave the critical path. (Batch 3 starts once the second
    update is done, which takes far less than generating batch 2 and its 0.8 s judge wait.)"""
    from grouprl.trainer.step import Collector
    from rewards.judges.fake_server import FakeJudgeServer

    events = []
    start, finish = Collector.start, Collector.finish

    def timed_start(self, step, *args, **kwargs):
        events.append(("start", step, time.perf_counter()))
        return start(self, step, *args, **kwargs)

    def timed_finish(self, pending):
        batch = finish(self, pending)
        events.append(("scored", batch.step, time.perf_counter()))
        return batch

    monkeypatch.setattr(Collector, "start", timed_start)
    monkeypatch.setattr(Collector, "finish", timed_finish)
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    with FakeJudgeServer(latency=0.8).start() as server:
        judge = [
            f"reward.judges=[{{name: j, model: fake, base_url: '{server.base_url}', cache_path: '', "
            "fields: {correctness: 1.0}, scale: 9}]",
            "reward.components=[{name: judge, function: 'judge:j'}]",
            "reward.val_metric=judge",
        ]
        for k in (0, 1):
            events.clear()
            overrides = [*COMMON, *judge, f"rollout.max_staleness={k}", "trainer.total_steps=4", f"trainer.experiment_name=k{k}"]
            Trainer(load_config(config, overrides)).fit()
            at = {(kind, step): t for kind, step, t in events}
            together = [at[("start", j + 1)] < at[("scored", j)] for j in range(3)]  # j and j+1 in flight
            if k == 0:
                assert together == [False] * 3, events
            else:  # whether batch 2 starts before batch 1 is scored is a race of its own: left out
                assert together[0] and together[2], events
                # batch j + 1 samples from version j, made by learning batch j - 1: never before it is scored
                assert all(at[("start", j + 1)] > at[("scored", j - 1)] for j in (1, 2)), events


@pytest.mark.slow
def test_a_killed_fixed_lag_run_resumes_as_the_uninterrupted_one(tmp_path, model_dir):
    """kill -9 while batches generated ahead are in flight (a checkpoint every step): the resumed
    run makes them again from the weights the checkpoint kept, and ends as the run never killed
    did: the same rollouts, metrics and weights."""
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    settings = [*COMMON, "rollout.max_staleness=2", "trainer.total_steps=5", "trainer.save_freq=1", "trainer.keep_last=10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def command(name):
        return [sys.executable, "-m", "grouprl", "train", str(config), *settings, f"trainer.experiment_name={name}"]

    train_here(config, *settings, "trainer.experiment_name=whole")  # as its own process on one thread would
    run = tmp_path / "runs" / "killed"
    proc = subprocess.Popen(command("killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step_3" / "manifest.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its third checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "final").exists()
    resumed = subprocess.run(command("killed"), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    state = json.loads((run / "checkpoints" / "step_3" / "trainer.json").read_text())
    assert sorted(state["ahead_weights"]) == ["1", "2"]  # the versions batches 3 and 4 sample from
    # bitwise: both runs compute on one torch thread (train_here; OMP_NUM_THREADS=1) with the same
    # kernels, so every sum is taken in the same order; a resume must not change a bit
    assert rollouts_of(run) == rollouts_of(tmp_path / "runs" / "whole")
    drop = ("time/", "perf/")
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(drop)}  # noqa: E731
    assert [keep(m) for m in metrics_of(run)] == [keep(m) for m in metrics_of(tmp_path / "runs" / "whole")]
    wa, wb = (load_file(str(r / "final" / "model.safetensors")) for r in (run, tmp_path / "runs" / "whole"))
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True])
def test_newest_weights_reach_an_agent_between_its_turns(tmp_path, model_dir, index_dir, monkeypatch, engine_process):
    """async_schedule=newest with the agent loop: a version the update publishes while a batch's
    agents are between turns is offered to the engine and taken where none of its turns runs (a
    partial rollout), each turn records the version it sampled from, and the trajectory's version
    is its first turn's. In an engine process the turns' contexts stay there while the new
    weights arrive. The agent learns of it from its turns' generations alone."""
    from grouprl.rollout.engines.hf import HFEngine
    from grouprl.rollout.engines.process import EngineProcess
    from grouprl.trainer.step import Collector

    started, admissions, waited = [], {}, []
    real_start = Collector.start

    def start(self, step, *args, **kwargs):
        started.append(step)
        return real_start(self, step, *args, **kwargs)

    def waiting_for_an_offer(real):
        def between_turns(self):
            """At the third batch's second admission of turns, wait (a little) for the update's offer."""
            batch = started[-1] if started else None
            admissions[batch] = admissions.get(batch, 0) + 1
            if batch == 3 and admissions[batch] == 2:
                deadline = time.monotonic() + 30
                while not self.offers.pending and time.monotonic() < deadline:
                    time.sleep(0.05)
                waited.append(self.offers.pending)
            return real(self)

        return between_turns

    monkeypatch.setattr(Collector, "start", start)
    for engine_class in (HFEngine, EngineProcess):
        monkeypatch.setattr(engine_class, "between_turns", waiting_for_an_offer(engine_class.between_turns))
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    overrides = [
        "agent.enabled=true", f"agent.retriever.index={index_dir}", "agent.max_turns=2", "agent.answer_generator=none",
        "rollout.max_response_length=8", "data.max_prompt_length=2048", *COMMON, "trainer.save_final=false",
        "rollout.max_staleness=1", "rollout.async_schedule=newest", "trainer.total_steps=4",
        f"rollout.engine_process={str(engine_process).lower()}",
    ]  # fmt: skip
    Trainer(load_config(config, overrides)).fit()
    records = [json.loads(line) for line in (tmp_path / "runs" / "run" / "rollouts.jsonl").read_text().splitlines()]
    partial = [r for r in records if len({t["version"] for t in r["turns"]}) > 1]
    assert waited == [True] and partial, (waited, sorted({(r["step"], tuple(t.get("version") for t in r["turns"])) for r in records}))
    for r in partial:
        versions = [t["version"] for t in r["turns"]]
        assert versions == sorted(versions) and r["version"] == versions[0]
    for m in metrics_of(tmp_path / "runs" / "run"):
        assert m["rollout/staleness_max"] <= 1


def test_a_synchronous_checkpoint_resumes_asynchronously_from_its_own_weights(tmp_path, model_dir, caplog):
    """No weights of older versions in the checkpoint (a synchronous run's): the first batches
    sample from the resumed weights, with a line saying so, and the lag builds up again."""
    import logging

    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    Trainer(load_config(config, [*COMMON, "trainer.total_steps=2"])).fit()
    caplog.set_level(logging.WARNING)
    Trainer(load_config(config, [*COMMON, "trainer.total_steps=5", "rollout.max_staleness=2"])).fit()
    assert any("holds no weights of version(s) 0, 1" in r.getMessage() for r in caplog.records)
    steps = metrics_of(tmp_path / "runs" / "run")
    assert [m["rollout/policy_version"] for m in steps[2:]] == [2, 2, 2]  # steps 3, 4, 5: batches 2, 3, 4


def test_a_judge_that_stops_answering_stops_an_asynchronous_run_saved(tmp_path, model_dir):
    """The scorer thread's JudgeUnavailableError reaches the trainer (no hang): the run saves the
    steps done and stops with the judge's line."""
    from grouprl.rewards.failures import JudgeUnavailableError
    from rewards.judges.fake_server import FakeJudgeServer, Reply

    down = threading.Event()

    def behaviour(call):
        return Reply(kind="status", status=503, body="overloaded") if down.is_set() else Reply()

    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    with FakeJudgeServer(behaviour=behaviour).start() as server:
        overrides = [
            *COMMON, "rollout.max_staleness=1", "trainer.total_steps=6",
            f"reward.judges=[{{name: j, model: fake, base_url: '{server.base_url}', cache_path: '', "
            "fields: {correctness: 1.0}, scale: 9, max_retries: 0}]",
            "reward.components=[{name: judge, function: 'judge:j'}]", "reward.val_metric=judge",
        ]  # fmt: skip
        trainer = Trainer(load_config(config, overrides))
        step = trainer.train_step

        def step_then_the_judge_goes_down():
            out = step()
            if trainer.step == 2:
                down.set()
            return out

        trainer.train_step = step_then_the_judge_goes_down
        started = time.monotonic()
        with pytest.raises(JudgeUnavailableError, match="judge 'j' failed") as stopped:
            trainer.fit()
    assert time.monotonic() - started < 120
    assert "saved" in str(stopped.value) and 2 <= trainer.step < 6


@pytest.fixture(scope="module")
def thread_run(tmp_path_factory, model_dir):
    """One step off policy with the engine on a thread: what an engine elsewhere must repeat."""
    root = tmp_path_factory.mktemp("where")
    config = write_run_config(root, model_dir, reward=LOWER_FRACTION)
    Trainer(engine_settings(config, "thread")).fit()
    return config, root / "runs" / "thread"


def engine_settings(config, name, *extra):
    overrides = [*COMMON, "rollout.max_staleness=1", "trainer.total_steps=4", f"trainer.experiment_name={name}"]
    return load_config(config, [*overrides, *extra])


@pytest.mark.slow
@pytest.mark.parametrize("where", ["process", "service"])
def test_an_engine_process_fed_over_torch_distributed_samples_what_the_thread_does(thread_run, where, tmp_path, monkeypatch):
    """rollout.engine_process (spawned beside the trainer) or rollout.engine_address (a process
    of `grouprl engine serve`, as on another machine): the engine that generates ahead runs in
    a process of its own, loaded from the same files, its weights broadcast over a two-process
    gloo group after each update (all of them first, then the trainable ones), row streams
    travelling with each request. One step off policy (fixed lag) it is the run of the engine
    on a thread: the same rollouts, versions, updates and weights, here through a kill: the
    engine process killed once step 2 is learned stops the run with one line, saved, and the
    same command resumes it (a new engine process) to the thread's end."""
    from grouprl.rollout.engines.process import EngineProcessEnded
    from helpers import ENGINE_KEY, start_engine_service

    config, thread = thread_run
    run = thread.parent / where
    if where == "service":
        address, service = start_engine_service(tmp_path / "service.log", devices="cpu")
        monkeypatch.setenv("GROUPRL_ENGINE_KEY", ENGINE_KEY)
        extra = [f"rollout.engine_address={address}"]
        resume = f"run the same command to resume once the engine service at {address} answers (it starts a new engine)"
        ended = f"the rollout engine at {address} closed the connection ("
    else:
        extra = ["rollout.engine_process=true"]
        resume = "run the same command to resume (a new engine process starts)"
        ended = "the rollout engine process ended (exit code -9); saved "
    try:
        # killed once step 2 is learned (batch 3, from version 2's weights, waits for their push)
        killed = Trainer(engine_settings(config, where, *extra))
        engine = killed.parts.ahead.engine
        assert type(engine).__name__ == "EngineProcess" and engine.pid != os.getpid()

        def kill_after_step_two():
            deadline = time.monotonic() + 120
            while killed.step < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(engine.pid, signal.SIGKILL)

        threading.Thread(target=kill_after_step_two, daemon=True).start()
        with pytest.raises(EngineProcessEnded) as stopped:
            killed.fit()
        assert engine.push_seconds > 0  # versions 0 and 1 went over before the kill
        message = str(stopped.value)
        assert "\n" not in message and message.startswith(ended) and resume in message
        resumed = Trainer(engine_settings(config, where, *extra))
        resumed.fit()
        if where == "process":
            assert not resumed.parts.ahead.engine.process.is_alive()  # ended with the run
    finally:
        if where == "service":
            service.send_signal(signal.SIGTERM)
            assert service.wait(timeout=60) == 0
    # The engine elsewhere computes on other threads (half the cores beside the trainer, one in
    # the service) than the engine on the trainer's thread: its log-probs, and through the
    # importance correction the updates, are the same numbers summed in another order. Sampled
    # tokens are equal (a draw would have to land within some ulps of a boundary of the CDF to
    # change); the metrics and weights agree within float32 reordering and Adam's noise.
    assert rollouts_of(run) == rollouts_of(thread) and len({r[3] for r in rollouts_of(thread)}) > 10
    assert_metrics_agree(metrics_of(run), metrics_of(thread))
    wa, wb = (load_file(str(r / "final" / "model.safetensors")) for r in (thread, run))
    assert_weights_agree(wb, wa)
    if where == "service":  # the key lives in the environment only: no file of the run holds it
        assert not [p for p in run.rglob("*") if p.is_file() and ENGINE_KEY.encode() in p.read_bytes()]
        assert "engine on cpu for 127.0.0.1:" in (tmp_path / "service.log").read_text()


@pytest.mark.slow
def test_a_trainer_waiting_long_for_its_batch_says_so_and_where_the_threads_are(monkeypatch, caplog):
    """take() waits as long as the batch takes (a judge may be slow), and says so every
    STILL_WAITING_S: a run that is stuck is not silent. The threads' fault ends the wait."""
    from grouprl.trainer import pipeline

    monkeypatch.setattr(pipeline, "STILL_WAITING_S", 1.0)
    release = threading.Event()
    waiting = pipeline.RolloutPipeline.__new__(pipeline.RolloutPipeline)  # the state take() reads
    waiting.cond, waiting.ready, waiting.error, waiting.started, waiting.scored = threading.Condition(), {}, None, 4, 3
    waiting.threads = [
        threading.Thread(target=release.wait, name="grouprl-generate", daemon=True),
        threading.Thread(target=lambda: None, name="grouprl-score"),
    ]
    for thread in waiting.threads:
        thread.start()
    waiting.threads[1].join()

    def fault():  # once take() has said so twice
        deadline = time.monotonic() + 60
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        with waiting.cond:
            waiting.error = RuntimeError("the judge went away")
            waiting.cond.notify_all()

    caplog.set_level("WARNING", logger="grouprl.trainer.pipeline")
    threading.Thread(target=fault, daemon=True).start()
    try:
        with pytest.raises(RuntimeError, match="the judge went away"):
            waiting.take(3)
    finally:
        release.set()
    said = [re.fullmatch(
        r"step 3 has waited (\d+) s for its batch: the next batch to start is 4, the next to be scored 3 "
        r"\(grouprl-generate running, grouprl-score ended\); generation or the rewards \(a judge\?\) are slow, or stuck",
        r.getMessage(),
    ) for r in caplog.records]  # fmt: skip
    assert len(said) == 2 and all(said), [r.getMessage() for r in caplog.records]
    first, second = (int(m.group(1)) for m in said)
    assert 1 <= first and first + 1 <= second  # every STILL_WAITING_S (1 s here), the wait so far
