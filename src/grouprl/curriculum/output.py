"""Writing a curriculum folder: bucket tables with `extra_info.curriculum`, all or nothing.

The folder is assembled in a hidden temp folder beside the target and renamed into place, so
a failure at any point leaves no partial output and an earlier build untouched. An existing
target is replaced only when it is empty or an earlier build (it holds summary.json).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from grouprl.errors import DataError
from grouprl.files import temp_folder

CURRICULUM_TYPE = pa.struct(
    [
        ("score", pa.float64()),
        ("std", pa.float64()),
        ("n", pa.int64()),
        ("bucket", pa.string()),
        ("rank", pa.int64()),
    ]
)


def with_curriculum(
    table: pa.Table, *, score: np.ndarray, std: np.ndarray, n: np.ndarray, bucket: str
) -> pa.Table:
    """`table` with `extra_info.curriculum = {score, std, n, bucket, rank}` on every row
    (rank = the row's position); extra_info is created when absent, other columns untouched."""
    rows = table.num_rows
    curriculum = pa.StructArray.from_arrays(
        [
            pa.array(score, pa.float64()),
            pa.array(std, pa.float64()),
            pa.array(n, pa.int64()),
            pa.array([bucket] * rows, pa.string()),
            pa.array(np.arange(rows), pa.int64()),
        ],
        fields=list(CURRICULUM_TYPE),
    )
    if "extra_info" not in table.column_names:
        return table.append_column("extra_info", pa.StructArray.from_arrays([curriculum], ["curriculum"]))
    index = table.column_names.index("extra_info")
    extra_info = table.column(index).combine_chunks()
    if pa.types.is_null(extra_info.type):
        merged = pa.StructArray.from_arrays([curriculum], ["curriculum"])
    elif pa.types.is_struct(extra_info.type):
        # flatten() folds the struct's own nulls into its children, so a row whose extra_info
        # was null becomes {other keys: null, curriculum: {...}}
        kept = [
            (extra_info.type.field(i), child)
            for i, child in enumerate(extra_info.flatten())
            if extra_info.type.field(i).name != "curriculum"
        ]
        merged = pa.StructArray.from_arrays(
            [child for _, child in kept] + [curriculum],
            fields=[f for f, _ in kept] + [pa.field("curriculum", CURRICULUM_TYPE)],
        )
    else:
        raise DataError(
            f"the dataset's extra_info column is {extra_info.type}; expected a struct (dict per row)"
        )
    return table.set_column(index, "extra_info", merged)


def check_target(out: Path) -> None:
    """Refuse to replace a folder that is neither empty nor an earlier curriculum build."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "summary.json").is_file():
        raise DataError(
            f"--out {out} holds other files (no summary.json of an earlier build); choose another folder"
        )


@contextlib.contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """Yield a temp folder; on success it replaces `out`, on any error it is removed."""
    check_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_folder(f".{out.name}.tmp-", out.parent)
    try:
        yield temp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            try:
                os.replace(temp, out)
            except OSError:
                os.replace(old / out.name, out)  # put the earlier build back
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temp, out)
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)
