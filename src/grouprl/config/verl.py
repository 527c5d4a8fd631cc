"""verl's (and VRAG's) names for grouprl's settings: the one translation table that `grouprl
train`'s overrides, `grouprl convert` (the translator in translate.py) and the docs' mapping (docs/verl-trl.md) are made from.

VERL_KEYS: a verl key -> the grouprl key it sets; VALUES: how its value becomes grouprl's;
NO_EFFECT: verl keys grouprl has no use for, and why; GATES: verl's switches on another key;
NEAREST: verl keys grouprl does not take, with the nearest setting; VERL_DEFAULTS: what verl
does where a script is silent (ppo_trainer.yaml), as grouprl settings.
"""

from __future__ import annotations

from typing import Any

VERL_KEYS: dict[str, str] = {
    "data.train_batch_size": "data.train_batch_size",
    "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "rollout.max_response_length",
    "data.shuffle": "data.sampler",  # true -> random, false -> sequential
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.truncation": "data.prompt_overflow",
    "data.filter_overlong_prompts": "data.prompt_overflow",
    "algorithm.adv_estimator": "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_penalty": "algorithm.kl_penalty",
    "algorithm.filter_groups.enable": "curriculum.dynamic_filter",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "actor_rollout_ref.model.lora_rank": "model.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "model.lora.alpha",
    "actor_rollout_ref.actor.optim.lr": "actor.optim.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "actor.optim.warmup_ratio",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.optim.weight_decay",
    "actor_rollout_ref.actor.grad_clip": "actor.optim.grad_clip",
    "actor_rollout_ref.actor.policy_loss_mode": "actor.policy_loss",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.policy_loss",
    "actor_rollout_ref.actor.tau_pos": "actor.sapo_tau_pos",
    "actor_rollout_ref.actor.tau_neg": "actor.sapo_tau_neg",
    "actor_rollout_ref.actor.clip_ratio_low": "actor.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor.clip_high",
    "actor_rollout_ref.actor.clip_ratio_c": "actor.dual_clip",
    "actor_rollout_ref.actor.loss_agg_mode": "actor.loss_agg_mode",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.micro_batch_tokens",
    "actor_rollout_ref.actor.kl_loss_coef": "actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "actor.kl_loss_type",
    "actor_rollout_ref.actor.entropy_coeff": "actor.entropy_coef",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": "actor.fsdp_size",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "actor.fsdp_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "actor.optimizer_offload",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "actor.reference_offload",
    "actor_rollout_ref.actor.loss_scale_factor": "actor.loss_scale_factor",
    "actor_rollout_ref.rollout.n_agent": "rollout.n_agent",
    "actor_rollout_ref.rollout.n": "rollout.n_agent",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.rollout.max_model_len": "rollout.max_model_len",
    "actor_rollout_ref.rollout.response_length": "rollout.max_response_length",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "rollout.val_temperature",
    "actor_rollout_ref.rollout.multi_turn.enable": "agent.enabled",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "agent.max_turns",
    "algorithm.rollout_is_threshold": "algorithm.rollout_is_cap",
    "algorithm.rollout_correction.rollout_is": "algorithm.rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_is_cap",
    "algorithm.rollout_correction.rollout_rs_threshold_lower": "algorithm.rollout_is_lower",
    "actor_rollout_ref.actor.freeze_vision_tower": "model.freeze_vision_tower",
    "trainer.save_freq": "trainer.save_freq",
    "trainer.test_freq": "trainer.test_freq",
    "trainer.resume_mode": "trainer.resume_mode",
    "trainer.total_epochs": "trainer.total_epochs",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.experiment_name": "trainer.experiment_name",
    "trainer.project_name": "trainer.project_name",
    "trainer.val_before_train": "trainer.val_before_train",
    "trainer.logger": "trainer.loggers",
    "trainer.nnodes": "trainer.nnodes",
    "trainer.n_gpus_per_node": "trainer.n_gpus_per_node",
    # VRAG's (a verl fork) names
    "retriever.url": "agent.retriever.url",
    "max_turns": "agent.max_turns",
}


def _sampler(value: Any) -> str:
    return "random" if value else "sequential"


def _overflow(value: Any) -> str:
    """verl's data.truncation (error / left / right / middle) and filter_overlong_prompts."""
    if value is True or value in ("error", "left"):
        return "skip" if value in (True, "error") else "truncate"
    if value is False:
        return "skip"
    raise ValueError(f"{value!r}: grouprl skips an over-long prompt or keeps its last tokens (left), nothing else")


def _loggers(value: Any) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or [])
    kept = [n for n in names if n in ("console", "wandb", "tensorboard")]
    return list(dict.fromkeys(["jsonl", *kept]))  # metrics.jsonl is written whatever verl logged to


def _engine(value: Any) -> str:
    if value in ("vllm", "hf"):
        return value
    if value == "sglang":  # the same role: a serving engine colocated with the trainer
        return "vllm"
    raise ValueError(f"{value!r}: grouprl's engines are vllm and hf (its built-in one)")


def _rollout_is(value: Any) -> str:
    """verl's rollout_correction.rollout_is: null (none, verl's default), token or sequence."""
    if value in (None, "", "null", "none", False):
        return "off"
    if value in ("token", "sequence", "geometric"):
        return value
    raise ValueError(f"{value!r}: grouprl weights by token, sequence or geometric ratios, or none (null)")


def _loss_mode(value: Any) -> str:
    return "ppo" if value == "vanilla" else value


def _top_k(value: Any) -> int:
    return 0 if value in (-1, None) else int(value)


def _off_if_negative(value: Any) -> int:
    return 0 if value is None or int(value) < 0 else int(value)


VALUES: dict[str, Any] = {
    "data.shuffle": _sampler,
    "data.truncation": _overflow,
    "data.filter_overlong_prompts": _overflow,
    "trainer.logger": _loggers,
    "actor_rollout_ref.rollout.name": _engine,
    "actor_rollout_ref.actor.policy_loss.loss_mode": _loss_mode,
    "actor_rollout_ref.actor.policy_loss_mode": _loss_mode,
    "actor_rollout_ref.rollout.top_k": _top_k,
    "algorithm.rollout_correction.rollout_is": _rollout_is,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": _off_if_negative,  # -1: the ratio decides
}

NO_EFFECT: dict[str, str] = {
    "actor_rollout_ref.model.use_remove_padding": "grouprl's passes carry no padding tokens through attention anyway",
    "actor_rollout_ref.model.use_fused_kernels": "the LM head's log-probs are computed in chunks anyway",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "log-probs are computed in the update's micro-batches",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "log-probs are computed in the update's micro-batches",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "log-probs are computed in the update's micro-batches",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "log-probs are computed in the update's micro-batches",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "log-probs follow actor.micro_batch_tokens",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "log-probs follow actor.micro_batch_tokens",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "log-probs follow actor.micro_batch_tokens",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "log-probs follow actor.micro_batch_tokens",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "vLLM's own default is kept",
    "actor_rollout_ref.rollout.free_cache_engine": "vLLM sleeps between rollouts anyway (rollout.sleep_level)",
    "actor_rollout_ref.rollout.load_format": "the engine loads the policy's own weights",
    "actor_rollout_ref.rollout.mode": "vLLM runs in each rank's process",
    "actor_rollout_ref.ref.fsdp_config.forward_prefetch": "FSDP2's defaults",
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch": "FSDP2's defaults",
    "trainer.critic_warmup": "no critic: advantages are group-relative",
    "trainer.default_hdfs_dir": "checkpoints are written to the run folder",
    "data.prompt_key": "the verl layout's prompt column is read (prompt)",
    "data.image_key": "the verl layout's images column is read (images)",
    "data.return_raw_chat": "prompts are rendered with the policy's chat template anyway",
    "actor_rollout_ref.actor.use_torch_compile": "grouprl does not compile the model (torch.compile)",
    "actor_rollout_ref.actor.strategy": "FSDP2 over several ranks",
    "reward_model.reward_manager": "rewards are reward.components (convert picks verl's default scorer)",
    "custom_reward_function.name": "rewards are reward.components (convert reports the file)",
    "state_masking": "observation tokens never enter the loss anyway",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "vLLM's scheduler default is kept",
    "actor_rollout_ref.rollout.max_num_seqs": "vLLM's scheduler default is kept",
    "actor_rollout_ref.actor.entropy_checkpointing": "the entropy is computed in the LM head's chunks anyway",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": "the entropy is computed in the LM head's chunks anyway",
    "actor_rollout_ref.actor.checkpoint.save_contents": "checkpoints hold the model, optimizer and run state",
    "actor_rollout_ref.actor.checkpoint.load_contents": "checkpoints hold the model, optimizer and run state",
    "trainer.log_val_generations": "every held-out answer is written to eval/answers.jsonl",
    "reward_model.overlong_buffer.log": "the overlong penalty is logged as its component (reward/overlong)",
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": "the overlong penalty is logged as its component (reward/overlong)",
    "actor_rollout_ref.rollout.calculate_log_probs": "the engine's log-probs are kept wherever a correction needs them",
    "data.dataloader_num_workers": "prompts are read in the trainer's process",
    "data.val_batch_size": "held-out prompts are generated in the engine's batches",
    "actor_rollout_ref.hybrid_engine": "vLLM is colocated with each rank anyway",
    "actor_rollout_ref.ref.use_torch_compile": "grouprl does not compile the model (torch.compile)",
    "actor_rollout_ref.ref.strategy": "FSDP2 over several ranks",
    "actor_rollout_ref.ref.entropy_checkpointing": "the reference computes no entropy",
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": "the reference computes no entropy",
    "trainer.balance_batch": "each rank takes whole groups; the micro-batch planner balances tokens within a rank",
}

# DAPO's overlong buffer, in either spelling: one overlong_penalty reward component
OVERLONG = ("reward_model.overlong_buffer.", "reward_model.reward_kwargs.overlong_buffer_cfg.")

# keys whose meaning is a switch on another key's value (verl's gates): what the gate decides
GATES: dict[str, tuple[str, str]] = {
    "actor_rollout_ref.actor.use_kl_loss": ("actor_rollout_ref.actor.kl_loss_coef", "actor.kl_loss_coef"),
    "algorithm.use_kl_in_reward": ("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef"),
    "actor_rollout_ref.actor.use_dynamic_bsz": ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor.micro_batch_tokens"),
}
GATE_DEFAULTS = {  # verl's: gates closed, and the values behind them
    "actor_rollout_ref.actor.use_kl_loss": False,
    "algorithm.use_kl_in_reward": False,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
}

NEAREST: dict[str, str] = {
    "data.gen_batch_size": "curriculum.max_oversample (prompts drawn per step, as a multiple of the batch)",
    "algorithm.filter_groups.metric": "curriculum.dynamic_filter drops groups whose rewards do not differ",
    "algorithm.filter_groups.max_num_gen_batches": "curriculum.max_oversample",
    "reward_model.overlong_buffer.enable": "a reward component overlong_penalty (kwargs max_length, buffer_len, penalty_factor)",
    "reward_model.overlong_buffer.len": "overlong_penalty's kwargs.buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "overlong_penalty's kwargs.penalty_factor",
    "trainer.default_local_dir": "trainer.output_dir and trainer.experiment_name (the run folder)",
    "critic.optim.lr": "none: no critic (group-relative advantages)",
    "actor_rollout_ref.rollout.val_kwargs.n": "evaluation samples one answer a prompt",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "rollout.val_temperature (0 = greedy)",
    "reward_model.rm_url": "a reward.judges entry (its base_url)",
    "reward_model.rm_model": "a reward.judges entry (its model)",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "agent.tools (search, crop) with agent.retriever.url: grouprl's agent protocol, not verl's tool calls",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "rollout.val_temperature (evaluation samples at it, nucleus off)",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "rollout.val_temperature (evaluation samples at it, top-k off)",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "none: no sequence parallelism (actor.micro_batch_tokens bounds a pass)",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "none: no sequence parallelism",
    "actor_rollout_ref.model.override_config.max_position_embeddings": "none: the model's own config.json is used",
}

# what verl does where a script is silent (ppo_trainer.yaml), as grouprl settings
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "rollout.max_response_length": 512,
    "data.sampler": "random",
    "data.prompt_overflow": "skip",
    "algorithm.adv_estimator": "grpo",  # verl's is gae (a critic), refused: a script must name a group estimator
    "algorithm.rollout_is": "off",  # verl corrects nothing unless rollout_correction asks
    "model.freeze_vision_tower": False,  # verl trains a VLM's vision tower (actor.freeze_vision_tower)
    "algorithm.norm_adv_by_std": True,
    "algorithm.kl_coef": 0.0,
    "algorithm.kl_penalty": "kl",
    "actor.policy_loss": "ppo",
    "actor.clip_low": 0.2,
    "actor.clip_high": 0.2,
    "actor.dual_clip": 3.0,
    "actor.loss_agg_mode": "token-mean",
    "actor.ppo_epochs": 1,
    "actor.mini_batch_size": 256,
    "actor.kl_loss_coef": 0.0,
    "actor.kl_loss_type": "low_var_kl",
    "actor.entropy_coef": 0.0,
    "actor.micro_batch_tokens": 0,
    "actor.optim.lr": 1e-6,
    "actor.optim.warmup_ratio": 0.0,
    "actor.optim.warmup_steps": 0,
    "actor.optim.weight_decay": 0.01,
    "actor.optim.grad_clip": 1.0,
    "actor.optim.scheduler": "constant",
    "rollout.n_agent": 1,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.top_k": 0,
    "rollout.stop": [],
    "rollout.val_temperature": 0.0,
    "trainer.total_epochs": 30,
    "trainer.total_steps": 0,
    "trainer.max_time_minutes": 0.0,
    "trainer.save_freq": 0,
    "trainer.test_freq": 0,
    "trainer.val_before_train": True,
}


def translate_value(key: str, value: Any) -> Any:
    """`value` of verl key `key` as grouprl's setting takes it (ValueError: untranslatable)."""
    fn = VALUES.get(key)
    return fn(value) if fn is not None else value
