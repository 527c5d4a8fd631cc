"""The agent loop inside the training loop: a tiny policy searching a real in-process index,
observations in the response with loss mask 0, and an update on the policy's own tokens."""

import json

import pytest
from tiny import LOWER_FRACTION, tiny_model_dir, write_run_config

from grouprl.config import load_config
from grouprl.errors import ConfigError
from grouprl.trainer.trainer import Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def agent_overrides(index_dir):
    return [
        "agent.enabled=true",
        f"agent.retriever.index={index_dir}",
        "agent.max_turns=2",
        "agent.answer_generator=none",
        "rollout.max_response_length=8",
        "data.max_prompt_length=2048",
        "data.val_files=[]",
        "trainer.save_final=false",
        "trainer.total_steps=2",
    ]


def test_agent_trajectories_train_only_policy_tokens(tmp_path, model_dir, index_dir):
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    trainer = Trainer(load_config(config, agent_overrides(index_dir)))
    assert set(trainer.parts.collect.runner.tools) == {"search", "bbox"}
    metrics, trajectories, _ = trainer.train_step()
    assert len(trajectories) == 2 * 4
    assert metrics["agent/turns_mean"] >= 1 and "actor/pg_loss" in metrics
    with_observation = [t for t in trajectories if 0 in t.loss_mask]
    assert with_observation, "a random policy's first turn is never a finished action: it gets an observation"
    for t in trajectories:
        assert len(t.loss_mask) == len(t.response_ids) and t.loss_mask[0] == 1  # the policy speaks first
        assert "<observation>" in t.response_text or t.finish_reason != "length"
    # the prompt carries the protocol as its system message
    prompt = trainer.parts.tokenizer.decode(trajectories[0].prompt_ids)
    assert "<search>query</search>" in prompt and "<answer>" in prompt  # the self-answer protocol
    trainer.fit()
    records = [json.loads(x) for x in (tmp_path / "runs" / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records} == {2} and all(r["turns"] for r in records)  # fit ran step 2


def test_search_without_a_retriever_is_a_config_error(tmp_path, model_dir, index_dir):
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    overrides = [o for o in agent_overrides(index_dir) if not o.startswith("agent.retriever.index")]
    with pytest.raises(ConfigError, match="agent.tools has search: set agent.retriever.index"):
        Trainer(load_config(config, overrides))


def _track_submissions(trainer):
    """Record each group handed to the streaming scorer, and whether the agent loop was running."""
    running, submitted = [False], []
    run, open_batch = trainer.parts.collect.runner.run, trainer.parts.collect.streaming.open

    def tracked_run(*args, **kwargs):
        running[0] = True
        try:
            return run(*args, **kwargs)
        finally:
            running[0] = False

    def tracked_open():
        batch = open_batch()
        submit = batch.submit

        def tracked_submit(group):
            submitted.append((running[0], group))
            submit(group)

        batch.submit = tracked_submit
        return batch

    trainer.parts.collect.runner.run, trainer.parts.collect.streaming.open = tracked_run, tracked_open
    return submitted


def test_streaming_agent_rewards_equal_batch_rewards(tmp_path, model_dir, index_dir):
    """reward.streaming hands each group to the scorer from inside the agent loop (policy answers,
    a judge over HTTP); the step's trajectories and rewards equal those of a run that scores the
    whole batch after the loop, with the same seed."""
    from rewards.judges.fake_server import FakeJudgeServer, Reply

    def behaviour(call):  # a judge grade that depends on the response text
        return Reply(content=json.dumps({"correctness": len(call.user_text) % 10}))

    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    with FakeJudgeServer(latency=0.02, behaviour=behaviour) as server:
        common = [
            *(o for o in agent_overrides(index_dir) if not o.startswith("agent.answer_generator")),
            "agent.answer_generator=policy",
            "agent.answer_max_tokens=4",
            "agent.max_turns=3",
            f"reward.judges=[{{name: j, model: fake, base_url: '{server.base_url}', cache_path: '', "
            "fields: {correctness: 1.0}, scale: 9}]",
            f"reward.components=[{{name: a, function: '{tmp_path / 'reward_a.py'}:score', weight: 1.0}}, "
            "{name: judge, function: 'judge:j', weight: 0.5}]",
        ]
        runs = {}
        for streaming in (True, False):
            overrides = [
                f"reward.streaming={str(streaming).lower()}",
                f"trainer.experiment_name=run{int(streaming)}",
            ]
            trainer = Trainer(load_config(config, [*common, *overrides]))
            submitted = _track_submissions(trainer) if streaming else []
            metrics, trajectories, _ = trainer.train_step()
            runs[streaming] = (metrics, trajectories, submitted)
            if trainer.parts.collect.streaming is not None:
                trainer.parts.collect.streaming.close()
            trainer.parts.collect.reward.close()
        requests = server.requests

    (s_metrics, s_traj, submitted), (b_metrics, b_traj, _) = runs[True], runs[False]
    assert [t.response_ids for t in s_traj] == [t.response_ids for t in b_traj]
    assert [t.loss_mask for t in s_traj] == [t.loss_mask for t in b_traj]
    assert [t.rewards for t in s_traj] == [t.rewards for t in b_traj]
    assert [t.reward for t in s_traj] == [t.reward for t in b_traj]
    assert len({t.rewards["judge"] for t in s_traj}) > 1  # the judge's grades vary
    assert all(t.turns[-1]["action"] == "answer" for t in s_traj)  # the policy wrote the answers
    for key in ("reward/mean", "reward/std", "reward/a", "reward/judge"):
        assert s_metrics[key] == pytest.approx(b_metrics[key], abs=1e-12), key
    # each group went to the scorer once, from inside the agent loop, as the step's trajectories
    assert [running for running, _ in submitted] == [True, True]
    assert [t for _, group in submitted for t in group] == s_traj
    assert "time/reward_hidden" in s_metrics and "time/reward_hidden" not in b_metrics
    assert requests == 2 * len(s_traj)
