"""Saving a model in Hugging Face format (with its tokenizer), atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def save_into_cache(target: Path, *parts) -> None:
    """save_pretrained every part (model, tokenizer, image processor) into `target` through a
    temp folder renamed when complete; a folder another process finished first wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        for part in parts:
            part.save_pretrained(tmp)
        if target.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_model(
    model,
    tokenizer,
    target: Path,
    *,
    merge_lora: bool,
    meta: dict | None = None,
    processor=None,
    state_dict: dict | None = None,
) -> Path:
    """save_pretrained into `target` via a temp folder. With LoRA: adapters only, or (merge_lora)
    a merged copy that loads with plain from_pretrained. `processor` (a VLM's; anything with
    save_pretrained) is saved beside the model, so the folder is a working VLM. `state_dict`: the
    weights to write instead of the model's own (a sharded model's, gathered whole)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        to_save = model
        if merge_lora and hasattr(model, "merge_and_unload"):
            import copy

            to_save = copy.deepcopy(model).merge_and_unload()
        to_save.save_pretrained(tmp, **({"state_dict": state_dict} if state_dict is not None else {}))
        tokenizer.save_pretrained(tmp)
        if processor is not None:
            processor.save_pretrained(tmp)
        if meta:
            (tmp / "grouprl_meta.json").write_text(json.dumps(meta, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
