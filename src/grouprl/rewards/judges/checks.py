"""Config checks for judges and gates, run by `grouprl.config.validate` before anything loads."""

from __future__ import annotations

from grouprl.config import RewardConfig
from grouprl.errors import ConfigError

JUDGE_PREFIX = "judge:"


def judge_name(function: str) -> str | None:
    """ "judge:vlm" -> "vlm"; None for any other reward spec."""
    function = function.strip()
    return function[len(JUDGE_PREFIX) :].strip() if function.startswith(JUDGE_PREFIX) else None


def check_reward_config(cfg: RewardConfig) -> None:
    from grouprl.rewards.judges.client import check_judge_config

    judges = [j.name for j in cfg.judges]
    if len(set(judges)) != len(judges) or not all(judges):
        raise ConfigError(f"config key 'reward.judges' needs unique, non-empty names, got {judges}")
    for judge in cfg.judges:
        check_judge_config(judge)
    components = {c.name: c for c in cfg.components}
    for component in cfg.components:
        name = judge_name(component.function or component.name)
        if name is not None and name not in judges:
            raise ConfigError(
                f"reward component {component.name!r} uses judge {name!r}, but reward.judges defines "
                f"{', '.join(judges) or 'none'}"
            )
        if component.gate and component.gate not in components:
            raise ConfigError(
                f"reward component {component.name!r}: gate {component.gate!r} is not a component "
                f"({', '.join(components)})"
            )
    gate_order(cfg)


def gate_order(cfg: RewardConfig) -> list[list[str]]:
    """Component names in stages: stage 0 ungated, stage k gated by stage k-1 or earlier."""
    gates = {c.name: c.gate for c in cfg.components}
    return stages_of(gates)


def stages_of(gates: dict[str, str]) -> list[list[str]]:
    """`gates` maps component -> its gate ("" = none). Raises ConfigError on a cycle."""
    depth: dict[str, int] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> int:
        if name in depth:
            return depth[name]
        if name in chain:
            cycle = " -> ".join((*chain[chain.index(name) :], name))
            raise ConfigError(f"reward component gates form a cycle: {cycle}")
        gate = gates.get(name, "")
        depth[name] = 0 if not gate else resolve(gate, (*chain, name)) + 1
        return depth[name]

    for name in gates:
        resolve(name, ())
    stages: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for name in gates:  # keep config order inside a stage
        stages[depth[name]].append(name)
    return stages
