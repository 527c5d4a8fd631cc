"""Field docs (the docstring under each field), for `grouprl train --explain` and error messages."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
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
            lines.append(f"{key} = {to_dict(value)!r}  # {docs.get(f.name, '')}")
            item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list else None
            if dataclasses.is_dataclass(item):  # e.g. reward.components: document each item's keys
                lines.extend(explain(item, key + "[]."))
    return lines

