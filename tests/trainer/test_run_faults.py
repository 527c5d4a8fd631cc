"""What goes wrong in a long run: a writer killed mid-write (its temp folders are swept when
the run starts again), a judge that stops answering (the run saves and stops with one line,
and resumes once the judge is back), and groups dropped for failed judge calls on several
ranks (decided over every rank; the kept groups shared out again, padded where they do not
split evenly, so the run equals one process's)."""

import json
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file
from test_parallel import SETTINGS, records, train
from tiny import LOWER_FRACTION, tiny_model_dir, write_reward, write_run_config

import grouprl.trainer.checkpoint as checkpoint_module
from grouprl.config import load_config
from grouprl.rewards.failures import JudgeUnavailableError, RewardFailingError
from grouprl.trainer.checkpoint import MANIFEST, CheckpointManager, problem
from grouprl.trainer.trainer import Trainer
from helpers import REORDERED, free_port
from rewards.judges.fake_server import FakeJudgeServer, Reply


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def rollout_records(run_dir):
    return [
        (r["step"], r["uid"], r["sample"], r["response"], r["reward"], round(r["advantage"], 5))
        for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())
    ]


def test_a_restarted_run_sweeps_what_killed_writers_left(tmp_path, model_dir, caplog):
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    settings = ["data.val_files=[]", "trainer.save_final=false", "trainer.keep_last=5"]
    Trainer(load_config(config, [*settings, "trainer.total_steps=2"])).fit()
    run = tmp_path / "runs" / "run"
    checkpoints = run / "checkpoints"
    manifest = (checkpoints / "step_2" / MANIFEST).read_text()
    # what writers killed mid-write leave: a checkpoint's temp folder in one process (mkdtemp's
    # name) and on several ranks (one fixed name), exports of final/ and best/
    left = [
        checkpoints / ".tmp-step_3-k2j_9x0a",
        checkpoints / ".tmp-step_4",
        run / ".tmp-final-abcd1234",
        run / ".tmp-best-0_zz9y8x",
    ]
    for folder in left:
        (folder / "sharded").mkdir(parents=True)
        (folder / "sharded" / "model.safetensors").write_bytes(bytes(1_500_000))
    # folders of other names stay, whatever they look like
    others = [
        checkpoints / ".tmp-notes",
        checkpoints / "step_7-tmp",
        run / ".tmp-final-mine",
        run / ".tmp-eval-abcd1234",
        run / "my.tmp-best-abcd1234",
    ]
    for folder in others:
        folder.mkdir()
    caplog.set_level(logging.INFO)
    trainer = Trainer(load_config(config, [*settings, "trainer.total_steps=3"]))
    assert trainer.step == 2  # resumed from the complete checkpoint beside them
    trainer.fit()
    assert not any(folder.exists() for folder in left)
    assert all(folder.is_dir() for folder in others)
    lines = [r.getMessage() for r in caplog.records if "temp folder" in r.getMessage()]
    assert lines == [
        "removed 4 temp folders of writes a stopped run left unfinished (6.0 MB): "
        "checkpoints/.tmp-step_3-k2j_9x0a, checkpoints/.tmp-step_4, .tmp-final-abcd1234, .tmp-best-0_zz9y8x"
    ]
    assert (checkpoints / "step_2" / MANIFEST).read_text() == manifest and problem(checkpoints / "step_2") is None
    assert (checkpoints / "step_3" / MANIFEST).is_file()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_the_sweep_comes_before_the_baseline_evaluation(tmp_path, model_dir, monkeypatch):
    """The baseline evaluation may write best/: the folders a killed run left are gone by then."""
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    stale = tmp_path / "runs" / "run" / ".tmp-best-abcd1234"
    stale.mkdir(parents=True)
    seen = []
    evaluate = Trainer.evaluate

    def watched(self, *args, **kwargs):
        seen.append(stale.exists())
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", watched)
    settings = ["trainer.total_steps=1", "trainer.save_final=false", "trainer.val_before_train=true"]
    Trainer(load_config(config, settings)).fit()
    assert seen[:1] == [False] and not stale.exists()


def small_checkpoints(root, keep_last=2):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return CheckpointManager(root, keep_last), (model, optimizer, scheduler)


def test_a_rank_that_does_not_remove_only_notes_the_sweep(tmp_path):
    manager, _ = small_checkpoints(tmp_path)
    stale = tmp_path / "checkpoints" / ".tmp-step_3"
    stale.mkdir(parents=True)
    assert manager.sweep(remove=False) == [] and manager.swept and stale.is_dir()
    assert CheckpointManager(tmp_path, 2).sweep() == [stale] and not stale.exists()


def test_a_step_saved_again_is_replaced_by_a_rename_and_kept_if_that_fails(tmp_path, monkeypatch):
    manager, parts = small_checkpoints(tmp_path)
    root = tmp_path / "checkpoints"
    manager.save(2, *parts, {"step": 2, "n": 1})
    manager.save(2, *parts, {"step": 2, "n": 2})  # an interrupt right after a save saves it again
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]
    assert json.loads((root / "step_2" / "trainer.json").read_text())["n"] == 2
    replace, into_place = checkpoint_module.os.replace, []

    def fail_into_place(source, target):  # the new folder's rename fails; the old one's way back not
        into_place.append(target.name == "step_2")
        if into_place.count(True) == 1 and into_place[-1]:
            raise OSError("Input/output error")
        return replace(source, target)

    monkeypatch.setattr(checkpoint_module.os, "replace", fail_into_place)
    with pytest.raises(OSError):
        manager.save(2, *parts, {"step": 2, "n": 3})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]  # the old one back in place
    assert json.loads((root / "step_2" / "trainer.json").read_text())["n"] == 2
    assert problem(root / "step_2") is None


def judge_settings(server, **more):
    """reward.judges: one judge "test" on the fake server (no cache, quick retries), `more` set."""
    judge = {
        "name": "test", "model": "fake-judge", "base_url": f"'{server.base_url}'", "cache_path": "''",
        "max_retries": 1, "backoff_base_s": 0.001, "backoff_max_s": 0.01, "fields": "{correctness: 1.0}",
        "scale": 9, **more,
    }  # fmt: skip
    return [f"reward.judges=[{{{', '.join(f'{k}: {v}' for k, v in judge.items())}}}]"]


def overloaded_while(down: threading.Event):
    """A judge behaviour: 503 while `down` is set, else the default answer."""
    return lambda call: Reply(kind="status", status=503, body="overloaded") if down.is_set() else Reply()


def judge_and_lower(tmp_path, server) -> list[str]:
    """Components: the judge on `server` and a rule reward (the held-out metric)."""
    lower = write_reward(tmp_path / "lower.py", LOWER_FRACTION, "lower")
    return [
        *judge_settings(server),
        f"reward.components=[{{name: judge, function: 'judge:test'}}, {{name: lower, function: '{lower}'}}]",
        "reward.val_metric=lower",
    ]


def after_the_next_step(trainer, then) -> None:
    """`then()` runs once the trainer's next step is done (a judge goes down, a reward breaks)."""
    step = trainer.train_step

    def step_then():
        out = step()
        then()
        return out

    trainer.train_step = step_then


def down_after_the_next_step(trainer, down: threading.Event) -> None:
    """The judge stops answering once the trainer's next step is done."""
    after_the_next_step(trainer, down.set)


def test_a_judge_that_stops_answering_stops_the_run_saved_and_it_resumes(tmp_path, model_dir):
    down = threading.Event()
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    with FakeJudgeServer(behaviour=overloaded_while(down)).start() as server:
        settings = [
            "data.sampler=sequential",
            "data.val_files=[]",
            "trainer.total_steps=3",
            "trainer.save_final=false",
            *judge_and_lower(tmp_path, server),
        ]
        Trainer(load_config(config, [*settings, "trainer.experiment_name=whole"])).fit()
        first = Trainer(load_config(config, settings))
        down_after_the_next_step(first, down)
        with pytest.raises(JudgeUnavailableError) as stopped:
            first.fit()
        requests_when_stopped = server.requests
        down.clear()
        second = Trainer(load_config(config, settings))  # the judge answers again
        assert second.step == 1
        second.fit()
    run = tmp_path / "runs" / "run"
    line = str(stopped.value)
    assert line == (
        "judge 'test' failed 8 of 8 calls (more than reward.max_failed_share=0.5; last error: HTTP 503: "
        f"overloaded); saved {run / 'checkpoints' / 'step_1'}: run the same command to resume once the judge answers"
    )
    assert requests_when_stopped > 0 and first.step == 1
    # the step the judge failed in is redone: the run is the one whose judge never failed
    assert rollout_records(run) == rollout_records(tmp_path / "runs" / "whole")
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_judge_down_at_an_evaluation_stops_the_run_saved(tmp_path, model_dir):
    """Held-out figures from fallback scores are no figures: the limits hold for evaluations too,
    and the steps trained before it are saved."""
    down = threading.Event()
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    with FakeJudgeServer(behaviour=overloaded_while(down)).start() as server:
        settings = [
            "trainer.total_steps=2",
            "trainer.test_freq=1",
            "trainer.val_before_train=false",
            "trainer.save_final=false",
            *judge_and_lower(tmp_path, server),
        ]
        trainer = Trainer(load_config(config, settings))
        down_after_the_next_step(trainer, down)
        with pytest.raises(JudgeUnavailableError) as stopped:
            trainer.fit()
    saved = tmp_path / "runs" / "run" / "checkpoints" / "step_1"
    assert str(stopped.value) == (
        "held-out evaluation: judge 'test' failed 4 of 4 calls (more than reward.max_failed_share=0.5; "
        f"last error: HTTP 503: overloaded); saved {saved}: run the same command to resume once the judge answers"
    )
    assert problem(saved) is None and json.loads((saved / "trainer.json").read_text())["step"] == 1


def test_a_judge_failing_calls_in_a_row_stops_the_run_before_the_first_step(tmp_path, model_dir):
    """Calls time out one at a time; after 2 in a row the judge's other calls are not sent."""
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    with FakeJudgeServer(behaviour=lambda call: Reply(kind="hang")).start() as server:
        settings = [
            "data.val_files=[]",
            *judge_settings(server, timeout_s=0.2, max_retries=0, max_concurrent_requests=1),
            "reward.components=[{name: judge, function: 'judge:test'}]",
            "reward.val_metric=judge",
            "reward.max_consecutive_failures=2",
            "reward.max_failed_share=1",
        ]
        trainer = Trainer(load_config(config, settings))
        with pytest.raises(JudgeUnavailableError) as stopped:
            trainer.fit()
        assert server.requests == 2  # of the step's 8 calls
    assert str(stopped.value) == (
        "judge 'test' failed 2 calls in a row (reward.max_consecutive_failures=2; last error: timed out after "
        "0.2s); nothing trained yet to save"
    )
    assert not (tmp_path / "runs" / "run" / "checkpoints").exists()


def test_a_reward_that_fails_on_every_call_stops_the_run_in_its_step_saved(tmp_path, model_dir):
    """A reward function that breaks (here: it starts reading a column the data lacks) stops the
    run in the step it breaks in, with one line naming the component and its first error, the
    steps before saved; failing from the first step, nothing is trained on its fallback zeros."""
    broken = tmp_path / "broken"
    reward = f"kwargs['extra_info']['solution'] if __import__('os').path.exists(r'{broken}') else {LOWER_FRACTION}"
    config = write_run_config(tmp_path, model_dir, reward=reward)
    settings = ["data.val_files=[]", "trainer.total_steps=3", "trainer.save_final=false"]
    trainer = Trainer(load_config(config, settings))
    after_the_next_step(trainer, broken.touch)  # it starts reading a column the data lacks
    with pytest.raises(RewardFailingError) as stopped:
        trainer.fit()
    saved = tmp_path / "runs" / "run" / "checkpoints" / "step_1"
    assert str(stopped.value) == (
        "reward component 'a' failed 8 of 8 calls (more than reward.max_failed_share=0.5; first error: "
        f"KeyError: 'solution'); saved {saved}: run the same command to resume once the reward is fixed"
    )
    assert problem(saved) is None and trainer.step == 1
    fresh = Trainer(load_config(config, [*settings, "trainer.experiment_name=fresh"]))
    with pytest.raises(RewardFailingError, match="first error: KeyError: 'solution'[)]; nothing trained yet to save$"):
        fresh.fit()
    assert fresh.step == 0 and not (tmp_path / "runs" / "fresh" / "checkpoints").exists()


@pytest.mark.slow
def test_groups_dropped_on_two_ranks_are_shared_out_as_in_one_process(tmp_path):
    """The judge fails for three prompts (on_failure=drop_group). Step 1 drops both of rank 0's
    groups (4 - 2 kept, one per rank); step 2 drops one of rank 1's (3 kept: mini-batches of 2
    and 1, rank 1 gets a pad in the second). Both runs end (no hang), with the same groups,
    samples, rewards, advantages, metrics and weights."""
    model = tiny_model_dir(tmp_path / "model")
    config = write_run_config(tmp_path, model, reward=LOWER_FRACTION)
    lower = write_reward(tmp_path / "lower.py", LOWER_FRACTION, "lower")
    failing = ("what is 0+0?", "what is 2+6?", "what is 0+1?")  # q0, q2 (rank 0), q5 (rank 1)

    def behaviour(call):
        return Reply(kind="status", status=500) if any(q in call.user_text for q in failing) else Reply()

    with FakeJudgeServer(behaviour=behaviour).start() as server:
        settings = [
            "data.sampler=sequential",
            "data.val_files=[]",
            *judge_settings(server, on_failure="drop_group"),
            f"reward.components=[{{name: judge, function: 'judge:test'}}, {{name: lower, function: '{lower}'}}]",
            "reward.val_metric=lower",
            "reward.max_failed_share=0.9",  # step 1 fails half the calls, on purpose
        ]
        for ranks in (1, 2):
            train(config, ranks, *settings, f"trainer.experiment_name=drop-{ranks}")
    runs = [tmp_path / "runs" / f"drop-{ranks}" for ranks in (1, 2)]
    (one, one_rollouts), (two, two_rollouts) = records(runs[0]), records(runs[1])
    assert two_rollouts == one_rollouts
    assert [sorted({r[1] for r in one_rollouts if r[0] == s}) for s in (1, 2, 3)] == [
        ["q1", "q3"], ["q4", "q6", "q7"], ["q1", "q3"]
    ]  # fmt: skip
    for step in (1, 2, 3):
        assert one[step]["batch/dropped_groups"] == two[step]["batch/dropped_groups"] == (2 if step != 2 else 1)
        for key in (
            "reward/mean", "reward/std", "reward/errors", "judge/judge/calls", "judge/judge/failures",
            "adv/mean", "adv/std", "response/length_mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
        ):  # fmt: skip
            assert two[step][key] == pytest.approx(one[step][key], **REORDERED), (step, key)
    w1, w2 = (load_file(str(run / "final" / "model.safetensors")) for run in runs)
    for name in w1:
        assert (w2[name] - w1[name]).abs().max() < 1e-4, name


@pytest.mark.slow
def test_a_judge_down_stops_every_rank_alike_saved(tmp_path, caplog):
    """The judge fails for step 2's prompts only, on both ranks: both reach the same decision
    (a rank deciding alone would leave the other waiting in a collective), write step 1's
    checkpoint together (each its shards) and stop with the line; one process resumes from it."""
    model = tiny_model_dir(tmp_path / "model")
    config = write_run_config(tmp_path, model, reward=LOWER_FRACTION)
    step_2 = ("what is 4+5?", "what is 0+1?", "what is 1+4?", "what is 2+0?")  # q4..q7, in order
    down = threading.Event()

    def behaviour(call):
        failing = down.is_set() and any(q in call.user_text for q in step_2)
        return Reply(kind="status", status=503, body="overloaded") if failing else Reply()

    with FakeJudgeServer(behaviour=behaviour).start() as server:
        settings = [
            "data.sampler=sequential",
            "data.val_files=[]",
            *judge_settings(server),
            "reward.components=[{name: judge, function: 'judge:test'}]",
            "reward.val_metric=judge",
        ]
        down.set()
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "grouprl", "train", str(config), *SETTINGS, *settings,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        stopped = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        down.clear()
        with caplog.at_level("INFO", logger="grouprl"):
            train(config, 1, *settings)
    run = tmp_path / "runs" / "run"
    line = (
        "grouprl: error: judge 'test' failed 16 of 16 calls (more than reward.max_failed_share=0.5; last error: "
        f"HTTP 503: overloaded); saved {run / 'checkpoints' / 'step_1'}: run the same command to resume once "
        "the judge answers"
    )
    assert stopped.returncode != 0 and line in stopped.stderr
    saved = run / "checkpoints" / "step_1"
    assert problem(saved) is None and len(list((saved / "sharded").glob("*.safetensors"))) == 2
    assert f"resumed from {saved} at step 1" in caplog.text
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "actor/grad_norm" in m] == [1, 2, 3]
