"""The root of the settings tree, one field per section, and what walks it: plain data out
(`to_dict`), every dotted key, a field's default."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any

from .actor import ActorConfig, AlgorithmConfig
from .curriculum import CurriculumConfig
from .data import DataConfig
from .model import ModelConfig
from .reward import RewardConfig
from .rollout import AgentConfig, RolloutConfig
from .sft import SFTConfig
from .trainer import TrainerConfig


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets, prompts and sampling of prompts."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn agent loop: actions, tools, observations, the frozen answer generator."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward components."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL-in-reward."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy update."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, checkpoints, logging, evaluation."""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Online curriculum sampler (data.sampler=curriculum) and dynamic filtering of zero-variance groups."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning on conversations (`grouprl sft`), e.g. the warm start before RL."""



def to_dict(obj: Any) -> Any:
    """The tree as plain data (for YAML dumps and checkpoints)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


@functools.cache
def all_keys(cls: type | None = None, prefix: str = "") -> frozenset[str]:
    """Every dotted key of the config tree."""
    cls = cls or Config
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        keys.add(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= all_keys(hints[f.name], f"{prefix}{f.name}.")
    return frozenset(keys)


def field_default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
