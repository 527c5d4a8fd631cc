"""Set-up shared by the trainer, checkpoint, model and CLI tests: a tiny model folder (from
tests/helpers.py, saved with save_pretrained so `model.path=<folder>` goes through the real
from_pretrained code path), plain-layout datasets, reward files and YAML configs in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from helpers import tiny_model_and_tokenizer


def tiny_model_dir(folder: Path, *, seed: int = 0, init_std: float = 0.02) -> Path:
    """Save a tiny random Llama + character tokenizer (with a chat template) into `folder`.

    init_std 0.02 (the transformers default) gives a near-uniform next-token distribution,
    so every character is sampled now and then and a reward on characters can be learned.
    """
    tiny_model_and_tokenizer(folder, seed=seed, init_std=init_std)
    return Path(folder)


def write_dataset(path: Path, n: int = 8, *, prefix: str = "q") -> Path:
    """A plain-layout jsonl (id, question, answer): `what is a+b?` with the sum as answer."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 5, (i * 3) % 7
            f.write(
                json.dumps({"id": f"{prefix}{i}", "question": f"what is {a}+{b}?", "answer": str(a + b)})
                + "\n"
            )
    return path


def write_reward(path: Path, body: str, name: str = "reward") -> str:
    """Write `def <name>(response, ground_truth=None, **kwargs): return <body>`; return `file.py:name`."""
    path = Path(path)
    path.write_text(f"def {name}(response, ground_truth=None, **kwargs):\n    return {body}\n")
    return f"{path}:{name}"


# fraction of the response's characters that are "a": a tiny random model can learn it fast
A_FRACTION = "response.count('a') / max(len(response), 1)"
# fraction of lower-case letters: about 1 in 4 characters of a random model, so groups have spread
LOWER_FRACTION = "sum(c.islower() for c in response) / max(len(response), 1)"


def write_run_config(
    root: Path, model_dir: Path, *, reward: str = A_FRACTION, **sections: dict[str, Any]
) -> Path:
    """A YAML config for a short CPU run on the tiny model (reward component "a" computes the
    expression `reward`); `sections` update the tree per section."""
    root = Path(root)
    data = write_dataset(root / "train.jsonl", 8)
    val = write_dataset(root / "val.jsonl", 4, prefix="v")
    reward = write_reward(root / "reward_a.py", reward, "score")
    tree: dict[str, dict[str, Any]] = {
        "data": {
            "train_files": [str(data)],
            "val_files": [str(val)],
            "train_batch_size": 2,
            "max_prompt_length": 64,
        },
        "model": {"path": str(model_dir)},
        "rollout": {"n_agent": 4, "max_response_length": 6, "temperature": 1.0},
        "reward": {"components": [{"name": "a", "function": reward}], "val_metric": "a"},
        "algorithm": {"adv_estimator": "grpo"},
        "actor": {
            "policy_loss": "ppo",
            "clip_low": 0.2,
            "clip_high": 0.2,
            "micro_batch_size": 4,
            "optim": {"lr": 1e-2},
        },
        "trainer": {
            "total_steps": 3,
            "device": "cpu",
            "output_dir": str(root / "runs"),
            "experiment_name": "run",
            "loggers": ["jsonl"],
            "seed": 0,
        },
    }
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path
