"""One dataclass tree for every setting: YAML file + dotted command-line overrides.

Each field carries a one-line docstring (the string right under it); `grouprl train --explain`
prints them. Unknown keys, wrong types and impossible combinations fail in `load_config`,
before any model loads, with one line naming the key and what is allowed.

One module per job: a module per group of sections (data, model, rollout and agent, reward,
algorithm and actor, trainer, curriculum, sft), each section checking its own fields where it
is defined (its `__post_init__`); `tree` (the root `Config`), `rules` (the only checks that span
sections), `verl` (verl's names), `keys` (unknown keys), `loading` (YAML, overrides, types) and
`docs` (the field docstrings).
"""

from grouprl.errors import ConfigError

from .actor import ActorConfig, AlgorithmConfig, OptimConfig
from .curriculum import CurriculumConfig
from .data import DataConfig
from .docs import explain, field_docs
from .loading import _coerce, from_dict, load_config
from .model import LoraConfig, ModelConfig
from .overrides import apply_override
from .reward import (
    JUDGE_PREFIX,
    MODEL_PREFIX,
    JudgeConfig,
    RewardComponentConfig,
    RewardConfig,
    RewardModelConfig,
    judge_name,
    model_name,
    stages_of,
)
from .rollout import DEVICE, AgentConfig, AgentRetrieverConfig, RolloutConfig
from .rules import validate
from .sft import REPLY_FIELD, SFT_TASKS, SFTConfig
from .trainer import TrainerConfig
from .translate import is_verl_only
from .tree import Config, to_dict
from .verl import (
    GATE_DEFAULTS,
    GATES,
    NEAREST,
    NO_EFFECT,
    VALUES,
    VERL_DEFAULTS,
    VERL_KEYS,
    translate_value,
)

__all__ = [
    "DEVICE",
    "GATES",
    "GATE_DEFAULTS",
    "JUDGE_PREFIX",
    "MODEL_PREFIX",
    "NEAREST",
    "NO_EFFECT",
    "REPLY_FIELD",
    "SFT_TASKS",
    "VALUES",
    "VERL_DEFAULTS",
    "VERL_KEYS",
    "ActorConfig",
    "AgentConfig",
    "AgentRetrieverConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CurriculumConfig",
    "DataConfig",
    "JudgeConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardComponentConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainerConfig",
    "_coerce",
    "apply_override",
    "explain",
    "field_docs",
    "from_dict",
    "is_verl_only",
    "judge_name",
    "load_config",
    "model_name",
    "stages_of",
    "to_dict",
    "translate_value",
    "validate",
]
