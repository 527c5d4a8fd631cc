"""Stream earlier runs' trajectory logs into per-record (uid code, score) arrays.

Two layouts, one reader: what differs is only which fields hold the uid and the score.
- grouprl's own rollouts.jsonl: `uid`, `reward`, `rewards.{component}`, `sample`, ...
- the source system's logs: one record per agent trajectory with a score field such as
  `ndcg_value`, the uid buried in another field, e.g. `reference_documents` holding paths like
  "/data/images/uid_1234_page_3.jpg" (`--uid-field reference_documents --uid-regex 'uid_(\\d+)_page'`).

Each file is a JSON array of objects or JSONL (detected from its first non-blank character).
Files are read incrementally, so memory grows with the number of records (a few numbers each)
and of distinct uids, never with the size of the text. JSONL is parsed in blocks of lines by
pyarrow (multi-threaded C++); a block pyarrow refuses is parsed line by line with `json`, and
a line that is not a JSON object is skipped and counted. A JSON array is decoded one element
at a time with `json`; one that is not valid JSON is an error (there is no safe point to
resume reading it).
"""

from __future__ import annotations

import glob
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from grouprl.curriculum.extract import FieldExtractor
from grouprl.curriculum.fields import MISSING
from grouprl.errors import DataError

MAX_LISTED_MALFORMED = 20
_CHUNK = 1 << 22  # characters read at a time from a JSON array
_RECORDS_PER_BATCH = 10_000  # dicts of a JSON array handed on at a time
_JSONL_BLOCK = 1 << 21  # bytes of JSONL lines parsed at a time (a bad line costs about two blocks)
_ARROW_BLOCK = 1 << 20  # pyarrow's unit of parallel parsing inside a block
_FEW_LINES = 64  # a refused block this short is read line by line
_WHITESPACE = re.compile(r"[ \t\r\n]*")


@dataclass
class LogFields:
    """Where the uid, the score and (optionally) the agent and the training reward live."""

    uid_field: str = "uid"
    uid_regex: str | None = None
    score_field: str = "reward"
    agent_field: str | None = None
    reward_field: str | None = "reward"
    """The training reward, read alongside a different score field to measure their correlation."""


@dataclass
class LogScores:
    """Every scored record as parallel arrays; `uids[code]` names a code."""

    uids: list[str]  # distinct uids of scored records, in first-seen order
    codes: np.ndarray  # int64 [R]  uid code of each scored record
    scores: np.ndarray  # float64 [R]
    rewards: np.ndarray  # float64 [R]  training reward of the record, NaN when absent
    agents: np.ndarray | None  # int64 [R]  agent code (-1 = none), when an agent field is given
    files: list[str]
    records: int = 0  # objects read, scored or not
    no_score: int = 0  # records with a uid but no finite score
    no_uid: int = 0  # records whose uid field is absent or yields no uid
    unscored_uids: int = 0  # uids that only appear in records without a score
    malformed: int = 0  # JSONL lines that are not a JSON object
    malformed_lines: list[str] = field(default_factory=list)  # "file:line: reason", the first few


def expand_log_paths(patterns: list[str]) -> list[Path]:
    """Files named by paths or globs, in order, each once. A pattern matching nothing is an error."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            what = "glob matches no file" if glob.has_magic(pattern) else "file not found"
            raise DataError(f"log {pattern}: {what}")
        files.extend(Path(m) for m in matches)
    return list(dict.fromkeys(files))


def read_logs(patterns: list[str], spec: LogFields) -> LogScores:
    files = expand_log_paths(patterns)
    reward_field = spec.reward_field if spec.reward_field and spec.reward_field != spec.score_field else None
    extractor = FieldExtractor(
        spec.uid_field, spec.uid_regex, spec.score_field, reward_field, spec.agent_field
    )
    out = LogScores([], np.empty(0), np.empty(0), np.empty(0), None, [str(f) for f in files])
    code_of: dict[str, int] = {}
    agent_code_of: dict[str, int] = {}
    codes, scores, rewards, agents = [], [], [], []  # numpy pieces, one per batch
    unscored: set[str] = set()
    uid_seen = score_seen = False
    first_uid: Any = MISSING
    first_keys: list[str] | None = None

    for path in files:
        for batch in _batches(path, out):
            columns = (
                extractor.from_table(batch) if isinstance(batch, pa.Table) else extractor.from_records(batch)
            )
            out.records += len(columns.uids)
            if first_keys is None and columns.first_keys:
                first_keys = columns.first_keys
            if columns.uid_field_seen and first_uid is MISSING:
                first_uid = columns.first_uid_value
            uid_seen |= columns.uid_field_seen
            score_seen |= columns.score_field_seen
            has_uid = np.not_equal(columns.uids, None)
            has_score = np.isfinite(columns.scores)
            out.no_uid += int((~has_uid).sum())
            out.no_score += int((has_uid & ~has_score).sum())
            unscored.update(columns.uids[has_uid & ~has_score].tolist())
            keep = has_uid & has_score
            codes.append(_codes(columns.uids[keep], code_of))
            scores.append(columns.scores[keep])
            if columns.rewards is not None:
                rewards.append(columns.rewards[keep])
            if columns.agents is not None:
                agents.append(_codes(columns.agents[keep], agent_code_of))

    if out.records and not uid_seen:
        raise DataError(
            f"no log record has the uid field '{spec.uid_field}' (fields of the first record: "
            f"{', '.join(first_keys or []) or 'none'}); set --uid-field"
        )
    if out.records and out.no_uid == out.records and spec.uid_regex:
        raise DataError(
            f"--uid-regex '{spec.uid_regex}' matches no value of '{spec.uid_field}' "
            f"(first value: {str(first_uid)[:120]!r})"
        )
    if out.records and not score_seen and out.no_uid < out.records:
        raise DataError(
            f"no log record has the score field '{spec.score_field}' (fields of the first record: "
            f"{', '.join(first_keys or []) or 'none'}); set --score-field"
        )
    out.uids = list(code_of)
    out.codes = np.concatenate(codes) if codes else np.empty(0, np.int64)
    out.scores = np.concatenate(scores) if scores else np.empty(0)
    out.rewards = np.concatenate(rewards) if rewards else np.full(len(out.scores), np.nan)
    if spec.agent_field:
        out.agents = np.concatenate(agents) if agents else np.empty(0, np.int64)
    out.unscored_uids = len(unscored - code_of.keys())
    return out


def _codes(values: np.ndarray, code_of: dict[str, int]) -> np.ndarray:
    """int64 code of each text (None -> -1); new texts get the next codes in first-seen order."""
    if len(values) == 0:
        return np.empty(0, dtype=np.int64)
    encoded = pc.dictionary_encode(pa.array(values, type=pa.string()))  # distinct texts in first-seen order
    table = [code_of.setdefault(text, len(code_of)) for text in encoded.dictionary.to_pylist()]
    table.append(-1)  # index -1: None
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    if encoded.indices.null_count:
        indices = np.where(encoded.indices.is_valid().to_numpy(zero_copy_only=False), indices, -1)
    return np.asarray(table, dtype=np.int64)[indices.astype(np.int64)]


# -- files -----------------------------------------------------------------------------
def _batches(path: Path, out: LogScores) -> Iterator[pa.Table | list[dict[str, Any]]]:
    """The file's records in batches: Arrow tables where pyarrow parses a JSONL block, else dicts."""
    kind = _detect(path)
    if kind == "jsonl":
        yield from _jsonl_batches(path, out)
    elif kind == "array":
        batch: list[dict[str, Any]] = []
        for record in _array_records(path, out):
            batch.append(record)
            if len(batch) == _RECORDS_PER_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch


def _detect(path: Path) -> str:
    """'array', 'jsonl', or 'empty', from the first non-blank character."""
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            stripped = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")  # a UTF-8 byte-order mark counts as blank
            if stripped:
                return "array" if stripped[:1] == b"[" else "jsonl"
    return "empty"


def _malformed(out: LogScores, path: Path, line: int, reason: str) -> None:
    out.malformed += 1
    if len(out.malformed_lines) < MAX_LISTED_MALFORMED:
        out.malformed_lines.append(f"{path}:{line}: {reason}")


def _jsonl_batches(path: Path, out: LogScores) -> Iterator[pa.Table | list[dict[str, Any]]]:
    """Blocks of whole lines, each parsed by `_parse_block`."""
    options = pj.ReadOptions(use_threads=False, block_size=_ARROW_BLOCK)  # threads lose on a busy machine
    first_line = 1
    with open(path, "rb") as f:
        rest = b""
        while True:
            chunk = f.read(_JSONL_BLOCK)
            block = rest + chunk
            if chunk:
                cut = block.rfind(b"\n") + 1
                if cut == 0:  # one line longer than a block: read on
                    rest = block
                    continue
                block, rest = block[:cut], block[cut:]
            elif block and not block.endswith(b"\n"):
                block += b"\n"  # the last line had no newline
            if not block:
                return
            lines = block.count(b"\n")
            yield from _parse_block(block, lines, first_line, path, out, options)
            first_line += lines
            if not chunk:
                return


def _parse_block(
    block: bytes, line_count: int, first_line: int, path: Path, out: LogScores, options: pj.ReadOptions
) -> Iterator[pa.Table | list[dict[str, Any]]]:
    """Whole lines (`block` ends with a newline) by pyarrow. When pyarrow refuses them, or reads
    another number of records than there are non-blank lines (two objects on one line, an
    object over several lines), each half is tried in turn, down to `_FEW_LINES` lines that
    `json` reads one by one, skipping and counting bad ones; so a bad line costs little."""
    try:
        table = pj.read_json(io.BytesIO(block), read_options=options)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        table = None
    if table is not None and table.num_rows == line_count:  # the usual case: no blank line
        yield table
        return
    lines = block.split(b"\n")[:-1]
    if table is not None and table.num_rows == len(lines) - lines.count(b""):
        yield table
        return
    if len(lines) <= _FEW_LINES:
        yield _parse_lines(lines, first_line, path, out)
        return
    half = len(lines) // 2
    for start, part in ((0, lines[:half]), (half, lines[half:])):
        yield from _parse_block(b"\n".join(part) + b"\n", len(part), first_line + start, path, out, options)


def _parse_lines(lines: list[bytes], first_line: int, path: Path, out: LogScores) -> list[dict[str, Any]]:
    records = []
    for line_number, line in enumerate(lines, start=first_line):
        if line_number == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            _malformed(out, path, line_number, getattr(e, "msg", None) or "not UTF-8 text")
            continue
        if not isinstance(record, dict):
            _malformed(out, path, line_number, f"a JSON {type(record).__name__}, not an object")
            continue
        records.append(record)
    return records


def _array_records(path: Path, out: LogScores) -> Iterator[dict[str, Any]]:
    """Objects of a top-level JSON array, decoded one at a time from a sliding text buffer."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:
        buffer, pos, eof = "", 0, False
        lines_before = 1  # line number of buffer[0]

        def line_at(i: int) -> int:
            return lines_before + buffer.count("\n", 0, i)

        def fill() -> bool:
            """Append the next chunk (dropping what is decoded); False at the end of the file."""
            nonlocal buffer, pos, eof, lines_before
            if eof:
                return False
            try:
                chunk = f.read(_CHUNK)
            except UnicodeDecodeError as e:
                raise DataError(f"cannot read {path}: not UTF-8 text ({e.reason})") from None
            if not chunk:
                eof = True
                return False
            lines_before += buffer.count("\n", 0, pos)
            buffer, pos = buffer[pos:] + chunk, 0
            return True

        def skip_blank() -> None:
            nonlocal pos
            while True:
                pos = _WHITESPACE.match(buffer, pos).end()
                if pos < len(buffer) or not fill():
                    return

        def fail(what: str) -> DataError:
            return DataError(f"{path} line {line_at(pos)}: {what} (a JSON array log must be valid JSON)")

        fill()
        skip_blank()
        if buffer[pos : pos + 1] != "[":
            raise fail("expected '['")
        pos += 1
        skip_blank()
        if buffer[pos : pos + 1] == "]":
            return
        element = 0
        while True:
            skip_blank()
            while True:
                try:
                    value, end = decoder.raw_decode(buffer, pos)
                except json.JSONDecodeError as e:
                    # an element cut off by the end of the buffer fails at (or, inside a string,
                    # before) the end: read on; any other failure is a real syntax error
                    cut_off = e.pos >= len(buffer) - 8 or e.msg.startswith("Unterminated string")
                    if cut_off and fill():
                        continue
                    pos = e.pos
                    raise fail(e.msg) from None
                if end == len(buffer) and fill():  # a number may continue in the next chunk
                    continue
                break
            element += 1
            if isinstance(value, dict):
                yield value
            else:
                _malformed(
                    out,
                    path,
                    line_at(pos),
                    f"element {element} is a JSON {type(value).__name__}, not an object",
                )
            pos = end
            skip_blank()
            separator = buffer[pos : pos + 1]
            pos += 1
            if separator == "]":
                return
            if separator != ",":
                pos -= 1
                raise fail("expected ',' or ']' after an element")
