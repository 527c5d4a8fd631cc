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
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from grouprl.errors import ConfigError

from .keys import check_structure, first_leaf, unknown_key
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


# ----------------------------------------------------------------------------- overrides
def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


_KEY_PART = re.compile(r"([^\[\]]*)((?:\[\d+\])*)")


def _key_tokens(key: str) -> list[str | int]:
    """`reward.judges[0].model` -> ["reward", "judges", 0, "model"]. A bare number between dots
    (`reward.judges.0.model`) stays a string here: it is an index only where the key so far
    is a list."""
    tokens: list[str | int] = []
    for part in key.split("."):
        match = _KEY_PART.fullmatch(part)
        if match is None or not any(match.groups()):
            raise ConfigError(
                f"override key '{key}' is malformed: write section.key, and a list entry by its "
                "number (reward.judges[0].model)"
            )
        if match.group(1):
            tokens.append(match.group(1))
        tokens += [int(n) for n in re.findall(r"\d+", match.group(2))]
    return tokens


def _dotted(tokens: list[str | int]) -> str:
    """The tokens as a key again: reward.judges[0].model."""
    return "".join(f"[{t}]" if isinstance(t, int) else f".{t}" for t in tokens).lstrip(".")


def apply_override(tree: dict[str, Any], dotted: str) -> None:
    """Apply `section.key=value` to nested plain data (value parsed as YAML). A list of entries
    is indexed as `reward.judges[0].model` or `reward.judges.0.model`: only an existing entry
    (from the file, else the setting's default list), whose other fields stay."""
    if "=" not in dotted:
        raise ConfigError(f"override '{dotted}' must look like section.key=value")
    key, text = dotted.split("=", 1)
    key, value = key.strip().lstrip("+"), _parse_value(text)
    tokens = _key_tokens(key)
    node: Any = tree
    tp: Any = Config  # the annotation of `node`; None inside a free-form mapping (kwargs, fields)
    for i, token in enumerate(tokens):
        above = _dotted(tokens[:i])
        if isinstance(token, str) and token.isdigit() and isinstance(node, list):
            token = tokens[i] = int(token)
        if isinstance(token, int):
            if not isinstance(node, list):
                raise ConfigError(f"config key '{above}' is not a list; [{token}] indexes a list's entries")
            if token >= len(node):
                entries = f"{len(node)} entries" if len(node) != 1 else "1 entry"
                raise ConfigError(
                    f"config key '{_dotted(tokens[: i + 1])}': {above} has {entries}; an index names an "
                    f"existing entry (to add one, set the whole list: {above}=[...])"
                )
            child_tp = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        elif not isinstance(node, dict) or not (
            tp is None or tp is Any or typing.get_origin(tp) is dict or dataclasses.is_dataclass(tp)
        ):
            raise ConfigError(f"config key '{above}' is a value, not a section")
        elif dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if token not in hints:
                rest = _dotted(tokens)[len(_dotted(tokens[: i + 1])) :]  # what follows it: [0].model
                raise unknown_key(f"{above}." if above else "", token, list(hints), rest)
            child_tp = hints[token]
        else:
            child_tp = None
        if i == len(tokens) - 1:
            node[token] = value
            return
        child = node[token] if isinstance(token, int) else node.get(token)
        if child is None:  # not in the file; a list starts as its default entries, for an index to find
            listed = typing.get_origin(child_tp) is list and dataclasses.is_dataclass(tp)
            child = node[token] = to_dict(field_default(tp, token)) if listed else {}
        node, tp = child, child_tp



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
