"""`section.key=value` overrides applied to plain data (the tree a YAML file gives): keys,
list entries by index, values read as YAML. verl's and TRL's names never reach here: the
translator (translate.py) turns them into grouprl's first."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

import yaml

from grouprl.errors import ConfigError

from .keys import unknown_key
from .tree import Config, field_default, to_dict


def parse_value(text: str) -> Any:
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
    key, value = key.strip().lstrip("+"), parse_value(text)
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
