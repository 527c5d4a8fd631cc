"""A judge inside the training loop: requests to a real HTTP judge on 127.0.0.1, judge.jsonl in
the run folder, and on_failure=drop_group leaving a failed group out of the update."""

import json

import pytest
from tiny import LOWER_FRACTION, tiny_model_dir, write_reward, write_run_config

from grouprl.config import load_config
from grouprl.trainer.trainer import Trainer
from rewards.judges.fake_server import FakeJudgeServer, Reply

KEY = "sk-test-TRAINER-0123456789"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def test_failed_judge_drops_its_group_and_nothing_leaks(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("TRAINER_JUDGE_KEY", KEY)
    monkeypatch.setenv("HOME", str(tmp_path))  # the default judge cache lives under ~/.cache

    def behaviour(call):  # the judge always fails for the question of q0 ("what is 0+0?")
        return Reply(kind="status", status=500) if "what is 0+0?" in call.user_text else Reply()

    with FakeJudgeServer(behaviour=behaviour).start() as server:
        config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
        lower = write_reward(tmp_path / "lower.py", LOWER_FRACTION, "lower")
        overrides = [
            "data.sampler=sequential",
            "data.val_files=[]",
            "trainer.total_steps=2",
            "trainer.save_final=false",
            f"reward.judges=[{{name: test, model: fake-judge, base_url: '{server.base_url}', "
            "api_key_env: TRAINER_JUDGE_KEY, max_retries: 1, backoff_base_s: 0.001, backoff_max_s: 0.01, "
            "on_failure: drop_group, fields: {correctness: 1.0}, scale: 9}]",
            f"reward.components=[{{name: judge, function: 'judge:test', weight: 1.0}}, "
            f"{{name: lower, function: '{lower}', weight: 0.1}}]",
            "reward.val_metric=lower",
        ]
        trainer = Trainer(load_config(config, overrides))
        trainer.fit()
        requests = server.requests
    run = tmp_path / "runs" / "run"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert [m.get("batch/dropped_groups", 0) for m in steps] == [1, 0]  # q0 only comes in step 1
    rollouts = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert sorted({r["uid"] for r in rollouts if r["step"] == 1}) == ["q1"]  # q0's group left out
    assert all(r["rewards"]["judge"] == 0.0 for r in rollouts)  # the fake judge's grade without GRADE:
    assert trainer.counters["dropped_groups"] == 1
    judged = [json.loads(x) for x in (run / "judge.jsonl").read_text().splitlines()]
    assert len(judged) == 4 * 4 and sum(1 for j in judged if j.get("error")) == 4
    assert requests >= 4 * 3 + 4 * 2  # 12 answered + 4 failures tried twice
    for path in run.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
