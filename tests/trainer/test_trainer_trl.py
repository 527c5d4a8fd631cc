"""A TRL user's reward functions and dataset train unchanged: `reward_len(completions, **kwargs)`
and `accuracy_reward(completions, solution, **kwargs)` on a dataset of `prompt` text and a
`solution` column, through `grouprl train` (dry run and a short run on the tiny model)."""

import json

from tiny import tiny_model_dir

from grouprl.config import load_config
from grouprl.trainer.trainer import Trainer
from test_cli import run

REWARDS = '''
def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]

def accuracy_reward(completions, solution, **kwargs):
    return [float(s in c) if s.isdigit() else None for c, s in zip(completions, solution)]
'''


def test_trl_rewards_and_a_trl_dataset_train_unchanged(tmp_path, capsys):
    model = tiny_model_dir(tmp_path / "model")
    rows = [
        {"id": f"t{i}", "prompt": f"what is {i % 5}+{i % 3}?", "solution": str(i % 5 + i % 3) if i % 4 else "none"}
        for i in range(8)
    ]
    data = tmp_path / "trl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "trl_rewards.py").write_text(REWARDS)
    overrides = [
        f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]", "data.train_batch_size=2",
        "rollout.n_agent=4", "rollout.max_response_length=6", "trainer.total_steps=2", "trainer.device=cpu",
        f"trainer.output_dir={tmp_path / 'runs'}", "trainer.experiment_name=trl", "trainer.loggers=[jsonl]",
        "trainer.save_final=false", "actor.micro_batch_size=4",
        f"reward.components=[{{name: len, function: '{tmp_path}/trl_rewards.py:reward_len', weight: 0.05}},"
        f" {{name: acc, function: '{tmp_path}/trl_rewards.py:accuracy_reward'}}]",
        "reward.val_metric=acc",
    ]  # fmt: skip
    code, out, _ = run(capsys, "train", "--dry-run", *overrides)
    assert code == 0, out
    assert f"data: {data}: verl layout: prompt, solution (as the ground truth)" in out
    assert "reward acc: " in out and "every data column (TRL's batch call)" in out
    trainer = Trainer(load_config(None, overrides))
    trainer.fit()
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "trl" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/grad_norm" in m]
    assert len(steps) == 2 and all(m["reward/errors"] == 0.0 for m in steps)
    rollouts = [json.loads(x) for x in (tmp_path / "runs" / "trl" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 16
    truth = {r["id"]: r["solution"] for r in rows}
    for r in rollouts:  # each component's value is the function's, by hand
        assert r["rewards"]["len"] == -abs(20 - len(r["response"]))
        solution = truth[r["uid"]]
        assert r["rewards"]["acc"] == (float(solution in r["response"]) if solution.isdigit() else 0.0)
    drawn = [truth[r["uid"]] for r in rollouts]
    assert sum(m["reward/not_applicable/acc"] for m in steps) == sum(not s.isdigit() for s in drawn)
