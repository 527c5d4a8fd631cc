"""The math-tutor source's three workflows (configs/math_*.yaml) run end to end offline on the
built-in model and the built-in word problems, shrunk to one short step: rule rewards only;
rules + an API judge (the Gemini backend pointed at a fake Gemini server on 127.0.0.1); rules +
an on-premise judge model (the built-in model as the judge, on its own device setting)."""

import json
from pathlib import Path

import pytest
import yaml

from grouprl.config import load_config
from grouprl.trainer.trainer import Trainer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "data.train_batch_size=2",
    "data.task_train_size=64",
    "data.task_val_size=2",
    "rollout.n_agent=4",
    "rollout.max_response_length=12",
    "trainer.total_steps=1",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "trainer.save_final=false",
    "trainer.save_best=false",  # a whole SmolLM2 written at each better evaluation: the on-premise test asks for it
    "trainer.val_before_train=false",
    "actor.dtype=float32",
]


def run(recipe: Path, tmp_path, *overrides):
    cfg = load_config(str(recipe), [*SMALL, f"trainer.output_dir={tmp_path / 'runs'}", *overrides])
    trainer = Trainer(cfg)
    summary = trainer.fit()
    run_dir = Path(summary["run_dir"])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [m for m in steps if "actor/pg_loss" in m]


def test_rule_rewards_recipe(tmp_path):
    run_dir, steps = run(ROOT / "configs" / "math_rules.yaml", tmp_path)
    assert len(steps) == 1
    for key in ("reward/correctness", "reward/strict_format", "reward/soft_format", "reward/contains_integer", "reward/xml_count"):
        assert key in steps[-1]
    weights = {"correctness": 2.0, "strict_format": 0.5, "soft_format": 0.5, "contains_integer": 0.5, "xml_count": 1.0}
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():  # the composite is the weighted sum
        record = json.loads(line)
        assert record["reward"] == pytest.approx(sum(w * record["rewards"][k] for k, w in weights.items()))
    assert (run_dir / "checkpoints" / "step_1" / "manifest.json").is_file()


def test_api_judge_recipe_sends_formatted_answers_to_the_judge(tmp_path, monkeypatch):
    from rewards.judges.fake_gemini import FakeGeminiServer, Reply

    monkeypatch.setenv("GEMINI_API_KEY", "test-key-42")
    tree = yaml.safe_load((ROOT / "configs" / "math_api_judge.yaml").read_text())
    tree["reward"]["judges"][0]["cache_path"] = str(tmp_path / "judge_cache.sqlite")  # not ~/.cache's
    server = FakeGeminiServer(behaviour=lambda call: Reply(text='{"reasoning": 4}')).start()
    try:
        tree["reward"]["judges"][0]["base_url"] = server.base_url
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(tree))
        # room for the worked example's shape: well-formed answers open the judge's gate
        run_dir, steps = run(recipe, tmp_path, "rollout.max_response_length=40", "trainer.save_last=false")
    finally:
        server.stop()
    assert server.calls and set(server.api_keys) == {"test-key-42"}
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    judged = [r for r in records if r["rewards"]["soft_format"] > 0]
    assert judged and all(r["rewards"]["reasoning"] == pytest.approx(0.8) for r in judged)  # 4 of 5
    assert all(r["rewards"]["reasoning"] == 0.0 for r in records if r["rewards"]["soft_format"] == 0)
    log = [json.loads(line) for line in (run_dir / "judge.jsonl").read_text().splitlines()]
    assert log and "test-key-42" not in (run_dir / "judge.jsonl").read_text()


def test_on_premise_judge_recipe_logs_every_grade_and_keeps_the_best(tmp_path, monkeypatch):
    tree = yaml.safe_load((ROOT / "configs" / "math_local_judge.yaml").read_text())
    tree["reward"]["judges"][0]["cache_path"] = str(tmp_path / "judge_cache.sqlite")  # not ~/.cache's
    tree["reward"]["judges"][0]["max_tokens"] = 8  # a grade is a few tokens
    tree["reward"]["judges"][0]["max_retries"] = 0  # the stand-in's grades seldom parse: no second tries
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    run_dir, steps = run(
        recipe, tmp_path, "rollout.max_response_length=40", "trainer.save_best=true", "trainer.save_last=false"
    )  # best/: the final evaluation; the end's checkpoint (1.6 GB of SmolLM2 and Adam): the rule recipe's test
    assert len(steps) == 1 and "reward/reasoning" in steps[-1]
    log = [json.loads(line) for line in (run_dir / "judge.jsonl").read_text().splitlines()]
    assert log and all("raw" in e and e["prompt"]["user"] for e in log)  # what it was asked, what it said
    assert (run_dir / "best" / "grouprl_meta.json").is_file()
