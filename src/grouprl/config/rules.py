"""The checks of a loaded tree as a whole: the rules that span sections (the one place that
checks settings of more than one section together), and two checks of one section that must
not run whenever the section is made (`_engine_shards` and `_val_metric` say why). Each
section checks its own fields when it is made (its `__post_init__`), so a loaded tree reaches
these rules with every section already valid on its own."""

from __future__ import annotations

from grouprl.errors import need

from .tree import Config


def validate(cfg: Config) -> Config:
    """The loaded tree's rules, one ConfigError line for the first one broken; returns `cfg`."""
    _engine_shards(cfg)
    need(
        cfg.rollout.max_staleness == 0 or cfg.model.quantization == "none",
        f"config key 'rollout.max_staleness' must be 0 with model.quantization={cfg.model.quantization}: "
        "asynchronous generation runs on a copy of the policy, which packed 4/8-bit weights do not make",
    )
    need(
        not cfg.curriculum.dynamic_filter or cfg.data.sampler == "curriculum",
        "config key 'curriculum.dynamic_filter' needs data.sampler=curriculum",
    )
    mini = cfg.actor.mini_batch_size or cfg.data.train_batch_size
    need(
        cfg.data.train_batch_size % mini == 0,
        f"config key 'actor.mini_batch_size' ({mini}) must divide data.train_batch_size ({cfg.data.train_batch_size})",
    )
    _val_metric(cfg)
    need(
        cfg.model.quantization == "none" or cfg.rollout.engine != "vllm",
        f"config key 'model.quantization={cfg.model.quantization}' cannot feed rollout.engine=vllm: its pushes "
        "would add LoRA's deltas to bitsandbytes' packed bytes; use rollout.engine=hf, or LoRA without "
        "quantization (the frozen base in bf16 takes half of float32's memory)",
    )
    need(
        cfg.algorithm.ref_refresh_steps == 0 or cfg.model.lora.rank == 0,
        "config key 'algorithm.ref_refresh_steps' needs full fine-tuning (model.lora.rank=0): "
        "with LoRA the reference is the base model with adapters disabled",
    )
    return cfg


def _engine_shards(cfg: Config) -> None:
    """rollout.tensor_parallel_size with engine=vllm. Not the rollout section's own check: the
    vllm engine refuses it itself, with its own line, where the section was made in code or where
    an `auto` engine becomes vllm on the device (`settle_for_devices`); a loaded tree gets this
    line before anything loads."""
    need(
        cfg.rollout.tensor_parallel_size == 1 or cfg.rollout.engine != "vllm",
        "config key 'rollout.tensor_parallel_size' must be 1: every rank runs its own vllm engine in its "
        "process, holding the whole model on its GPU, so the model's bf16 weights, its KV cache and the rank's "
        "shards must fit one GPU (the weights take about 2 bytes a parameter, 15 GB for a 7B model; docs/scale/memory.md, "
        "the memory plan); an engine sharded over several GPUs is not supported",
    )


def _val_metric(cfg: Config) -> None:
    """reward.val_metric is what a run's evaluation reports (the trainer's, `grouprl sft`'s held-out
    answers). Not the reward section's own check: the rewards room makes reward sections of its
    own, with no evaluation to name a component for."""
    names = [c.name for c in cfg.reward.components]
    need(
        cfg.reward.val_metric in names or cfg.reward.val_metric == "reward",
        f"config key 'reward.val_metric' must be 'reward' or a component name ({', '.join(names)}), "
        f"got {cfg.reward.val_metric!r}",
    )
