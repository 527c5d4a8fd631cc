"""Unknown keys: the structure check that names them before any type check, and the line that
says what was meant (a close key, the verl name it translates, the section a key belongs to)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from grouprl.errors import ConfigError

from .tree import Config, all_keys
from .verl import NEAREST, NO_EFFECT, VERL_KEYS


def first_leaf(value: Any) -> str:
    """What follows an unknown key down to its first leaf: `.actor.clip_ratio_low` for
    {actor: {clip_ratio_low: ...}}, "" for a plain value."""
    rest = ""
    while isinstance(value, dict) and value:
        key, value = next(iter(value.items()))
        rest += f".{key}"
    return rest


def _paths_named(name: str, cls: type = Config, prefix: str = "") -> list[str]:
    """Keys below the top level (outside lists of entries) whose last part is `name`: where a
    key written at the top level belongs (judges -> reward.judges)."""
    found = []
    for f_name, tp in typing.get_type_hints(cls).items():
        if f_name == name and prefix:
            found.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            found += _paths_named(name, tp, f"{prefix}{f_name}.")
    return found


def unknown_key(prefix: str, key: str, names: list[str], rest: str = "") -> ConfigError:
    """One line for a key its section lacks (`prefix` + `key`, then `rest` down to a leaf):
    the keys close to it (difflib; a verl name with the key it becomes) and what the section
    allows."""
    full = f"{prefix}{key}{rest}"
    if full in VERL_KEYS:  # a verl name in a file: only overrides translate them
        return ConfigError(
            f"config key '{full}' is a verl name, which only command-line overrides take; write {VERL_KEYS[full]}"
        )

    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    # a key of this section, where what follows it exists too (a hint names only keys that exist)
    scored = [
        (ratio(key, n), f"{prefix}{n}{rest}", False)
        for n in names
        if not rest or "[" in rest or f"{prefix}{n}{rest}" in all_keys()
    ]
    parent, _, leaf = full.rpartition(".")  # verl names: the mistyped leaf among its siblings
    verl_names = {**{n: n for n in [*NO_EFFECT, *NEAREST]}, **VERL_KEYS}
    scored += [
        (ratio(leaf, name.rpartition(".")[2]), f"{name} ({ours})" if ours != name else name, True)
        for name, ours in verl_names.items()
        if name.rpartition(".")[0] == parent
    ]
    best = max((s for s, _, _ in scored), default=0.0)
    # difflib's usual cutoff, and only those about as close as the best (clip_ratio_low, not _c)
    close = sorted((x for x in scored if x[0] >= max(0.6, best - 0.1)), reverse=True)[:3]
    verl = any(is_verl for _, _, is_verl in close)
    suggestions = list(dict.fromkeys(shown for _, shown, _ in close))
    if not suggestions and not prefix:  # a section's key written at the top level
        suggestions = [path + rest for path in _paths_named(key)][:3]
    hint = f"; did you mean {' or '.join(suggestions)}?" if suggestions else ""
    verl_roots = {name.split(".")[0] for name in VERL_KEYS} - {f.name for f in dataclasses.fields(Config)}
    if verl or full.split(".")[0] in verl_roots:
        unmapped = ": not a verl name grouprl reads (docs/verl-trl.md lists those it does)"
        return ConfigError(f"unknown config key '{full}'{hint or unmapped}")
    section = prefix.rstrip(".") or "the top level"
    return ConfigError(f"unknown config key '{prefix}{key}'{hint or ';'} allowed in {section}: {', '.join(names)}")


def check_structure(tree: Any, cls: type, prefix: str = "") -> None:
    """Name unknown keys before type checks, so the message points at the typo."""
    if not isinstance(tree, dict):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in tree.items():
        if key not in names:
            raise unknown_key(prefix, key, names, first_leaf(value))
        if dataclasses.is_dataclass(hints[key]):
            check_structure(value, hints[key], f"{prefix}{key}.")

