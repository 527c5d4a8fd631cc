"""Saving a model in Hugging Face format (with its tokenizer), atomically."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

from grouprl.files import temp_folder, with_umask_modes

RANDOM_PART = "[a-z0-9_]{8}"  # what tempfile.mkdtemp puts after the prefix


def temp_prefix(target: Path) -> str:
    """How the temp folder of an export to `target` (beside it) is named: this, then mkdtemp's part."""
    return f".tmp-{Path(target).name}-"


def stale_temp_folders(target: Path) -> list[Path]:
    """Temp folders of exports to `target` that are still there: a writer killed mid-write left
    them (a finished export renames its folder; a failed one removes it)."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    name = re.compile(re.escape(temp_prefix(target)) + RANDOM_PART)
    return sorted(
        p for p in target.parent.iterdir() if name.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    )


def save_into_cache(target: Path, *parts) -> None:
    """save_pretrained every part (model, tokenizer, image processor) into `target` through a
    temp folder renamed when complete; a folder another process finished first wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(target.name + ".tmp-", target.parent)
    try:
        for part in parts:
            part.save_pretrained(tmp)
        with_umask_modes(tmp)
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
    if state_dict is not None:
        model = plain_copy(model, state_dict)
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(temp_prefix(target), target.parent)
    try:
        to_save = model
        if merge_lora and hasattr(model, "merge_and_unload"):
            to_save = copy.deepcopy(model).merge_and_unload()
        to_save.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if processor is not None:
            processor.save_pretrained(tmp)
        if meta:
            (tmp / "grouprl_meta.json").write_text(json.dumps(meta, indent=2))
        with_umask_modes(tmp)  # readable as any folder the user makes (a server of another user)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def plain_copy(model, state_dict: dict):
    """A model of `model`'s class and config (LoRA adapters included) holding `state_dict`'s
    tensors, without copying them: what a sharded model exports and merges (FSDP modules
    cannot be deep-copied)."""
    import torch

    lora = getattr(model, "peft_config", None)
    base = model.get_base_model() if lora else model
    with torch.device("meta"):  # no memory until the weights are assigned
        fresh = type(base)(base.config)
    if lora:
        from peft import get_peft_model

        fresh = get_peft_model(fresh, copy.deepcopy(lora[model.active_adapter]))
    fresh.load_state_dict(state_dict, assign=True)
    plain = fresh.get_base_model() if lora else fresh
    plain.tie_weights()  # assigned as two parameters
    if getattr(base, "generation_config", None) is not None:  # built from the config, not the file
        plain.generation_config = copy.deepcopy(base.generation_config)
    return fresh.eval()
