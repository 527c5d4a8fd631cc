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
    assert set(trainer.agent.tools) == {"search", "bbox"}
    metrics, trajectories = trainer.train_step()
    assert len(trajectories) == 2 * 4
    assert metrics["agent/turns_mean"] >= 1 and "actor/pg_loss" in metrics
    with_observation = [t for t in trajectories if 0 in t.loss_mask]
    assert with_observation, "a random policy's first turn is never a finished action: it gets an observation"
    for t in trajectories:
        assert len(t.loss_mask) == len(t.response_ids) and t.loss_mask[0] == 1  # the policy speaks first
        assert "<observation>" in t.response_text or t.finish_reason != "length"
    # the prompt carries the protocol as its system message
    prompt = trainer.tokenizer.decode(trajectories[0].prompt_ids)
    assert "<search>query</search>" in prompt and "<answer>" in prompt  # the self-answer protocol
    trainer.fit()
    records = [json.loads(x) for x in (tmp_path / "runs" / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records} == {2} and all(r["turns"] for r in records)  # fit ran step 2


def test_search_without_a_retriever_is_a_config_error(tmp_path, model_dir, index_dir):
    config = write_run_config(tmp_path, model_dir, reward=LOWER_FRACTION)
    overrides = [o for o in agent_overrides(index_dir) if not o.startswith("agent.retriever.index")]
    with pytest.raises(ConfigError, match="agent.tools has search: set agent.retriever.index"):
        Trainer(load_config(config, overrides))
