"""Cut the uid, score, training reward and agent out of a batch of log records, from either
an Arrow table (the fast path: JSONL blocks parsed by pyarrow) or python dicts (JSON arrays,
and JSONL blocks pyarrow refuses). Both give the same `Columns` for the same records:

    uid      the field as text (strings; integers written in decimal); with a regex, its
             capture group from the field's text, or from each element of a list in order
             (first match wins); anything else (floats, bools, objects, empty text) is no uid
    score    a finite number (bools as 0/1), else NaN
    agent    the field's value as text, else None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from grouprl.curriculum.fields import MISSING, UidExtractor, as_score, field_getter


@dataclass
class Columns:
    """One batch of records; per-record lists are aligned."""

    uids: np.ndarray  # object [R]: str, or None for no uid
    scores: np.ndarray  # float64 [R], NaN = no score
    rewards: np.ndarray | None  # float64 [R], NaN = none; None when not read
    agents: np.ndarray | None  # object [R]: str or None
    uid_field_seen: bool  # some record has the uid field (null counts)
    score_field_seen: bool
    first_uid_value: Any  # the uid field of the first record that has it, for error messages
    first_keys: list[str]


class FieldExtractor:
    def __init__(
        self,
        uid_field: str,
        uid_regex: str | None,
        score_field: str,
        reward_field: str | None = None,
        agent_field: str | None = None,
    ):
        self.uid = UidExtractor(uid_field, uid_regex)
        self.uid_field, self.regex = uid_field, self.uid.regex
        self.score_field, self.reward_field, self.agent_field = score_field, reward_field, agent_field
        self.score = field_getter(score_field)
        self.reward = field_getter(reward_field) if reward_field else None
        self.agent = field_getter(agent_field) if agent_field else None

    # -- python records ------------------------------------------------------------------
    def from_records(self, records: list[dict[str, Any]]) -> Columns:
        uids, scores, uid_seen, score_seen, first_uid = [], [], False, False, MISSING
        for record in records:
            uid = self.uid(record)
            if uid is not MISSING and first_uid is MISSING:
                uid_seen, first_uid = True, self.uid.get(record)
            uids.append(None if uid is MISSING else uid)
            raw = self.score(record)
            score_seen = score_seen or raw is not MISSING
            score = as_score(raw)
            scores.append(np.nan if score is None else score)
        rewards = None
        if self.reward is not None:
            rewards = np.array([_number(as_score(self.reward(r))) for r in records], dtype=np.float64)
        agents = None
        if self.agent is not None:
            agents = _objects([_agent_text(self.agent(r)) for r in records])
        return Columns(
            _objects(uids),
            np.array(scores, dtype=np.float64),
            rewards,
            agents,
            uid_seen,
            score_seen,
            first_uid,
            list(records[0]) if records else [],
        )

    # -- arrow tables --------------------------------------------------------------------
    def from_table(self, table: pa.Table) -> Columns:
        rows = table.num_rows
        uid_column = column_at(table, self.uid_field)
        score_column = column_at(table, self.score_field)
        uids = np.full(rows, None, dtype=object) if uid_column is None else self._arrow_uids(uid_column)
        first_uid = MISSING
        if uid_column is not None and rows:
            first_uid = uid_column[0].as_py()
        rewards = None
        if self.reward_field:
            rewards = _arrow_numbers(column_at(table, self.reward_field), rows)
        agents = None
        if self.agent_field:
            agent_column = column_at(table, self.agent_field)
            agents = np.full(rows, None, dtype=object) if agent_column is None else _arrow_texts(agent_column)
        return Columns(
            uids,
            _arrow_numbers(score_column, rows),
            rewards,
            agents,
            uid_column is not None,
            score_column is not None,
            first_uid,
            list(table.column_names),
        )

    def _arrow_uids(self, column: pa.Array) -> np.ndarray:
        kind = column.type
        if self.regex is None:
            if _is_text(kind):
                return _objects([value or None for value in column.to_pylist()])
            if pa.types.is_integer(kind):
                return _objects([None if value is None else str(value) for value in column.to_pylist()])
            return np.full(len(column), None, dtype=object)
        if _is_text(kind) or pa.types.is_integer(kind):
            return self._regex_values(column)
        if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and (
            _is_text(kind.value_type) or pa.types.is_integer(kind.value_type)
        ):
            matches = self._regex_values(pc.list_flatten(column))  # [E] elements of all rows, in order
            parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)  # [E] row of each
            matched = np.flatnonzero(np.not_equal(matches, None))
            rows, first = np.unique(parents[matched], return_index=True)  # the first match of each row wins
            uids = np.full(len(column), None, dtype=object)
            uids[rows] = matches[matched[first]]
            return uids
        return np.full(len(column), None, dtype=object)

    def _regex_values(self, column: pa.Array) -> np.ndarray:
        """The capture group of each value (None: null or no match), the regex run once per distinct value."""
        if not _is_text(column.type):
            column = pc.cast(column, pa.string())
        encoded = pc.dictionary_encode(column)
        distinct = []
        for text in encoded.dictionary.to_pylist():
            match = self.regex.search(text)
            distinct.append(match.group(1) if match is not None and match.group(1) else None)
        distinct.append(None)  # index -1: a null value
        indices = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False)
        return _objects(distinct)[indices]


def column_at(table: pa.Table, dotted: str) -> pa.Array | None:
    """A top-level column, else a field inside struct columns by dotted path; None if absent."""
    if dotted in table.column_names:
        return table.column(dotted).combine_chunks()
    head, *rest = dotted.split(".")
    if head not in table.column_names:
        return None
    column = table.column(head).combine_chunks()
    for name in rest:
        if not pa.types.is_struct(column.type) or column.type.get_field_index(name) < 0:
            return None
        column = pc.struct_field(column, name)
    return column


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _arrow_numbers(column: pa.Array | None, rows: int) -> np.ndarray:
    if column is None or not (
        pa.types.is_integer(column.type)
        or pa.types.is_floating(column.type)
        or pa.types.is_boolean(column.type)
    ):
        return np.full(rows, np.nan)
    values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64, copy=True)
    values[~np.isfinite(values)] = np.nan
    return values


def _objects(values: list[Any]) -> np.ndarray:
    """A 1-D object array (np.array would nest lists, or turn an all-None list into NaNs)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _arrow_texts(column: pa.Array) -> np.ndarray:
    """Each value as text like `str()` of the parsed JSON value (None for null), [R] object."""
    if _is_text(column.type) or pa.types.is_integer(column.type):
        return pc.cast(column, pa.string()).to_numpy(zero_copy_only=False)
    return _objects([_agent_text(value) for value in column.to_pylist()])


def _number(value: float | None) -> float:
    return np.nan if value is None else value


def _agent_text(value: Any) -> str | None:
    return None if value is MISSING or value is None else str(value)
