"""Field docs (the docstring under each field), for `grouprl train --explain` and error messages."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import typing

from .tree import Config, field_default, to_dict


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the docstring written under it (read once per class:
    finding a class's source scans its module; do not change the dict returned)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = node.value.value.strip()
    return docs


def explain(cls: type = Config, prefix: str = "") -> list[str]:
    """Every setting as `key = default  # doc`, depth first. Defaults are read from the fields,
    without making a section (whose checks would import the algorithms' registries)."""
    lines: list[str] = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(f"# {key}: {docs.get(f.name, '')}")
            lines.extend(explain(hints[f.name], key + "."))
        else:
            value = field_default(cls, f.name)
            names = source_names(key)
            note = f" ({'; '.join(names)})" if names else ""
            lines.append(f"{key} = {to_dict(value)!r}  # {docs.get(f.name, '')}{note}")
            item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list else None
            if dataclasses.is_dataclass(item):  # e.g. reward.components: document each item's keys
                lines.extend(explain(item, key + "[]."))
    return lines



def source_names(key: str) -> list[str]:
    """verl's and TRL's names for grouprl's `key`, from the one table (config/verl.py, trl.py)."""
    from .trl import TRL_KEYS
    from .verl import GATES, VERL_KEYS

    verl = sorted(name for name, ours in VERL_KEYS.items() if ours == key)
    verl += sorted(f"{gate} (a gate: false sets 0)" for gate, (_, ours) in GATES.items() if ours == key)
    trl = sorted(name for name, ours in TRL_KEYS.items() if ours.split(" ")[0] == key)
    return ([f"verl: {', '.join(verl)}"] if verl else []) + ([f"TRL: {', '.join(trl)}"] if trl else [])


def rules_for(key: str) -> list[str]:
    """The checks whose message names `key`: the section's own (its __post_init__) and the
    rules across sections (rules.py), each as its message with the values left as {...}."""
    import importlib

    found = []
    for module_name in ("rules", "actor", "data", "model", "rollout", "reward", "trainer", "curriculum"):
        module = importlib.import_module(f"grouprl.config.{module_name}")
        tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("need", "one_of"):
                for arg in node.args[1:] if getattr(node.func, "id", "") == "need" else node.args[:1]:
                    text = _message(arg)
                    if text and re.search(rf"(^|[^\w.]){re.escape(key)}($|[^\w])", text):
                        found.append(text)
    return list(dict.fromkeys(found))


def _message(node) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _message(node.left) + _message(node.right)
    return ""


def explain_key(key: str) -> list[str]:
    """`grouprl train --explain KEY`: one setting (or a section's), its default, its verl and TRL
    names and the checks that name it; a verl or TRL name is shown as the setting it becomes."""
    from grouprl.errors import ConfigError

    from .keys import unknown_key
    from .trl import TRL_KEYS
    from .verl import GATES, NEAREST, NO_EFFECT, VERL_KEYS

    key = key.strip().lstrip("+")
    lines = explain()
    if key in VERL_KEYS or key in TRL_KEYS:
        ours = VERL_KEYS.get(key) or TRL_KEYS[key].split(" ")[0]
        return [f"{key} ({'verl' if key in VERL_KEYS else 'TRL'}) sets {ours}" +
                ("" if key in VERL_KEYS else f": {TRL_KEYS[key]}"), *explain_key(ours)]  # fmt: skip
    for table, what in ((GATES, "a verl gate"), (NO_EFFECT, "a verl name with no effect in grouprl"),
                        (NEAREST, "a verl name grouprl does not take; nearest")):  # fmt: skip
        if key in table:
            detail = table[key] if not isinstance(table[key], tuple) else f"false sets {table[key][1]} to 0"
            return [f"{key}: {what}: {detail}"]
    chosen = [line for line in lines if line.startswith((f"{key} = ", f"{key}.", f"# {key}:", f"# {key}."))]
    if not chosen:
        section, _, leaf = key.rpartition(".")
        siblings = [line.split(" ")[0].rpartition(".")[2] for line in lines
                    if " = " in line and line.split(" ")[0].rpartition(".")[0] == section]  # fmt: skip
        raise unknown_key(f"{section}." if section else "", leaf, siblings) if section else ConfigError(f"unknown config key '{key}'")
    checks = rules_for(key) if any(line.startswith(f"{key} = ") for line in chosen) else []
    return chosen + [f"  checked: {c}" for c in checks]


def settings_page(cls: type = Config, prefix: str = "", depth: int = 2) -> list[str]:
    """The docs site's settings reference (docs/reference/settings.md) in Markdown: a section per
    settings section, a row per setting (key, default, meaning, verl and TRL names), made from
    the same fields and table as `--explain` (`python -m grouprl.config.docs` prints it)."""
    lines = ["# Settings", "", "Every setting, its default and what it means; generated from the settings' own",
             "docstrings and the verl/TRL name table (`grouprl train --explain KEY` shows one, with the",
             "checks that name it)."] if not prefix else []  # fmt: skip
    docs, hints, rows, nested = field_docs(cls), typing.get_type_hints(cls), [], []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append((key, hints[f.name], docs.get(f.name, "")))
            continue
        names = "; ".join(source_names(key))
        default = to_dict(field_default(cls, f.name))
        rows.append(f"| `{key}` | `{default!r}` | {_cell(docs.get(f.name, ''))} | {_cell(names)} |")
        item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list else None
        if dataclasses.is_dataclass(item):
            nested.append((key + "[]", item, f"each entry of `{key}`"))
    if rows:
        lines += ["", "| key | default | meaning | verl / TRL |", "|---|---|---|---|", *rows]
    for key, sub, doc in nested:
        lines += ["", f"{'#' * depth} `{key}`", "", _cell(doc)]
        lines += settings_page(sub, key + ".", min(depth + 1, 4))
    return lines


def _cell(text: str) -> str:
    """Text fit for a Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


if __name__ == "__main__":
    print("\n".join(settings_page()))
