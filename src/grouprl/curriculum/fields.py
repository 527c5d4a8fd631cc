"""Reading one value out of a log record: dotted field paths, uids (optionally cut out of a
longer string by a regex), and scores.

    get = field_getter("extra_info.uid")      # record["extra_info"]["uid"], or MISSING
    uid = UidExtractor("reference_documents", r"uid_(\\d+)_page")
    uid(record)   # first element of the list whose text matches -> the captured group
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from grouprl.errors import ConfigError

MISSING = object()  # the field is absent (distinct from a present null)


def field_getter(path: str) -> Callable[[dict[str, Any]], Any]:
    """A function record -> value at the dotted `path`, or MISSING.

    A key that itself contains dots ("rewards.ndcg" written flat) is found before the path is
    split, so both layouts of a record work.
    """
    if not path or any(not part for part in path.split(".")):
        raise ConfigError(f"field path {path!r} is empty or has an empty part")
    parts = path.split(".")

    def get(record: dict[str, Any]) -> Any:
        if path in record:
            return record[path]
        node: Any = record
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                return MISSING
            node = node[part]
        return node

    return get


def compile_uid_regex(pattern: str | None) -> re.Pattern[str] | None:
    """The compiled regex; it must have exactly one capture group (the uid)."""
    if pattern is None:
        return None
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"--uid-regex '{pattern}' is not a valid regular expression: {e}") from None
    if compiled.groups != 1:
        raise ConfigError(
            f"--uid-regex '{pattern}' has {compiled.groups} capture groups; it needs exactly one "
            r"around the uid, e.g. 'uid_(\d+)_page'"
        )
    return compiled


class UidExtractor:
    """record -> uid string, MISSING (no such field) or None (present but no usable uid).

    Without a regex the field must be a string or an integer. With a regex it is applied to the
    field's text, or to each element of a list field in order: the first match wins.
    """

    def __init__(self, field: str, regex: str | None = None):
        self.field = field
        self.get = field_getter(field)
        self.regex = compile_uid_regex(regex)

    def __call__(self, record: dict[str, Any]) -> Any:
        value = self.get(record)
        if value is MISSING or value is None:
            return value
        if self.regex is None:
            if isinstance(value, str):
                return value if value else None
            if isinstance(value, int) and not isinstance(value, bool):
                return str(value)
            return None
        items = value if isinstance(value, list) else (value,)
        for item in items:
            if isinstance(item, (str, int)) and not isinstance(item, bool):
                match = self.regex.search(str(item))
                if match is not None and match.group(1):
                    return match.group(1)
        return None


def as_score(value: Any) -> float | None:
    """A finite number (bools count as 0/1), else None."""
    if isinstance(value, (int, float)):
        score = float(value)
        return score if math.isfinite(score) else None
    return None
