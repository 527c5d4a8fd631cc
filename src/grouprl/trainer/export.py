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
    write: bool = True,
) -> Path:
    """A Hugging Face folder of `model` at `target`, via a temp folder. The weights are written
    as the model's own checkpoint names them, in its own dtype (`published_dtype`), a tensor at a
    time (`write_weights`): a sharded policy is gathered one layer at a time, and only the rank
    that writes (`write`) holds what it writes, the others only taking part in the gathers.
    With LoRA: adapters only, or (merge_lora) weights with the adapters merged, a folder plain
    from_pretrained loads. `processor` (a VLM's; anything with save_pretrained) is saved beside
    the model, so the folder is a working VLM."""
    lora = getattr(_hf(model), "peft_config", None)
    if lora and not merge_lora:
        return _export_adapters(model, tokenizer, target, meta, processor, write)
    target = Path(target)
    tmp = None
    if write:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_folder(temp_prefix(target), target.parent)
    try:
        from grouprl.trainer.weights_writer import write_weights

        write_weights(_base(_hf(model)), published_dtype(model), tmp)
        if write:
            _finish(model, tokenizer, tmp, target, meta, processor)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _finish(model, tokenizer, tmp: Path, target: Path, meta, processor) -> None:
    """Beside the weights: the config (in the dtype written), generation config, tokenizer,
    processor and `meta`; then the folder renamed into place."""
    base = _base(_hf(model))
    config = copy.deepcopy(base.config)
    config.dtype = published_dtype(model)
    config.save_pretrained(tmp)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if processor is not None:
        processor.save_pretrained(tmp)
    if meta:
        (tmp / "grouprl_meta.json").write_text(json.dumps(meta, indent=2))
    with_umask_modes(tmp)  # readable as any folder the user makes (a server of another user)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


def _export_adapters(model, tokenizer, target: Path, meta, processor, write: bool) -> Path:
    """A LoRA policy's adapters alone (peft's folder), gathered to the writing rank when sharded."""
    import torch

    from grouprl.trainer.parallel import full_tensor

    hf = _hf(model)
    adapters = {n: full_tensor(p.detach()) for n, p in hf.named_parameters() if ".lora_" in n}  # every rank gathers
    if not write:
        return Path(target)
    if any(hasattr(p, "to_local") for p in hf.parameters()):  # sharded: a copy holding the adapters
        hf = plain_copy(hf, {n: t.cpu() for n, t in adapters.items()})
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(temp_prefix(target), target.parent)
    try:
        with torch.no_grad():
            hf.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if processor is not None:
            processor.save_pretrained(tmp)
        if meta:
            (tmp / "grouprl_meta.json").write_text(json.dumps(meta, indent=2))
        with_umask_modes(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def plain_copy(model, state_dict: dict):
    """A model of `model`'s class and config (LoRA adapters included) holding `state_dict`'s
    tensors, without copying them, the weights it lacks left on the meta device: what a sharded
    LoRA policy writes its adapters from (FSDP modules cannot be deep-copied)."""
    import torch

    lora = getattr(model, "peft_config", None)
    base = model.get_base_model() if lora else model
    with torch.device("meta"):  # no memory until the weights are assigned
        fresh = type(base)(base.config)
    if lora:
        from peft import get_peft_model

        fresh = get_peft_model(fresh, copy.deepcopy(lora[model.active_adapter]))
    fresh.load_state_dict(state_dict, assign=True, strict=False)
    return fresh.eval()


def _hf(model):
    """The Hugging Face model (inside a sharded root, or itself)."""
    from grouprl.trainer.parallel import inner

    return inner(model)


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def published_dtype(model):
    """The dtype the model's weights are published in (its checkpoint's config, recorded when it
    loaded: `models.load_causal_lm`), else its parameters'."""
    base = _base(_hf(model))
    dtype = getattr(base, "published_dtype", None)
    if dtype is None or not dtype.is_floating_point:
        dtype = next(p.dtype for p in base.parameters() if p.is_floating_point())
    return dtype
