"""Read parquet / jsonl / json datasets in the verl (VRAG) or the plain layout into Samples.

The layout is detected per file from its columns:
- verl: `prompt` (list of {role, content}), optional `data_source`, `images`,
  `reward_model` ({style, ground_truth}), `extra_info` (dict; `index`/`id`/`uid`, gold pages).
- plain: `question`, optional `answer` (none for tasks scored without one, e.g. image prompts),
  `id`, `images`, `gold_docs`, `system`.
Columns outside a layout are kept in `extra_info` (without overwriting its own keys). A verl-layout
file without `reward_model.ground_truth` (TRL's datasets: `prompt` as text or messages, and a
`solution`, `answer` or `ground_truth` column) takes its ground truth from that column.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from grouprl.data.layout import LAYOUTS, REFERENCE_COLUMNS, layout_of, read_json, read_text
from grouprl.data.sample import Sample
from grouprl.errors import DataError
from grouprl.vision.images import IMAGE_PLACEHOLDER, ImageError, check_image, count_placeholders, resolve

logger = logging.getLogger(__name__)

SUFFIXES = (".parquet", ".jsonl", ".json")
VERL_COLUMNS = ("data_source", "prompt", "images", "reward_model", "extra_info")
PLAIN_COLUMNS = ("id", "question", "answer", "images", "gold_docs", "system", "data_source")


def load_samples(paths: list[str], *, max_samples: int = 0) -> list[Sample]:
    """All samples of `paths` in order (at most `max_samples` when > 0), with unique uids.

    uid: the record's `uid`/`id` (top level, then extra_info), else `<file stem>-<extra_info.index>`,
    else the first 16 hex digits of the sha1 of the prompt messages. A repeated uid gets
    `#2`, `#3`, ... (one warning with the count). Problems are one-line `DataError`s.
    """
    if isinstance(paths, (str, Path)):
        paths = [str(paths)]
    if not paths:
        raise DataError("no dataset files given")
    samples: list[Sample] = []
    for path in map(Path, paths):
        records, columns = read_records(path)
        if not records:
            raise DataError(f"dataset {path} is empty")
        samples.extend(to_samples(records, columns, path))
        if 0 < max_samples <= len(samples):
            break
    if max_samples > 0:
        samples = samples[:max_samples]
    _make_uids_unique(samples)
    return samples


def read_records(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The file's rows as plain python dicts, and its column names (in file order)."""
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix in (".jsonl", ".json"):
        records = _read_jsonl(path) if suffix == ".jsonl" else read_json(path)
        columns = list(dict.fromkeys(key for record in records for key in record))
        return [_plain(record) for record in records], columns
    raise DataError(f"unknown dataset extension {path.suffix!r} for {path}: use {', '.join(SUFFIXES)}")


def _read_parquet(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"cannot read parquet file {path}: {_first_line(e)}") from None
    # to_pylist gives python lists/dicts/bytes; _plain catches what a writer may still leave.
    return [_plain(row) for row in table.to_pylist()], list(table.column_names)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    # split on "\n" only: JSON strings may hold U+2028, which str.splitlines would break on
    for line_number, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"bad JSON in {path} line {line_number}: {e.msg}") from None
        if not isinstance(record, dict):
            raise DataError(f"{path} line {line_number} is a {type(record).__name__}, expected an object")
        records.append(record)
    return records


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _plain(value: Any) -> Any:
    """numpy/pyarrow values -> python lists, dicts, str, int, float (bytes stay bytes)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "as_py"):  # pyarrow scalar
        return _plain(value.as_py())
    if type(value).__module__ == "numpy":  # numpy scalar or array
        return _plain(value.tolist())
    return value


# -- layouts ---------------------------------------------------------------------------
def to_samples(records: list[dict[str, Any]], columns: list[str], path: Path) -> list[Sample]:
    """The file's records as Samples, in the layout its columns say (`layout.layout_of`)."""
    kind = layout_of(columns)
    if kind == "verl":
        return [_verl_sample(record, path, row) for row, record in enumerate(records)]
    if kind == "plain":
        if "answer" not in columns:  # fine for prompts scored without a reference; a typo otherwise
            logger.warning("%s has no 'answer' column: its samples have no ground truth", path)
        return [_plain_sample(record, path, row) for row, record in enumerate(records)]
    if "messages" in columns:
        raise DataError(f"{path} holds conversations (messages), the format of grouprl sft; RL data needs the {LAYOUTS}")
    raise DataError(f"{path} has columns {', '.join(columns) or 'none'}; expected the {LAYOUTS}")


def _verl_sample(record: dict[str, Any], path: Path, row: int) -> Sample:
    messages = _messages(record.get("prompt"), path, row)
    reward_model = record.get("reward_model") or {}
    ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    truth_column = "reward_model.ground_truth" if ground_truth is not None else ""
    if ground_truth is None:  # TRL's datasets: the reference in a column of its own (kept in extra_info too)
        truth_column = next((c for c in REFERENCE_COLUMNS if record.get(c) is not None), "")
        ground_truth = record.get(truth_column) if truth_column else None
    extra_info = record.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{path} row {row}: 'extra_info' must be a dict, got {type(extra_info).__name__}")
    extra_info = _with_other_columns(dict(extra_info), record, VERL_COLUMNS)
    return Sample(
        uid=_uid(record, extra_info, path, messages),
        messages=messages,
        ground_truth=ground_truth,
        images=_images(record, messages, path, row),
        data_source=str(record.get("data_source") or ""),
        extra_info=extra_info,
        conversational=not isinstance(record.get("prompt"), str),
        truth_column=truth_column,
    )


def _plain_sample(record: dict[str, Any], path: Path, row: int) -> Sample:
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{path} row {row}: 'question' must be non-empty text")
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    messages.append({"role": "user", "content": question})
    extra_info = {"gold_docs": record["gold_docs"]} if record.get("gold_docs") is not None else {}
    extra_info = _with_other_columns(extra_info, record, PLAIN_COLUMNS)
    return Sample(
        uid=_uid(record, extra_info, path, messages),
        messages=messages,
        ground_truth=record.get("answer"),
        images=_images(record, messages, path, row),
        data_source=str(record.get("data_source") or ""),
        extra_info=extra_info,
        conversational=False,
        truth_column="answer" if record.get("answer") is not None else "",
    )


def _images(record: dict[str, Any], messages: list[dict[str, Any]], path: Path, row: int) -> list[Any]:
    """The row's images, relative paths made absolute against the data file's folder, each
    checked readable; `<image>` placeholders must match them in number. A prompt without any
    placeholder gets one per image in front of its first user message (the plain layout's
    convention; a verl prompt usually has them)."""
    images = record.get("images")
    images = [] if images is None else images if isinstance(images, list) else [images]
    placeholders = count_placeholders(messages)
    if images and not placeholders:
        user = next((m for m in messages if m.get("role") == "user"), None)
        if user is not None and isinstance(user.get("content"), str):
            user["content"] = IMAGE_PLACEHOLDER * len(images) + user["content"]
            placeholders = len(images)
    if placeholders != len(images):
        raise DataError(
            f"{path} row {row}: {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in the prompt but "
            f"{len(images)} image(s)"
        )
    resolved = [resolve(image, path.parent) for image in images]
    for k, image in enumerate(resolved):
        try:
            check_image(image)
        except ImageError as e:
            raise DataError(f"{path} row {row}: image {k}: {e}") from None
    return resolved


def _messages(prompt: Any, path: Path, row: int) -> list[dict[str, Any]]:
    if isinstance(prompt, str):  # some verl exports keep a bare user question
        return [{"role": "user", "content": prompt}]
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    ):
        raise DataError(f"{path} row {row}: 'prompt' must be a non-empty list of {{role, content}} messages")
    return [dict(m) for m in prompt]


def _with_other_columns(extra_info: dict[str, Any], record: dict[str, Any], layout: tuple[str, ...]) -> dict:
    skipped = set(layout) | {"uid"}
    for key, value in record.items():
        # "__index_level_0__" and friends are pandas bookkeeping, not data
        if key not in skipped and not key.startswith("__") and key not in extra_info:
            extra_info[key] = value
    return extra_info


def _uid(record: dict[str, Any], extra_info: dict[str, Any], path: Path, messages: list[dict]) -> str:
    for source in (record, extra_info):
        for key in ("uid", "id"):
            if source.get(key) not in (None, ""):
                return str(source[key])
    if extra_info.get("index") is not None:
        return f"{path.stem}-{extra_info['index']}"
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _make_uids_unique(samples: list[Sample]) -> None:
    """Rename repeats in place: the first keeps its uid, later ones get #2, #3, ..."""
    original = {sample.uid for sample in samples}
    seen: set[str] = set()
    next_suffix: dict[str, int] = {}
    renamed = 0
    for sample in samples:
        if sample.uid not in seen:
            seen.add(sample.uid)
            continue
        base, k = sample.uid, next_suffix.get(sample.uid, 2)
        while f"{base}#{k}" in seen or f"{base}#{k}" in original:
            k += 1
        sample.uid = f"{base}#{k}"
        next_suffix[base] = k + 1
        seen.add(sample.uid)
        renamed += 1
    if renamed:
        logger.warning("%d samples repeated an earlier uid; renamed with a #2, #3, ... suffix", renamed)
