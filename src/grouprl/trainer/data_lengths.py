"""The data's longest prompt for a dry run's memory plan, read as a run reads it: the data files
(or the built-in task), the policy's tokenizer and chat template, a VLM's image processor (images
counted in tokens); no weight is read. Where the data or the tokenizer cannot be read on this
machine (a GPU cluster's paths on a laptop), the plan takes the limit, and says so."""

from __future__ import annotations

import os
from pathlib import Path

from grouprl.config import Config
from grouprl.errors import UserError


def data_longest_prompt(cfg: Config) -> tuple[int | None, str]:
    """(the longest prompt in tokens, images counted, or None; a line saying where it came from)."""
    from grouprl.trainer.memory import longest
    from grouprl.trainer.models import (
        BUILTIN_VLMS,
        load_tokenizer,
        load_vision,
        model_config,
        resolve_model_path,
    )
    from grouprl.trainer.setup import PromptEncoder, load_data

    limit = f"prompts planned at data.max_prompt_length={cfg.data.max_prompt_length}"
    files = cfg.data.train_files + cfg.data.val_files
    missing = [f for f in files if not Path(f).exists()]
    if missing:
        return None, f"data: {missing[0]} is not on this machine: {limit}"
    path = cfg.model.path
    if path.startswith("builtin:") and path.split(":", 1)[1] in BUILTIN_VLMS:
        folder = Path(os.path.expanduser(cfg.model.cache_dir)) / "models" / path.split(":", 1)[1]
        if not (folder / "config.json").is_file():  # assembled at a run's first start, not by a dry run
            return None, f"data: the embedded VLM is not assembled yet: {limit}"
    try:
        model_path = resolve_model_path(cfg.model)
        tokenizer = load_tokenizer(cfg.model, model_path)
        config = model_config(cfg.model, model_path)
        train, val = load_data(cfg)
        encoder = PromptEncoder(cfg, tokenizer, load_vision(cfg, model_path, config, tokenizer))
        prompts = encoder.encode(train, "training")[0] + encoder.encode(val, "held-out")[0]
    except (UserError, OSError, ValueError) as e:
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"data: not read here ({said[:200]}): {limit}"
    found = longest(prompts)
    if found is None:
        return None, f"data: no prompt within the limit: {limit}"
    return found, (
        f"data: the longest of {len(prompts)} prompts is {found} tokens (images counted), of "
        f"data.max_prompt_length={cfg.data.max_prompt_length}: the memory plan takes it"
    )
