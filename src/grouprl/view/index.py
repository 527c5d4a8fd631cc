"""What the viewer knows of a run's JSON-lines files without reading them whole.

A `Follower` reads a growing file from where it stopped: only complete lines (a line still being
written waits for its newline), and from the start again when the file was cut or rewritten (a
resumed run drops the lines after its checkpoint), which it tells by the bytes just before
where it stopped. Two indexes sit on it:

- `RolloutIndex` (rollouts.jsonl): each step's byte range (the trainer writes a step's lines
  together, in group order) and the steps each prompt uid was drawn at. A step's page is one
  seek and one read of its range.
- `JudgeIndex` (judge.jsonl): each request id's calls (`<uid>/<sample>`: time, byte range,
  failed or not).

A line the writers wrote is read by pattern, anchored: a rollout line that begins exactly as
`RolloutWriter` begins it (`{"run": ..., "step": N, "uid": "...", "sample": N`), a judge line
that begins and ends as `JudgeLog` writes them (`{"time": T, "judge": ..., "request_id": "..."`
... `"error": ..., "cached": ..., "attempts": N}`). An anchored field can only be the top-level
key, so any other line (another key order, another writer) is parsed whole, never misread: the
writers' order is a matter of speed (parsing every line whole builds the rollouts' index about
three times slower, a second more at the first open of a 100,000-trajectory run:
benchmarks/view_index.py), and
`tests/view/test_view_index.py` checks that the writers' lines take the fast path. Every line
is read alone: one that cannot be read (cut short, not JSON, a bad escape, bytes that are not
UTF-8, a field of the wrong type) is skipped and counted (`unreadable`), and the page says so.

The indexes are kept as JSON beside the run (`<run>/.view/`, or `~/.cache/grouprl/view/<hash>/`
where the run folder is read-only or its `.view` is a link), each written to a new temp file
(O_EXCL, O_NOFOLLOW, relative to the folder opened without following a link) renamed over the
old one, and extended from where they stopped when the file has grown.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

INDEX_VERSION = 2
CHUNK = 8 << 20  # bytes read at a time while indexing
MARK = 64  # bytes before `end` that must be unchanged for the file to count as grown, not rewritten

_STRING = rb'"(?:[^"\\\x00-\x1f]|\\.)*"'  # a JSON string literal (its escapes checked when decoded)
_INT = rb"-?(?:0|[1-9][0-9]{0,17})"  # what int() reads at once (a longer one goes to the parser, which refuses it)
_NUMBER = _INT + rb"(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
_ROLLOUT_HEAD = re.compile(rb'\{"run": ' + _STRING + rb', "step": (' + _INT + rb'), "uid": (' + _STRING + rb'), "sample": ' + _INT + rb"[,}]")
_JUDGE_HEAD = re.compile(rb'\{"time": (' + _NUMBER + rb'), "judge": ' + _STRING + rb', "request_id": (' + _STRING + rb"), ")
_ERROR_KEY = b', "error": '
_JUDGE_TAIL = re.compile(rb'(null|' + _STRING + rb'), "cached": (?:true|false), "attempts": ' + _INT + rb"\}")


_DECODER = json.JSONDecoder(parse_constant=lambda _: None)


def parse_line(line: bytes) -> Any:
    """A JSON line's value, or None when it cannot be read. NaN and infinities (which strict JSON,
    and so the page, has not) read as None."""
    try:
        return _DECODER.decode(line.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, an integer of 4300+ digits; nested too deep
        return None


def _literal(literal: bytes) -> str | None:
    """A matched JSON string literal's value (None: a bad escape, or not UTF-8)."""
    try:
        return json.loads(literal) if b"\\" in literal else literal[1:-1].decode("utf-8")
    except ValueError:
        return None


def _join(parts: list[bytes]) -> bytes:
    return b"".join(parts)


def _folder_fd(folder: Path) -> int:
    """The index folder opened as itself: never through a link."""
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def index_folder(run: Path) -> Path:
    """Where a run's index files live: `<run>/.view/`, or a cache folder named by the run's path
    when the run folder cannot be written or its `.view` is a link (what is written there must
    not land elsewhere)."""
    local = run / ".view"
    try:
        local.mkdir(exist_ok=True)
        os.close(_folder_fd(local))  # a link (to a folder or to nothing) is refused here
        if os.access(local, os.W_OK):
            return local
    except OSError:
        pass
    import hashlib

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grouprl" / "view"
    folder = cache / hashlib.sha1(str(run.resolve()).encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Follower:
    """The complete lines a file gained since the last call (see the module's docstring).
    Subclasses keep what they need of each line (`add`) and start over on `reset`."""

    kind = "lines"

    def __init__(self, path: Path, store: Path | None = None):
        self.path = path
        self.store = store  # the JSON file this index is kept in (None: not kept)
        self.end = 0  # bytes read: the file's complete lines end here
        self.mark = b""  # the MARK bytes before `end`
        self.lock = threading.Lock()
        self.reset()
        if store is not None:
            self._load()

    # -- what a subclass holds ---------------------------------------------------------------
    def reset(self) -> None:
        self.end, self.mark = 0, b""
        self.unreadable = 0  # complete lines that could not be read (skipped)
        self.generation = getattr(self, "generation", -1) + 1  # how many times it started over

    def add(self, offset: int, line: bytes) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        pass

    # -- following the file ------------------------------------------------------------------
    def refresh(self) -> bool:
        """Read what the file gained; True when anything changed."""
        with self.lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size == self.end and (size == 0 or self._unchanged()):
                return False
            if size < self.end or not self._unchanged():
                self.reset()
            if size > self.end:
                self._read(size)
            if self.store is not None:
                self._save()
            return True

    def _unchanged(self) -> bool:
        if not self.end:
            return True
        try:
            with open(self.path, "rb") as f:
                f.seek(self.end - len(self.mark))
                return f.read(len(self.mark)) == self.mark
        except OSError:
            return False

    def _read(self, size: int) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.end)
            offset, pending, held = self.end, [], 0  # pending: the reads since the last newline (a line's start)
            while offset + held < size:
                chunk = f.read(min(CHUNK, size - offset - held))
                if not chunk:
                    break
                if b"\n" not in chunk:  # a line longer than a read: joined once, when it ends
                    pending.append(chunk)
                    held += len(chunk)
                    continue
                data = _join([*pending, chunk])
                last = data.rfind(b"\n")
                position = 0
                lines = data.split(b"\n")
                lines.pop()  # what follows the last newline: held for the next read
                for line in lines:
                    if line.strip():
                        self.add(offset + position, line)
                    position += len(line) + 1
                rest = data[last + 1 :]
                offset, pending, held = offset + last + 1, [rest] if rest else [], len(rest)
            if offset != self.end:
                f.seek(max(0, offset - MARK))
                self.mark = f.read(offset - max(0, offset - MARK))
                self.end = offset

    def read_lines(self, start: int, end: int) -> Iterator[bytes]:
        """The complete lines in [start, end) of the file."""
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        return (line for line in data.split(b"\n") if line.strip())

    # -- kept beside the run -----------------------------------------------------------------
    def _save(self) -> None:
        state = {"version": INDEX_VERSION, "kind": self.kind, "end": self.end, "mark": self.mark.hex(),
                 "unreadable": self.unreadable}  # fmt: skip
        state.update(self.state())
        data = json.dumps(state, separators=(",", ":")).encode()
        temp = f"{self.store.name}.{os.getpid()}.{threading.get_ident()}.partial"
        try:  # a new file (O_EXCL: never one that is there, a link included) in the folder itself
            folder = _folder_fd(self.store.parent)
        except OSError:  # an index that cannot be kept is built again next time
            return
        try:
            with contextlib.suppress(FileNotFoundError):  # one a killed viewer of this pid left (a link goes, unfollowed)
                os.unlink(temp, dir_fd=folder)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(temp, self.store.name, src_dir_fd=folder, dst_dir_fd=folder)  # replaces a link, never follows it
            except OSError:
                os.unlink(temp, dir_fd=folder)
                raise
        except OSError:
            pass
        finally:
            os.close(folder)

    def _load(self) -> None:
        try:
            folder = _folder_fd(self.store.parent)
            try:
                fd = os.open(self.store.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
            finally:
                os.close(folder)
            with os.fdopen(fd, "rb") as f:
                state = json.loads(f.read())
            if state.get("version") != INDEX_VERSION or state.get("kind") != self.kind:
                return
            self.restore(state)
            self.end, self.mark = int(state["end"]), bytes.fromhex(state["mark"])
            self.unreadable = int(state["unreadable"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            self.reset()  # missing, damaged or another's: built again
            return
        if not self._unchanged():  # rewritten since: start again
            self.reset()


class RolloutIndex(Follower):
    """rollouts.jsonl by step: `steps[step] = [start, end, count]`, `uids[uid] = [steps]`."""

    kind = "rollouts"

    def reset(self) -> None:
        super().reset()
        self.steps: dict[int, list[int]] = {}
        self.uids: dict[str, list[int]] = {}

    def add(self, offset: int, line: bytes) -> None:
        head = _ROLLOUT_HEAD.match(line)
        step, uid = (int(head.group(1)), _literal(head.group(2))) if head and line.endswith(b"}") else (None, None)
        if uid is None:  # not as the writer begins a line, or a uid it cannot have written: parsed whole
            step, uid = _step_and_uid(parse_line(line))
            if uid is None:
                self.unreadable += 1
                return
        span = self.steps.get(step)
        end = offset + len(line) + 1
        if span is None:
            self.steps[step] = [offset, end, 1]
        else:  # a step's lines are contiguous
            span[1], span[2] = end, span[2] + 1
        seen = self.uids.setdefault(uid, [])
        if not seen or seen[-1] != step:
            seen.append(step)

    def state(self) -> dict[str, Any]:
        return {"steps": [[s, *span] for s, span in self.steps.items()], "uids": self.uids}

    def restore(self, state: dict[str, Any]) -> None:
        self.steps = {int(s): [int(a), int(b), int(n)] for s, a, b, n in state["steps"]}
        self.uids = {str(k): [int(s) for s in v] for k, v in state["uids"].items()}

    def records(self, step: int) -> tuple[list[dict[str, Any]], int]:
        """The step's trajectory records, in the file's order (group, then sample), and how many
        of its lines could not be read (each line alone: one bad line costs that line)."""
        span = self.steps.get(step)
        if span is None:
            return [], 0
        records, unreadable = [], 0
        for line in self.read_lines(span[0], span[1]):
            record = parse_line(line)
            at = _step_and_uid(record)[0]
            if at is None:
                unreadable += 1
            elif at == step:  # (another step's line between two of this one's belongs to that one)
                records.append(record)
        return records, unreadable


def _step_and_uid(record: Any) -> tuple[int | None, str | None]:
    """A parsed trajectory record's step and uid (a uid written as a number reads as its text);
    (None, None) for anything else."""
    if not isinstance(record, dict):
        return None, None
    step, uid = record.get("step"), record.get("uid")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(uid, (str, int)) or isinstance(uid, bool):
        return None, None
    record["uid"] = str(uid)
    return step, str(uid)


class JudgeIndex(Follower):
    """judge.jsonl by request id: `requests[id] = [[time, start, length, failed], ...]`."""

    kind = "judge"

    def reset(self) -> None:
        super().reset()
        self.requests: dict[str, list[list]] = {}

    def add(self, offset: int, line: bytes) -> None:
        call = _judge_call(line)
        if call is None:
            self.unreadable += 1
            return
        when, request, failed = call
        self.requests.setdefault(request, []).append([when, offset, len(line), failed])

    def state(self) -> dict[str, Any]:
        return {"requests": self.requests}

    def restore(self, state: dict[str, Any]) -> None:
        if not isinstance(state["requests"], dict):
            raise TypeError("requests")
        self.requests = state["requests"]  # each call's shape is checked where it is read (calls)

    def calls(self, request_id: str, after: float, until: float) -> list[list]:
        """The request's calls made in (after, until]: a step's window (a call of another shape,
        from an index file someone changed, is left out)."""
        calls = self.requests.get(request_id)
        return [c for c in calls if _is_call(c) and after < c[0] <= until] if isinstance(calls, list) else []

    def read(self, call: list) -> dict[str, Any] | None:
        """A call's record (None: its line cannot be read)."""
        with open(self.path, "rb") as f:
            f.seek(call[1])
            record = parse_line(f.read(call[2]))
        return record if isinstance(record, dict) else None


def _is_call(call: Any) -> bool:
    """[time, offset, length, failed] as JudgeIndex keeps a call."""
    return (
        isinstance(call, list) and len(call) == 4 and type(call[0]) in (int, float)
        and type(call[1]) is int and type(call[2]) is int and type(call[3]) is bool
    )  # fmt: skip


def _judge_call(line: bytes) -> tuple[float, str, bool] | None:
    """A judge.jsonl line's (time, request id, failed); None when it cannot be read."""
    head = _JUDGE_HEAD.match(line)
    at = line.rfind(_ERROR_KEY)
    tail = _JUDGE_TAIL.fullmatch(line, at + len(_ERROR_KEY)) if head and at >= 0 else None
    request = _literal(head.group(2)) if tail else None
    if request is not None:  # as JudgeLog writes a line: its first fields and its last three
        return float(head.group(1)), request, tail.group(1) != b"null"
    record = parse_line(line)  # anything else: parsed whole
    if not isinstance(record, dict):
        return None
    when, request = record.get("time"), record.get("request_id")
    if not isinstance(when, (int, float)) or isinstance(when, bool) or not isinstance(request, str):
        return None
    return float(when), request, record.get("error") is not None
