"""The sft section: supervised fine-tuning on conversations (`grouprl sft`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from grouprl.errors import need

from .actor import OptimConfig

SFT_TASKS = ("slides", "shapes")  # built-in tasks with gold trajectories
REPLY_FIELD = "{ground_truth}"  # where a reply template puts the sample's ground truth


@dataclass
class SFTConfig:
    train_files: list[str] = field(default_factory=list)
    """Conversations to learn (jsonl/json/parquet: `messages`, optional `train_on`; or RL data in the verl or plain layout, see reply_template). Empty: generate `task`."""
    val_files: list[str] = field(default_factory=list)
    """Held-out conversations for the eval loss. Empty with a built-in task: its held-out split."""
    reply_template: str = REPLY_FIELD
    """RL data as SFT data: the assistant's reply learned after a prompt that does not end with an assistant turn, {ground_truth} replaced by the sample's reward_model.ground_truth (plain layout: answer), e.g. "<answer>{ground_truth}</answer>"."""
    val_rl_files: list[str] = field(default_factory=list)
    """RL held-out data (verl or plain layout) answered greedily before and after training (and every eval_freq steps) and scored with reward.val_metric, as `grouprl eval`: eval/accuracy, answers.jsonl."""
    val_rl_max_samples: int = 0
    """Answer at most this many prompts of val_rl_files (0 = all)."""
    task: str = "slides"
    """Built-in task whose gold trajectories are generated when train_files is empty (slides)."""
    task_dir: str = ""
    """Folder the task's files (corpus, images, questions, trajectories) go to; "" = <output_dir>/data."""
    task_train_size: int = 200
    """Training questions (gold trajectories) the built-in task generates."""
    task_val_size: int = 50
    """Held-out questions the built-in task generates."""
    task_seed: int = 0
    """Seed of the built-in task (the same seed gives the same corpus and questions)."""
    task_self_answer: bool = False
    """Gold trajectories end with the policy's own <answer> (for agent.answer_generator: none), not <search_complete>."""
    task_page_images: bool = False
    """slides: each gold search observation also shows the first hit's page image, as the search tool shows a VLM policy (VLM models only)."""
    epochs: int = 1
    """Passes over the training conversations when max_steps is 0."""
    max_steps: int = 0
    """Optimizer steps (0 = `epochs` passes)."""
    batch_size: int = 8
    """Conversations per optimizer step."""
    micro_batch_size: int = 4
    """Conversations per forward/backward (gradient accumulation inside a batch)."""
    max_length: int = 1024
    """Conversations longer than this many tokens are handled by `overflow`."""
    overflow: Literal["skip", "truncate"] = "skip"
    """An over-long conversation is skipped, or cut to its first max_length tokens (both counted)."""
    seed: int = 42
    """Seed of the data order and initialisation."""
    output_dir: str = "runs/sft"
    """Run folder: metrics.jsonl, samples.jsonl, and the model in Hugging Face format in <output_dir>/model."""
    eval_freq: int = 0
    """Held-out loss every N steps (0 = before and after training only)."""
    eval_max_conversations: int = 16
    """Compute the held-out loss on at most this many conversations (0 = all)."""
    preview_samples: int = 8
    """Held-out prompts answered greedily (first turn) before and after training, into samples.jsonl (0 = none)."""
    preview_max_tokens: int = 64
    """Most tokens of a preview answer."""
    logits_chunk_size: int = 256
    """Trained positions per chunk of the LM head (bounds the [tokens, vocab] tensor)."""
    merge_lora: bool = True
    """With LoRA: save the merged model (loads with plain from_pretrained) instead of the adapters."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console, jsonl, wandb, tensorboard (the last two only when installed)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule (set lr: 1e-6 is RL's default; SFT wants ~1e-4). trainer.device and `model` apply too."""


    def __post_init__(self) -> None:
        """Impossible sft settings, one line each (checked when loaded, before any model loads)."""
        need(
            bool(self.train_files) or self.task in SFT_TASKS,
            f"config key 'sft.task' must be one of {', '.join(SFT_TASKS)} when sft.train_files is empty, got {self.task!r}",
        )
        for key in ("epochs", "batch_size", "micro_batch_size", "max_length", "logits_chunk_size", "preview_max_tokens"):
            need(getattr(self, key) >= 1, f"config key 'sft.{key}' must be >= 1, got {getattr(self, key)!r}")
        for key in ("max_steps", "eval_freq", "eval_max_conversations", "preview_samples", "task_val_size", "val_rl_max_samples"):
            need(getattr(self, key) >= 0, f"config key 'sft.{key}' must be >= 0, got {getattr(self, key)!r}")
        need(
            REPLY_FIELD in self.reply_template,
            f"config key 'sft.reply_template' must hold {REPLY_FIELD}, got {self.reply_template!r}",
        )
        need(self.task_train_size >= 1, f"config key 'sft.task_train_size' must be >= 1, got {self.task_train_size!r}")
        self.optim.check("sft.optim")
        for name in self.loggers:
            need(
                name in ("console", "jsonl", "wandb", "tensorboard"),
                f"config key 'sft.loggers' may hold console, jsonl, wandb, tensorboard, got {name!r}",
            )
