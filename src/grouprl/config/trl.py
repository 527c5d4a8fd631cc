"""TRL's names (GRPOConfig's keyword arguments, and the TrainingArguments it inherits) for
grouprl's settings, and TRL's defaults where a script is silent (TRL 0.2x's GRPOConfig: loss
`dapo`, beta 0, epsilon 0.2, 8 generations, rewards scaled per group, 512 completion tokens, lr
1e-6 on a linear schedule without warm-up, 3 epochs; the batch one process makes: 8 completions
a step, so one prompt of 8 samples).

TRL_KEYS: a TRL name -> what it becomes, in words (the docs' table, docs/verl-trl.md); `trl_values` does it.
"""

from __future__ import annotations

from typing import Any

# TRL's loss_type is an aggregation of the token losses here
_LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}

TRL_KEYS: dict[str, str] = {
    "learning_rate": "actor.optim.lr",
    "beta": "actor.kl_loss_coef (k3, as TRL's)",
    "epsilon": "actor.clip_low (and actor.clip_high unless epsilon_high is set)",
    "epsilon_high": "actor.clip_high",
    "num_generations": "rollout.n_agent",
    "num_iterations": "actor.ppo_epochs",
    "max_completion_length": "rollout.max_response_length",
    "max_prompt_length": "data.max_prompt_length",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "loss_type": "actor.loss_agg_mode (grpo: seq-mean-token-mean, bnpo/dapo: token-mean, dr_grpo: seq-mean-token-sum-norm)",
    "scale_rewards": "algorithm.norm_adv_by_std (group/true: on, none/false: off)",
    "importance_sampling_level": "actor.policy_loss (token: ppo, sequence: gspo)",
    "lr_scheduler_type": "actor.optim.scheduler",
    "warmup_ratio": "actor.optim.warmup_ratio",
    "warmup_steps": "actor.optim.warmup_steps",
    "weight_decay": "actor.optim.weight_decay",
    "max_grad_norm": "actor.optim.grad_clip",
    "num_train_epochs": "trainer.total_epochs",
    "max_steps": "trainer.total_steps (-1: 0, the epochs decide)",
    "per_device_train_batch_size": "data.train_batch_size x rollout.n_agent (completions a step, one process)",
    "gradient_accumulation_steps": "with per_device_train_batch_size: the completions a step",
    "logging_steps": "metrics.jsonl has a line every step",
    "push_to_hub": "the run folder holds the model (final/, in Hugging Face format); nothing is uploaded",
    "bf16": "actor.dtype=auto takes bf16 where the device has it",
    "remove_unused_columns": "every data column reaches a TRL-style reward",
    "entropy_coef": "actor.entropy_coef",
    "seed": "trainer.seed",
    "output_dir": "trainer.output_dir",
    "run_name": "trainer.experiment_name",
    "save_steps": "trainer.save_freq",
    "report_to": "trainer.loggers",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "use_vllm": "rollout.engine (true: vllm)",
    "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization",
}

# TRL's defaults, as grouprl settings (where TRL and grouprl's own defaults differ, or always
# written so the run does not depend on grouprl's)
TRL_DEFAULTS: dict[str, Any] = {
    "actor.optim.lr": 1e-6,
    "actor.optim.scheduler": "linear",
    "actor.optim.warmup_ratio": 0.0,
    "actor.optim.warmup_steps": 0,
    "actor.optim.weight_decay": 0.0,
    "actor.optim.grad_clip": 1.0,
    "actor.kl_loss_coef": 0.0,
    "actor.kl_loss_type": "k3",
    "actor.clip_low": 0.2,
    "actor.clip_high": 0.2,
    "actor.dual_clip": None,
    "actor.policy_loss": "ppo",
    "actor.loss_agg_mode": "token-mean",
    "actor.ppo_epochs": 1,
    "actor.mini_batch_size": 0,
    "actor.entropy_coef": 0.0,
    "algorithm.adv_estimator": "grpo",
    "algorithm.norm_adv_by_std": True,
    "algorithm.kl_coef": 0.0,
    "algorithm.rollout_is": "off",
    "rollout.n_agent": 8,
    "rollout.max_response_length": 512,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.top_k": 0,
    "data.train_batch_size": 1,
    "trainer.total_epochs": 3,
    "trainer.total_steps": 0,
    "reward.streaming": False,
}


def trl_values(key: str, value: Any, given: dict[str, Any]) -> list[tuple[str, Any]]:
    """The grouprl settings TRL's `key`=`value` sets (ValueError: no translation)."""
    simple = {"learning_rate": "actor.optim.lr", "epsilon": "actor.clip_low", "epsilon_high": "actor.clip_high",
              "num_generations": "rollout.n_agent", "num_iterations": "actor.ppo_epochs",
              "max_completion_length": "rollout.max_response_length", "max_prompt_length": "data.max_prompt_length",
              "temperature": "rollout.temperature", "top_p": "rollout.top_p", "lr_scheduler_type": "actor.optim.scheduler",
              "warmup_ratio": "actor.optim.warmup_ratio", "warmup_steps": "actor.optim.warmup_steps",
              "weight_decay": "actor.optim.weight_decay", "max_grad_norm": "actor.optim.grad_clip",
              "entropy_coef": "actor.entropy_coef", "seed": "trainer.seed", "output_dir": "trainer.output_dir",
              "run_name": "trainer.experiment_name", "gradient_checkpointing": "model.gradient_checkpointing",
              "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization"}  # fmt: skip
    if key in simple:
        return [(simple[key], value)]
    if key == "beta":
        return [("actor.kl_loss_coef", value), ("actor.kl_loss_type", "k3")]
    if key == "top_k":
        return [("rollout.top_k", 0 if value in (None, -1) else value)]
    if key == "loss_type":
        if value not in _LOSS_TYPES:
            raise ValueError(f"{value!r}: grouprl aggregates as TRL's {', '.join(_LOSS_TYPES)}")
        return [("actor.loss_agg_mode", _LOSS_TYPES[value])]
    if key == "scale_rewards":
        if value in ("group", True, "true"):
            return [("algorithm.norm_adv_by_std", True)]
        if value in ("none", False, "false"):
            return [("algorithm.norm_adv_by_std", False)]
        raise ValueError(f"{value!r}: grouprl scales by the group's std (group) or not at all (none)")
    if key == "importance_sampling_level":
        return [("actor.policy_loss", {"token": "ppo", "sequence": "gspo"}[value])] if value in ("token", "sequence") else []
    if key == "num_train_epochs":
        return [("trainer.total_epochs", int(float(value)))]
    if key == "max_steps":
        return [("trainer.total_steps", 0 if int(value) < 0 else int(value))]
    if key == "per_device_train_batch_size":
        n = int(given.get("num_generations", TRL_DEFAULTS["rollout.n_agent"]))
        completions = int(value) * int(given.get("gradient_accumulation_steps", 1))
        if completions % n:
            raise ValueError(f"{value}: TRL needs the completions a step ({completions}) to be whole groups of num_generations={n}")
        return [("data.train_batch_size", completions // n)]
    if key in ("gradient_accumulation_steps", "logging_steps", "push_to_hub", "bf16", "remove_unused_columns"):
        return []  # read with another key, or nothing to set
    if key == "save_steps":
        return [("trainer.save_freq", int(value))]
    if key == "report_to":
        names = [value] if isinstance(value, str) else list(value or [])
        return [("trainer.loggers", ["console", "jsonl", *[n for n in names if n in ("wandb", "tensorboard")]])]
    if key == "use_vllm":
        return [("rollout.engine", "vllm" if value else "hf")]
    raise ValueError(f"{value!r}: no translation")  # pragma: no cover - every key above is handled
