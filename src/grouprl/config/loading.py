"""Loading: YAML, dotted overrides (verl names translated on the way), type checks and
coercion into the tree, then the cross-section rules.

An override reaches into a list of entries by index, `reward.judges[0].model=m` or
`reward.judges.0.model=m`: the field of an entry that exists changes, its other fields stay as
the file (or the default list) has them. An index names an existing entry only; to add one, set
the whole list (`reward.judges=[{name: a}, {name: b}]`).
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from grouprl.errors import ConfigError

from .keys import check_structure, first_leaf, unknown_key
from .overrides import apply_override
from .reward import RewardConfig
from .rules import validate
from .translate import is_source_key, show, translate
from .tree import Config, all_keys, field_default, to_dict

_logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- types
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert: int -> float) `value` against the annotation `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value is None:  # a YAML section whose keys are all commented out
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping of settings, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is Literal:
        if isinstance(value, bool) and ("off" if value is False else "on") in typing.get_args(tp):
            value = "off" if value is False else "on"  # YAML reads a bare off / on as a bool
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")
    if origin is list:
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            # a single string where a list of strings is expected is a common, harmless slip
            if isinstance(value, str) and typing.get_args(tp)[0] is str:
                return [value]
            raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if value is None:  # `key=` on the command line (or `key:` in YAML): the empty string, "off"
            return ""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    raise TypeError(f"unsupported annotation {tp!r} for {key}")  # an internal bug, not user input


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise unknown_key(prefix, key, names, first_leaf(value))
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


# ----------------------------------------------------------------------------- files
def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML (if given), apply dotted overrides, type-check and validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            raise ConfigError(f"malformed YAML in {p}{where}: {getattr(e, 'problem', e)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
        _files_beside(tree, p.resolve().parent)
    grouprl_keys = all_keys()
    source = [item for item in overrides if is_source_key(item.partition("=")[0], grouprl_keys)]
    ours = [item for item in overrides if item not in source]
    for item in ours:
        apply_override(tree, item)
    if source:  # verl's or TRL's names: the one translator, after grouprl's own overrides
        named = {item.partition("=")[0].strip().lstrip("+") for item in ours}
        _, report = translate(source, named_ours=named, grouprl_keys=grouprl_keys, tree=tree)
        if report.not_taken:
            listed = "; ".join(f"{k}={show(v)} ({why})" for k, v, why in report.not_taken)
            raise ConfigError(f"{len(report.not_taken)} {report.source} override(s) not taken: {listed}")
        if report.overlong is not None:  # DAPO's overlong buffer: one more reward component
            reward = tree.setdefault("reward", {})
            components = reward.get("components") or to_dict(field_default(RewardConfig, "components"))
            reward["components"] = [*components, {"name": "overlong", "function": "overlong_penalty", "weight": 1.0,
                                                  "kwargs": report.overlong}]  # fmt: skip
        for key, _, why in report.no_effect:
            _logger.warning("%s key '%s' has no effect in grouprl: %s", report.source, key, why)
    return from_dict(tree)


def _files_beside(tree: dict[str, Any], folder: Path) -> None:
    """A recipe's own files named relative to it (reward files, judge prompt templates) are found
    from any directory: a relative path that is not there from the current directory but is
    beside the config file becomes that file's absolute path."""
    reward = tree.get("reward")
    if not isinstance(reward, dict):
        return

    def beside(text: str) -> str:
        path = Path(text)
        if path.is_absolute() or text.startswith("~") or path.exists() or not (folder / path).is_file():
            return text
        return str(folder / path)

    for c in reward.get("components") or []:
        if isinstance(c, dict) and isinstance(c.get("function"), str):
            file, sep, name = c["function"].rpartition(":")
            if sep and file.endswith(".py"):
                c["function"] = f"{beside(file)}:{name}"
    for j in reward.get("judges") or []:
        if isinstance(j, dict) and isinstance(j.get("prompt_template"), str) and not j["prompt_template"].startswith("builtin:"):
            j["prompt_template"] = beside(j["prompt_template"])


def from_dict(tree: dict[str, Any]) -> Config:
    """The tree from plain data (a parsed YAML file, `to_dict`'s output shipped to another
    process), checked as a file is."""
    check_structure(tree, Config)
    return validate(_build(Config, tree))
