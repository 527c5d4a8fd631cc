"""Which layout a data file is in and whether it holds what a run needs, read cheaply (a
parquet file's schema and first rows of the text columns, a jsonl file's first lines): the
lines `--dry-run` prints per file, and one `DataError` line when a needed column is absent.

Layouts: conversations (`messages`, for `grouprl sft` only), verl (`prompt`, optional
`reward_model.ground_truth`, `images`, `extra_info`, `data_source`) and plain (`question`,
optional `answer`, `images`, ...), decided by the first of these columns a file has (the order
`dataset` and `grouprl.trainer.sft_data` read them in).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from grouprl.config import REPLY_FIELD  # sft.reply_template's placeholder, defined with the setting
from grouprl.errors import DataError

FIRST_ROWS = 8  # rows read to tell a verl conversation (`prompt` ending with an assistant turn) from a prompt
TEXT_COLUMNS = ("messages", "prompt", "reward_model", "question", "answer")  # never the images
# where a verl-layout file without reward_model.ground_truth holds its reference (TRL's datasets)
REFERENCE_COLUMNS = ("ground_truth", "solution", "answer")
LAYOUTS = (
    "verl layout (prompt, optional reward_model, extra_info, images, data_source) "
    "or plain layout (question, optional answer, id, images, gold_docs, system)"
)


def layout_of(columns: list[str], purpose: Literal["rl", "sft"] = "rl") -> str | None:
    """"conversations", "verl", "plain", or None (neither): the first layout column the file has."""
    if purpose == "sft" and "messages" in columns:
        return "conversations"
    if "prompt" in columns:
        return "verl"
    if "question" in columns:
        return "plain"
    return None


def peek(path: Path) -> tuple[list[str], list[dict[str, Any]], bool]:
    """The file's columns, its first rows (text columns only for parquet), and whether its
    `reward_model` holds a `ground_truth` (the parquet schema's struct; the first jsonl rows)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
            if parquet.metadata.num_rows == 0:
                raise DataError(f"dataset {path} is empty")
            schema = parquet.schema_arrow
            columns = list(schema.names)
            wanted = [c for c in TEXT_COLUMNS if c in columns]
            batch = next(parquet.iter_batches(batch_size=FIRST_ROWS, columns=wanted), None) if wanted else None
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataError(f"cannot read parquet file {path}: {str(e).strip().splitlines()[0]}") from None
        rows = batch.to_pylist() if batch is not None else []
        truth = "reward_model" in columns and _has_field(schema.field("reward_model").type, "ground_truth")
        return columns, rows, truth
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, start=1):
                if len(rows) == FIRST_ROWS:
                    break
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"bad JSON in {path} line {number}: {e.msg}") from None
    elif suffix == ".json":  # one JSON list: read whole
        rows = read_json(path)[:FIRST_ROWS]
    else:
        raise DataError(f"unknown dataset extension {path.suffix!r} for {path}: use .parquet, .jsonl, .json")
    rows = [r for r in rows if isinstance(r, dict)]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    truth = any(isinstance(r.get("reward_model"), dict) and "ground_truth" in r["reward_model"] for r in rows)
    return columns, rows, truth


def _has_field(arrow_type: Any, name: str) -> bool:
    import pyarrow as pa

    return pa.types.is_struct(arrow_type) and any(arrow_type.field(i).name == name for i in range(arrow_type.num_fields))


def _is_conversation(prompt: Any) -> bool:
    """A verl prompt that ends with an assistant turn is a conversation to learn (SFT)."""
    return bool(prompt) and isinstance(prompt, list) and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant"


def describe_data_file(
    path: str | Path, purpose: Literal["rl", "sft"] = "rl", reply_template: str = REPLY_FIELD
) -> str:
    """What the file is and holds, in a few words (e.g. "verl layout: prompt,
    reward_model.ground_truth, images"); a `DataError` naming the file when a column the
    `purpose` needs is absent. `rl`: prompts for training or evaluation; `sft`: conversations,
    or prompts whose ground truth becomes the assistant's reply (`reply_template`)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    columns, rows, truth = peek(path)
    if not columns:
        raise DataError(f"dataset {path} is empty")
    kind = layout_of(columns, purpose)
    images = ", images" if "images" in columns else ""
    if kind is None:
        if "messages" in columns:  # purpose rl
            raise DataError(
                f"{path} holds conversations (messages), the format of grouprl sft; RL data needs the {LAYOUTS}"
            )
        expected = f"conversations (messages), or the {LAYOUTS}" if purpose == "sft" else f"the {LAYOUTS}"
        raise DataError(f"{path} has columns {', '.join(columns)}; expected {expected}")
    if kind == "conversations":
        return f"conversations (messages{images})"
    field = "reward_model.ground_truth" if kind == "verl" else "answer"
    has_truth = truth if kind == "verl" else "answer" in columns
    if kind == "verl" and not truth:  # TRL's datasets: a reference column of its own
        found = next((c for c in REFERENCE_COLUMNS if c in columns), None)
        if found is not None:
            field, has_truth = f"{found} (as the ground truth)", True
    head = "verl layout: prompt" if kind == "verl" else "plain layout: question"
    if purpose == "rl":
        reference = f", {field}" if has_truth else f", no {field} (fine only for rewards that need no reference)"
        return head + reference + images
    if kind == "verl" and any(_is_conversation(r.get("prompt")) for r in rows):
        return f"verl layout: conversations in 'prompt' (its assistant turns are learned){images}"
    if not has_truth:
        ending = " (no prompt of its first rows ends with an assistant turn)" if kind == "verl" else ""
        raise DataError(f"{path}: {kind} layout without {field}{ending}: nothing to learn as the assistant's reply")
    shape = "as it is" if reply_template == REPLY_FIELD else f"as {reply_template!r}"
    return f"{head}, {field} as the assistant's reply ({shape}){images}"


def read_json(path: Path) -> list[dict[str, Any]]:
    """A .json file's list of records (one object per sample)."""
    try:
        records = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise DataError(f"bad JSON in {path} line {e.lineno}: {e.msg}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise DataError(f"{path} must hold a JSON list of objects (one per sample)")
    return records


def read_text(path: Path) -> str:
    """A data file's text; not UTF-8 is one clear line."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"cannot read {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
