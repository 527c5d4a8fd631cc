"""Scoring trajectories: rule rewards, user reward files, judges, and their weighted composite."""

from grouprl.rewards.composite import CompositeReward, RewardComponent, groups_to_drop
from grouprl.rewards.loader import BUILTIN, load_reward_function
from grouprl.rewards.rules import extract_answer, extract_number

__all__ = [
    "BUILTIN",
    "CompositeReward",
    "RewardComponent",
    "extract_answer",
    "extract_number",
    "groups_to_drop",
    "load_reward_function",
]
