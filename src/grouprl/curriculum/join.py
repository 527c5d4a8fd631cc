"""Read the training dataset as an Arrow table (its schema kept as is) and join its rows to
the logs' uids.

Which dataset field holds the uid (`--dataset-uid-field`):
- a dotted field, e.g. `id` or `extra_info.uid`;
- `@loader`: the uid grouprl's dataset loader gives each row (`grouprl.data.load_samples`:
  id/uid, else `<file stem>-<extra_info.index>`, else a hash of the prompt; repeats get #2,
  #3, ...), which is what grouprl's own rollouts.jsonl carries;
- `auto` (default): the first of id, uid, extra_info.uid, extra_info.id, extra_info.index
  and @loader that matches every log uid, else the one matching the most (earlier wins ties).
A uid repeated in the dataset keeps its first row; later rows are left out and listed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from grouprl.curriculum.extract import column_at
from grouprl.data.dataset import read_records
from grouprl.errors import DataError

AUTO = "auto"
LOADER = "@loader"
AUTO_FIELDS = ("id", "uid", "extra_info.uid", "extra_info.id", "extra_info.index", LOADER)
LOADER_SOURCES = ("id", "uid", "extra_info.uid", "extra_info.id")  # what load_samples reads a uid from


def read_dataset(paths: list[str]) -> pa.Table:
    """The rows of all files, in order, as one table."""
    if not paths:
        raise DataError("no dataset file given")
    tables = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"dataset file not found: {path}")
        if path.suffix.lower() == ".parquet":
            try:
                tables.append(pq.read_table(path))
            except (pa.ArrowException, OSError, ValueError) as e:
                raise DataError(f"cannot read parquet file {path}: {_first_line(e)}") from None
        else:
            records, _ = read_records(path)  # jsonl/json, or a one-line DataError
            try:
                tables.append(pa.Table.from_pylist(records))
            except (pa.ArrowException, ValueError) as e:
                raise DataError(f"cannot turn {path} into a table: {_first_line(e)}") from None
    try:
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except (pa.ArrowException, ValueError) as e:
        raise DataError(f"dataset files have incompatible columns: {_first_line(e)}") from None
    if table.num_rows == 0:
        raise DataError(f"dataset {', '.join(paths)} has no rows")
    return table


@dataclass
class Join:
    """How dataset rows and log uids met. Positions index the stats' uid list."""

    uid_field: str
    matched_rows: np.ndarray  # int64 [M] dataset row of each matched uid, in row order
    matched_stats: np.ndarray  # int64 [M] position in the stats of the same uid
    log_only: list[str] = field(default_factory=list)
    dataset_only: list[tuple[int, str]] = field(default_factory=list)  # (row, uid)
    duplicates: list[tuple[int, str]] = field(default_factory=list)  # (row, uid) of later repeats
    no_uid_rows: list[int] = field(default_factory=list)
    candidates: dict[str, int] = field(default_factory=dict)  # auto: field -> log uids it matched


def join(table: pa.Table, paths: list[str], log_uids: list[str], uid_field: str = AUTO) -> Join:
    candidates: dict[str, int] = {}
    if uid_field == AUTO:
        wanted = pa.array(log_uids, type=pa.string())
        best: tuple[str, pa.Array] | None = None
        complete = False
        for name in AUTO_FIELDS:
            if name == LOADER and best is not None and complete:
                break  # the loader would take its uids from that same field
            try:
                column = dataset_uids(table, paths, name)
            except DataError:
                continue  # e.g. @loader on a table in neither layout
            if column is None:
                continue
            candidates[name] = pc.count_distinct(
                pc.filter(column, pc.is_in(column, value_set=wanted))
            ).as_py()
            # a uid/id field with a value on every row is what the loader itself would use
            complete = complete or (name in LOADER_SOURCES and column.null_count == 0)
            if best is None or candidates[name] > candidates[best[0]]:
                best = (name, column)
            if candidates[name] == len(log_uids):
                break
        if best is None:
            raise DataError(
                f"the dataset has none of the uid fields {', '.join(AUTO_FIELDS[:-1])}; set --dataset-uid-field"
            )
        uid_field, column = best
    else:
        column = dataset_uids(table, paths, uid_field)
        if column is None:
            raise DataError(
                f"the dataset has no field '{uid_field}' (columns: {', '.join(table.column_names)}); "
                "set --dataset-uid-field"
            )

    position = {uid: i for i, uid in enumerate(log_uids)}
    result = Join(uid_field, np.empty(0, np.int64), np.empty(0, np.int64), candidates=candidates)
    first_row: dict[str, int] = {}
    rows, stats = [], []
    for row, uid in enumerate(column.to_pylist()):
        if uid is None:
            result.no_uid_rows.append(row)
        elif uid in first_row:
            result.duplicates.append((row, uid))
        else:
            first_row[uid] = row
            if uid in position:
                rows.append(row)
                stats.append(position[uid])
            else:
                result.dataset_only.append((row, uid))
    result.matched_rows = np.asarray(rows, dtype=np.int64)
    result.matched_stats = np.asarray(stats, dtype=np.int64)
    result.log_only = [uid for uid in log_uids if uid not in first_row]
    return result


def dataset_uids(table: pa.Table, paths: list[str], uid_field: str) -> pa.Array | None:
    """The uid of every row as a string array (null where empty or not an id), or None when
    the field does not exist."""
    if uid_field == LOADER:
        from grouprl.data.dataset import load_samples

        return pa.array([sample.uid for sample in load_samples(list(paths))], type=pa.string())
    column = column_at(table, uid_field)
    if column is None:
        return None
    if (
        pa.types.is_string(column.type)
        or pa.types.is_large_string(column.type)
        or pa.types.is_integer(column.type)
    ):
        column = pc.cast(column, pa.string())
        return pc.if_else(pc.equal(column, ""), pa.scalar(None, pa.string()), column)
    return pa.array([_uid_text(value) for value in column.to_pylist()], type=pa.string())


def _uid_text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else None
    if isinstance(value, str):
        return value or None
    return None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
