"""configs/prompt_enhance_demo.yaml's loop on the built-in model, shrunk to one short step: the
scenes task, the Pillow renderer and scorer in the reward worker, images in the run folder,
the before/after report. (Its learning curve is in benchmarks/RESULTS.md.)"""

import csv
import json
from pathlib import Path

import pytest

from grouprl.config import load_config
from grouprl.data.tasks.scene_language import parse_request
from grouprl.rewards.models.scenes import SceneScorer
from grouprl.trainer.trainer import Trainer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_loop_runs_and_reports(tmp_path):
    cfg = load_config(
        str(ROOT / "configs" / "prompt_enhance_demo.yaml"),
        [
            "data.task_train_size=32", "data.task_val_size=3", "data.train_batch_size=2", "rollout.n_agent=4",
            "rollout.max_response_length=16", "trainer.total_steps=1", "trainer.test_freq=0", "trainer.save_freq=0",
            "trainer.save_final=false", "trainer.save_best=false", "trainer.save_last=false", f"trainer.output_dir={tmp_path / 'runs'}", "actor.dtype=float32",
        ],
    )  # fmt: skip
    summary = Trainer(cfg).fit()
    run = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 1 * 2 * 4
    scorer = SceneScorer()
    from PIL import Image

    for r in records:  # the logged reward is the scorer's verdict on the logged picture
        with Image.open(run / r["images"]["scene"]) as image:
            assert scorer([image.convert("RGB")], [r["prompt"]])[0] == pytest.approx(r["rewards"]["scene"])
        parse_request(r["prompt"])  # the prompt logged is the request itself
    with open(run / "report" / "scores.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and (run / "report" / "grid.png").is_file()
    assert "as written" in summary["image_report"]
