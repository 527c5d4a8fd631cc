"""Atomic, resumable checkpoints.

<run>/checkpoints/step_<N>/ is written in a temp folder and renamed once complete; the file
`latest` names the newest complete one. A checkpoint holds the trainable weights
(safetensors; LoRA adapters only when LoRA is on), optimizer and scheduler state, and the
trainer state (step, sampler position, RNG states, evaluation history), so a resumed run draws
the same next batches as an uninterrupted one.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from grouprl.errors import UserError


def trainable_state(model) -> dict[str, torch.Tensor]:
    """Trainable parameters by name (tied weights appear once)."""
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise UserError(
            f"checkpoint does not match the model: {len(missing)} unknown tensors, e.g. {missing[0]}"
        )
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def save(
        self, step: int, model, optimizer, scheduler, trainer_state: dict[str, Any], ref_model=None
    ) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=self.root))
        try:
            save_file(trainable_state(model), str(tmp / "model.safetensors"))
            if ref_model is not None:
                save_file(
                    {n: p.detach().contiguous().cpu() for n, p in ref_model.named_parameters()},
                    str(tmp / "ref_model.safetensors"),
                )
            torch.save(
                {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "trainer": trainer_state,
                },
                tmp / "state.pt",
            )
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        latest_tmp = self.root / ".latest.tmp"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, self.root / "latest")
        self._prune()
        return final

    def _prune(self) -> None:
        steps = sorted(self.complete(), key=lambda p: int(p.name.split("_")[1]))
        for old in steps[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.glob("step_*") if (p / "state.pt").is_file()]

    def latest(self) -> Path | None:
        marker = self.root / "latest"
        if marker.is_file():
            path = self.root / marker.read_text().strip()
            if (path / "state.pt").is_file():
                return path
        done = sorted(self.complete(), key=lambda p: int(p.name.split("_")[1]))
        return done[-1] if done else None

    @staticmethod
    def load(path: Path, model, optimizer, scheduler, ref_model=None) -> dict[str, Any]:
        path = Path(path)
        if not (path / "state.pt").is_file():
            raise UserError(f"not a complete checkpoint folder: {path}")
        load_trainable_state(model, load_file(str(path / "model.safetensors")))
        if ref_model is not None and (path / "ref_model.safetensors").is_file():
            load_trainable_state(ref_model, load_file(str(path / "ref_model.safetensors")))
        state = torch.load(path / "state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        return state["trainer"]
