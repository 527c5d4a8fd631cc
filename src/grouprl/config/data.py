"""The data section: datasets, prompts and how prompts are drawn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from grouprl.errors import need


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training data (parquet or jsonl, verl or plain layout). Empty: use the built-in `task`."""
    val_files: list[str] = field(default_factory=list)
    """Held-out data for evaluation. Empty with a built-in task: its held-out split."""
    task: str = "arithmetic"
    """Built-in task generated offline when train_files is empty (see `grouprl.data.tasks`)."""
    task_train_size: int = 2000
    """Number of training problems the built-in task generates."""
    task_val_size: int = 128
    """Number of held-out problems the built-in task generates."""
    task_seed: int = 0
    """Seed of the built-in task generator (the held-out split uses a disjoint stream)."""
    train_batch_size: int = 4
    """Prompts per step, before replication by rollout.n_agent."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are handled by `prompt_overflow`."""
    prompt_overflow: Literal["skip", "truncate"] = "skip"
    """What to do with an over-long prompt: skip the sample, or keep its last tokens."""
    sampler: Literal["random", "sequential", "curriculum"] = "random"
    """Order of prompts: shuffled every epoch (seeded), file order, or the online `curriculum`."""
    system_prompt: str | None = None
    """System message prepended to every prompt (a built-in task supplies its own)."""
    few_shot: bool = True
    """Built-in tasks: include one worked example turn in the prompt (small models need it)."""
    val_max_samples: int = 0
    """Evaluate on at most this many held-out samples (0 = all)."""
    image_min_pixels: int = 0
    """VLM policies: images smaller than this many pixels are scaled up (aspect kept) before the processor; 0 = no bound."""
    image_max_pixels: int = 0
    """VLM policies: images larger than this many pixels are scaled down (aspect kept) before the processor, the prompts', the pages a search shows and the crops alike; 0 = the processor's own limit."""


    def __post_init__(self) -> None:
        need(self.train_batch_size >= 1, "config key 'data.train_batch_size' must be >= 1")
        need(self.max_prompt_length >= 1, "config key 'data.max_prompt_length' must be >= 1")
        need(self.image_min_pixels >= 0, "config key 'data.image_min_pixels' must be >= 0 (0 = no bound)")
        need(self.image_max_pixels >= 0, "config key 'data.image_max_pixels' must be >= 0 (0 = the processor's)")
        need(
            not self.image_max_pixels or self.image_min_pixels <= self.image_max_pixels,
            "config key 'data.image_min_pixels' must not exceed 'data.image_max_pixels'",
        )
        need(self.val_max_samples >= 0, f"config key 'data.val_max_samples' must be >= 0, got {self.val_max_samples!r}")
