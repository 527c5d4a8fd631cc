"""Scoring trajectories: rule rewards, user reward files, and their weighted composite."""

from grouprl.rewards.composite import CompositeReward, RewardComponent
from grouprl.rewards.loader import load_reward_function
from grouprl.rewards.rules import BUILTIN, extract_answer, extract_number

__all__ = [
    "BUILTIN",
    "CompositeReward",
    "RewardComponent",
    "extract_answer",
    "extract_number",
    "load_reward_function",
]
