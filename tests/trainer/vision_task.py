"""A colour task for tiny VLMs in trainer tests: each prompt shows a solid red or blue image and
asks for its colour; the reward is the share of the response's characters that are the colour's
letter ("r" or "b"). A policy that does not see the image cannot beat 0.5 on average (it can
only bet on both letters); one that reads it can reach 1."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from tiny import write_reward

from vision_helpers import tiny_vlm

COLOURS = {"r": (220, 20, 20), "b": (20, 20, 220)}
LETTER_SHARE = "response.count(ground_truth) / max(len(response), 1)"


def write_colour_data(root: Path, n: int, prefix: str, size=(56, 56), colours=None) -> Path:
    from PIL import Image

    folder = root / "images"
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        letter = "rb"[i % 2]
        name = f"{prefix}{i}.png"
        Image.new("RGB", size, (colours or COLOURS)[letter]).save(folder / name)
        rows.append({"id": f"{prefix}{i}", "question": "colour?", "answer": letter, "images": [f"images/{name}"]})
    path = root / f"{prefix}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_vision_run(
    root: Path,
    family: str,
    vision_init_std: float = 0.02,
    reward: str = LETTER_SHARE,
    val_colours: dict | None = None,
    **sections,
) -> Path:
    """A tiny VLM of `family` saved under root/model, colour data and a config (reward: an
    expression of response and ground_truth); returns the config."""
    root = Path(root)
    tiny_vlm(family, root / "model", init_std=0.02, vision_init_std=vision_init_std)
    train = write_colour_data(root, 8, "t")
    val = write_colour_data(root, 4, "v", colours=val_colours)
    reward = write_reward(root / "reward.py", reward, "score")
    tree = {
        "data": {"train_files": [str(train)], "val_files": [str(val)], "train_batch_size": 2, "max_prompt_length": 128},
        "model": {"path": str(root / "model")},
        "rollout": {"n_agent": 4, "max_response_length": 6, "temperature": 1.0},
        "reward": {"components": [{"name": "letter", "function": reward}], "val_metric": "letter"},
        # float32 compute on every CPU (bf16 autocast where the CPU has it would blur the
        # generation-vs-update log-prob check)
        "actor": {"policy_loss": "ppo", "clip_low": 0.2, "clip_high": 0.2, "micro_batch_size": 4,
                  "dtype": "float32", "optim": {"lr": 1e-2}},
        "trainer": {"total_steps": 3, "device": "cpu", "output_dir": str(root / "runs"), "experiment_name": "run",
                    "loggers": ["jsonl"], "seed": 0},
    }
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path
