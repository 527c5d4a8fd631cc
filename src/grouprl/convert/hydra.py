"""Hydra's `--config-path` / `--config-name` on a verl call: the named YAML read onto verl's own
defaults. Its `defaults` list names verl's own files (ppo_trainer, ppo_megatron_trainer: verl's
defaults, which convert writes anyway) or other files beside it (read in order, then the file's
own keys, `_self_`); the result is a list of `key=value` items that the command line's own
items follow (and win over), reported like them. `${a.b}` interpolations of another key are
resolved; any other (`${oc.env:...}`) stays as written and is reported.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from grouprl.config.translate import show
from grouprl.errors import ConfigError

VERL_OWN = re.compile(r"_?(generated_)?ppo(_megatron)?_trainer|evaluation|generation")
MAX_FILES = 32


def config_items(config_path: str | None, config_name: str | None, cwd: str, script: Path | None,
                 notes: list[str]) -> list[str]:  # fmt: skip
    """The items of the Hydra file a call names (empty when it names verl's own defaults)."""
    if config_name is None:
        return []
    name = config_name.removesuffix(".yaml")
    if VERL_OWN.fullmatch(name) and (config_path is None or _is_verl_own_folder(config_path)):
        notes.append(f"--config-name={name}: verl's own defaults (written for what the call leaves out)")
        return []
    folder = _find_folder(config_path or ".", cwd, script)
    if folder is None or not (folder / f"{name}.yaml").is_file():
        where = config_path or "(no --config-path)"
        raise ConfigError(f"the call's Hydra file {name}.yaml is not found in {where} (looked from {cwd} and above the "
                          "script): run convert from the folder the script runs from, so its settings are read")  # fmt: skip
    tree = _merged(folder, name, notes, depth=0)
    flat = dict(_flatten(tree))
    items = []
    for key, value in flat.items():
        value = _interpolate(value, flat)
        items.append(f"{key}={show(value)}")
    notes.append(f"--config-name={name}: {len(items)} settings read from {folder / (name + '.yaml')}, before the command line's")
    return items


def _is_verl_own_folder(path: str) -> bool:
    return path.rstrip("/").endswith(("config", "verl/trainer/config")) and not Path(path).is_absolute()


def _find_folder(path: str, cwd: str, script: Path | None) -> Path | None:
    """The folder as Hydra finds it from where the script runs; else below the folders above
    the script (a verl checkout run from its root)."""
    candidate = Path(path) if Path(path).is_absolute() else Path(cwd) / path
    if candidate.is_dir():
        return candidate
    relative = Path(cwd) / path if not Path(path).is_absolute() else Path(path)
    if script is not None:
        tail = relative.relative_to(cwd) if relative.is_relative_to(cwd) else None
        for above in [script.resolve().parent, *script.resolve().parents]:
            if tail is not None and (above / tail).is_dir():
                return above / tail
    return None


def _merged(folder: Path, name: str, notes: list[str], depth: int) -> dict:
    if depth > MAX_FILES:
        raise ConfigError(f"Hydra files in {folder} name each other more than {MAX_FILES} deep")
    path = folder / f"{name}.yaml"
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"malformed YAML in {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} holds no mapping of settings")
    merged: dict = {}
    own_placed = False
    for entry in tree.get("defaults") or []:
        if entry == "_self_":
            _deep_update(merged, _own(tree))
            own_placed = True
        elif isinstance(entry, str) and VERL_OWN.fullmatch(entry.removesuffix(".yaml")):
            continue  # verl's defaults: written by convert for whatever is left out
        elif isinstance(entry, str) and (folder / f"{entry.removesuffix('.yaml')}.yaml").is_file():
            _deep_update(merged, _merged(folder, entry.removesuffix(".yaml"), notes, depth + 1))
        else:
            notes.append(f"{path.name}: defaults entry {entry!r} not read (a verl config group or a file not beside it)")
    if not own_placed:
        _deep_update(merged, _own(tree))
    return merged


def _own(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k not in ("defaults", "hydra")}


def _deep_update(into: dict, other: dict) -> None:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_update(into[key], value)
        else:
            into[key] = value


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _interpolate(value: Any, flat: dict[str, Any]) -> Any:
    """`${a.b}`: the value of key a.b (when the file has it); anything else as written."""
    if isinstance(value, str):
        whole = re.fullmatch(r"\$\{([A-Za-z0-9_.]+)\}", value)
        if whole and whole.group(1) in flat and not isinstance(flat[whole.group(1)], str):
            return flat[whole.group(1)]
    return value
