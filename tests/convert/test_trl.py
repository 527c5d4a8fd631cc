"""Arriving from TRL: a GRPO script converted from its syntax tree (nothing in it runs), TRL's
names as overrides, and TRL-style reward functions called as TRL calls them (once per batch,
with trainer_state, log_metric and log_extra landing in metrics.jsonl and rollouts.jsonl)."""

import json

import pytest

from grouprl.cli import main
from grouprl.config import load_config
from grouprl.data import load_samples
from grouprl.rewards import CompositeReward, RewardComponent
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.loggers import RolloutWriter

TRL_SCRIPT = '''
import re

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

open("EXECUTED", "w").write("the script ran")  # convert must never run this
dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
PREFIX = "<think>"


def think_reward(completions, trainer_state=None, log_metric=None, log_extra=None, **kwargs):
    """1.0 when a completion opens with a think block; from step 2 on, half for a bare answer."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    late = trainer_state is not None and trainer_state.global_step >= 2
    scores = [1.0 if t.startswith(PREFIX) else (0.5 if late else 0.0) for t in texts]
    log_metric("think_share", sum(s == 1.0 for s in scores) / len(scores))
    log_extra("opening", [t[:7] for t in texts])
    return scores


def solution_reward(completions, solution, **kwargs):
    return [float(str(s) in (c[0]["content"] if isinstance(c, list) else c)) for c, s in zip(completions, solution)]


training_args = GRPOConfig(
    output_dir="Qwen3-0.6B-GRPO", learning_rate=2e-6, num_generations=4, per_device_train_batch_size=8,
    loss_type="grpo", beta=0.02, epsilon=0.25, max_completion_length=128, reward_weights=[1.0, 2.0],
    logging_steps=5, seed=len("x"),
)
trainer = GRPOTrainer(
    model="Qwen/Qwen3-0.6B", reward_funcs=[think_reward, solution_reward], args=training_args, train_dataset=dataset
)
trainer.train()
'''


def test_a_trl_script_converts_from_its_syntax_tree_with_trls_defaults(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train_grpo.py").write_text(TRL_SCRIPT)
    assert main(["convert", "train_grpo.py", "-o", "run.yaml"]) == 0
    report = capsys.readouterr().out
    assert not (tmp_path / "EXECUTED").exists()
    cfg = load_config(tmp_path / "run.yaml")
    a = cfg.actor
    assert (a.optim.lr, a.loss_agg_mode, a.kl_loss_coef, a.kl_loss_type, a.clip_low, a.clip_high) == (
        2e-6, "seq-mean-token-mean", 0.02, "k3", 0.25, 0.25)  # epsilon is both sides  # fmt: skip
    assert (cfg.rollout.n_agent, cfg.rollout.max_response_length, cfg.data.train_batch_size) == (4, 128, 2)  # 8 / 4
    # TRL's defaults where the script is silent
    assert (a.optim.scheduler, a.optim.weight_decay, a.ppo_epochs, a.dual_clip, cfg.algorithm.norm_adv_by_std) == (
        "linear", 0.0, 1, None, True)  # fmt: skip
    assert (cfg.trainer.total_epochs, cfg.rollout.temperature, cfg.reward.streaming, cfg.algorithm.rollout_is) == (3, 1.0, False, "off")
    assert cfg.model.path == "Qwen/Qwen3-0.6B" and cfg.data.train_files == ["trl-lib/DeepMath-103K"]
    assert [(c.name, c.weight) for c in cfg.reward.components] == [("think_reward", 1.0), ("solution_reward", 2.0)]
    rewards_file = tmp_path / "run_rewards.py"
    assert cfg.reward.components[0].function == f"{rewards_file}:think_reward"
    copied = rewards_file.read_text()
    assert "PREFIX = " in copied and "def solution_reward" in copied
    assert "EXECUTED" not in copied and "GRPOTrainer" not in copied and "load_dataset" not in copied
    assert "seed=len('x'): computed in the script: set it by hand" in report
    assert "logging_steps=5: metrics.jsonl has a line every step" in report
    assert "TRL's defaults written for what the input leaves out" in report and "hub name" in report


def test_trls_names_as_overrides_with_their_translation(caplog):
    cfg = load_config(None, ["beta=0.04", "loss_type=dr_grpo", "num_generations=6", "scale_rewards=none", "epsilon_high=0.28"])
    assert (cfg.actor.kl_loss_coef, cfg.actor.loss_agg_mode, cfg.rollout.n_agent) == (0.04, "seq-mean-token-sum-norm", 6)
    assert (cfg.algorithm.norm_adv_by_std, cfg.actor.clip_high) == (False, 0.28)
    with pytest.raises(Exception, match=r"loss_type=cispo \(cannot translate 'cispo'"):
        load_config(None, ["loss_type=cispo"])


def test_trl_rewards_get_trainer_state_log_metric_and_log_extra_once_per_batch(tmp_path):
    import ast

    tree = ast.parse(TRL_SCRIPT)
    source = next(ast.get_source_segment(TRL_SCRIPT, f) for f in tree.body if getattr(f, "name", "") == "think_reward")
    module = {"PREFIX": "<think>"}
    exec(source, module)  # the script's own reward function, without the script's training
    calls = []

    def counted(completions, **kwargs):
        calls.append(len(completions))
        return module["think_reward"](completions, **kwargs)

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "solution": "4"}) + "\n" + json.dumps({"prompt": "3+3?", "solution": "6"}) + "\n")
    samples = load_samples([str(data)])
    composite = CompositeReward([RewardComponent("think", counted)])
    texts = [["<think>ok</think> 4", "4"], ["6", "<think>six</think>6"]]
    trajectories = [Trajectory(sample=s, index=i, prompt_ids=[0], response_text=t, response_ids=[1, 2])
                    for s, group in zip(samples, texts) for i, t in enumerate(group)]  # fmt: skip
    composite.progress.global_step, composite.progress.epoch = 2, 0.5
    metrics = composite.score(trajectories)  # the batch, as TRL scores it (reward.streaming=false)
    assert calls == [4]
    assert [t.rewards["think"] for t in trajectories] == [1.0, 0.5, 0.5, 1.0]  # step 2: trainer_state was read
    assert metrics["reward/logged/think_share"] == 0.5
    assert [t.extra["opening"] for t in trajectories] == ["<think>", "4", "6", "<think>"]
    record = json.loads(RolloutWriter.lines("r", 2, trajectories[:1], {})[0])
    assert record["extra"] == {"opening": "<think>"}


@pytest.mark.parametrize(
    "body, said",
    [
        ("def r(completions, **kw):\n    import math_verify_missing\n    return [1.0]\n", "ModuleNotFoundError: No module named 'math_verify_missing'"),
        ("def r(completions, answer_column, **kw):\n    return [1.0]\n", "missing 1 required keyword-only argument|answer_column"),
        ("def r(completions, **kw):\n    return 1.0\n", "returned float for 1 completion"),
        ("def r(response, ground_truth=None, **kw):\n    return 'yes'\n", "returned str 'yes'"),
    ],
)
def test_the_dry_run_calls_each_reward_once_and_one_that_cannot_run_is_one_line(tmp_path, capsys, body, said):
    (tmp_path / "rw.py").write_text(body)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "solution": "4"}) + "\n")
    code = main(["train", f"data.train_files=[{data}]", f"reward.components=[{{name: r, function: {tmp_path}/rw.py:r}}]",
                 "reward.val_metric=r", "model.path=builtin:smollm2-135m-instruct", "--dry-run"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "reward r (" in err
    assert any(part in err for part in said.split("|")), err


def test_a_dry_run_says_how_often_a_trl_reward_is_called_and_its_value(tmp_path, capsys):
    (tmp_path / "rw.py").write_text("def r(completions, solution, **kw):\n    return [float(c == s) for c, s in zip(completions, solution)]\n")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "solution": "4"}) + "\n")
    common = [f"data.train_files=[{data}]", f"reward.components=[{{name: r, function: {tmp_path}/rw.py:r}}]", "reward.val_metric=r",
              "model.path=builtin:smollm2-135m-instruct"]  # fmt: skip
    assert main(["train", *common, "--dry-run"]) in (0, 1)
    out = capsys.readouterr().out
    assert f"reward r: called once on row 1 of {data}, '4' as the completion: 1.0" in out  # the truth scores 1
    assert "TRL-style rewards are called once per group as each finishes (reward.streaming)" in out
    assert main(["train", *common, "reward.streaming=false", "--dry-run"]) in (0, 1)
    assert "once per group" not in capsys.readouterr().out


def test_an_offline_dry_run_reads_the_hubs_cache_only(capsys, monkeypatch):
    import os

    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: unreachable at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = hub_constants.HF_HUB_OFFLINE
    assert main(["train", "model.path=no-such-org/no-such-model", "--dry-run"]) in (0, 1)
    out = capsys.readouterr().out
    assert "memory plan: not made, the hub is not reachable from here and no-such-org/no-such-model's config is not in its cache" in out
    assert "HF_HUB_OFFLINE" not in os.environ and hub_constants.HF_HUB_OFFLINE == before  # as it was, afterwards


TRL_LOGGING = '''
def steps(completions, trainer_state, log_metric, log_extra, **kwargs):
    """A TRL-style reward that reads the step and logs a metric and a column."""
    log_metric("step_seen", float(trainer_state.global_step))
    log_extra("length", [len(c) for c in completions])
    return [float(len(c) % 2) for c in completions]
'''


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True])
def test_a_run_logs_what_a_trl_reward_logs(tmp_path, streaming):
    """Two steps of a tiny model: log_metric's value in metrics.jsonl each step (its mean over the
    step), log_extra's column in each trajectory's rollouts.jsonl record, trainer_state's step."""
    from helpers import train_here
    from trainer.tiny import tiny_model_dir, write_run_config

    (tmp_path / "trl_rw.py").write_text(TRL_LOGGING)
    config = write_run_config(tmp_path, tiny_model_dir(tmp_path / "model"))
    train_here(config, "trainer.total_steps=2", "data.val_files=[]", "actor.dtype=float32", "reward.val_metric=steps",
               f"reward.components=[{{name: steps, function: {tmp_path}/trl_rw.py:steps}}]", f"reward.streaming={streaming}")  # fmt: skip
    run = tmp_path / "runs" / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "actor/pg_loss" in line]
    # TRL's global_step: the optimizer steps done before the batch was generated
    assert [m["reward/logged/step_seen"] for m in metrics] == [float(m["step"] - 1) for m in metrics] and len(metrics) == 2
    records = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 4 and all(r["extra"]["length"] == len(r["response"]) for r in records)
