"""grouprl: group-relative reinforcement learning (GRPO advantages, PPO/GSPO losses) for
language and vision-language models."""

__version__ = "0.1.0"
