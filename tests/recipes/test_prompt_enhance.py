"""configs/prompt_enhance.yaml end to end with real diffusers and CLIP classes (tiny random
weights saved to folders): the policy's rewrites are drawn by the pipeline in the reward
worker, scored by CLIP against the original prompt, images land in the run folder beside their
rewards, and the before/after report (grid + scores) is written."""

import csv
import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from grouprl.config import load_config
from grouprl.trainer.trainer import Trainer
from rewards.models.tiny_image_models import tiny_clip_dir, tiny_pipeline_dir
from trainer.tiny import tiny_model_dir

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_prompt_enhancement_recipe_runs_with_diffusers_and_clip(tmp_path):
    for split, prompts in (("train", ["a cat", "a red car", "two dogs", "a blue house"]), ("test", ["a tree", "a boat"])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"question": p}) + "\n" for p in prompts))
    tree = yaml.safe_load((ROOT / "configs" / "prompt_enhance.yaml").read_text())
    sd, clip = tree["reward"]["models"]
    sd.update(path=str(tiny_pipeline_dir(tmp_path / "sd")), device="cpu", dtype="float32", steps=2, height=16, width=16)
    clip.update(path=str(tiny_clip_dir(tmp_path / "clip")), device="cpu")
    tree["model"] = {"path": str(tiny_model_dir(tmp_path / "policy"))}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    cfg = load_config(
        str(recipe),
        [
            f"data.train_files=[{tmp_path / 'train.jsonl'}]", f"data.val_files=[{tmp_path / 'test.jsonl'}]",
            "data.train_batch_size=2", "rollout.max_response_length=6", "trainer.device=cpu", "trainer.total_steps=2",
            "trainer.test_freq=0", "trainer.save_freq=0", f"trainer.output_dir={tmp_path / 'runs'}", "actor.optim.lr=1e-3",
        ],
    )  # fmt: skip
    summary = Trainer(cfg).fit()
    run = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 5
    for r in records:  # each sample's drawing, in the run folder, named in its record
        assert Image.open(run / r["images"]["clip"]).size == (16, 16)
        assert -1.0 <= r["rewards"]["clip"] <= 1.0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "actor/pg_loss" in m]
    assert trained[0]["reward_model/clip/items"] == 10 and trained[0]["reward_model/clip/busy_s"] > 0
    # the report: the two test prompts as written, before and after, with their scores
    with open(run / "report" / "scores.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["prompt"] for r in rows] == ["a tree", "a boat"]
    assert all(r["as written: text"] == r["prompt"] for r in rows)
    grid = Image.open(run / "report" / "grid.png")
    assert grid.size == (3 * 128, 14 + 2 * (128 + 14))
    assert summary["image_report"].startswith("image score (held-out, 2 prompts): as written")
