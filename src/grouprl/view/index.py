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

Both are read from the lines' first fields with a pattern (the writers' key order), not parsed
whole, and kept as JSON beside the run (`<run>/.view/`, or `~/.cache/grouprl/view/<hash>/` where
the run folder is read-only), extended from where they stopped when the file has grown.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

INDEX_VERSION = 1
CHUNK = 8 << 20  # bytes read at a time while indexing
MARK = 64  # bytes before `end` that must be unchanged for the file to count as grown, not rewritten
HEAD = 1024  # how far into a line its leading fields are looked for

_STEP = re.compile(rb'"step": (-?\d+)')
_UID = re.compile(rb'"uid": ("(?:[^"\\]|\\.)*")')
_TIME = re.compile(rb'"time": ([-+0-9.eE]+)')
_REQUEST = re.compile(rb'"request_id": ("(?:[^"\\]|\\.)*")')
_ERROR_KEY = b', "error": '


def index_folder(run: Path) -> Path:
    """Where a run's index files live: `<run>/.view/`, or a cache folder named by the run's path
    when the run folder cannot be written."""
    local = run / ".view"
    try:
        local.mkdir(exist_ok=True)
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
            offset, rest = self.end, b""
            while offset + len(rest) < size:
                chunk = f.read(min(CHUNK, size - offset - len(rest)))
                if not chunk:
                    break
                data = rest + chunk
                last = data.rfind(b"\n")
                if last < 0:
                    rest = data
                    continue
                position = 0
                lines = data.split(b"\n")
                lines.pop()  # what follows the last newline: `rest`
                for line in lines:
                    if line.strip():
                        self.add(offset + position, line)
                    position += len(line) + 1
                offset, rest = offset + last + 1, data[last + 1 :]
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
        state = {"version": INDEX_VERSION, "kind": self.kind, "end": self.end, "mark": self.mark.hex()}
        state.update(self.state())
        partial = self.store.with_name(self.store.name + ".partial")
        try:
            partial.write_text(json.dumps(state, separators=(",", ":")))
            partial.replace(self.store)
        except OSError:  # an index that cannot be kept is built again next time
            pass

    def _load(self) -> None:
        try:
            state = json.loads(self.store.read_text())
        except (OSError, ValueError):
            return
        if state.get("version") != INDEX_VERSION or state.get("kind") != self.kind:
            return
        self.restore(state)
        self.end, self.mark = int(state["end"]), bytes.fromhex(state["mark"])
        if not self._unchanged():  # rewritten since: start again
            self.reset()


def _string(match: re.Match | None) -> str | None:
    """A matched JSON string literal's value (decoded by hand unless it holds an escape)."""
    if match is None:
        return None
    literal = match.group(1)
    return json.loads(literal) if b"\\" in literal else literal[1:-1].decode("utf-8")


class RolloutIndex(Follower):
    """rollouts.jsonl by step: `steps[step] = [start, end, count]`, `uids[uid] = [steps]`."""

    kind = "rollouts"

    def reset(self) -> None:
        super().reset()
        self.steps: dict[int, list[int]] = {}
        self.uids: dict[str, list[int]] = {}

    def add(self, offset: int, line: bytes) -> None:
        step, uid = _STEP.search(line, 0, HEAD), _UID.search(line, 0, HEAD)
        if step is None or uid is None:  # leading fields out of their usual place
            try:
                record = json.loads(line)
                step_value, uid_value = int(record["step"]), str(record["uid"])
            except (ValueError, KeyError, TypeError):
                return  # not a trajectory's line
        else:
            step_value, uid_value = int(step.group(1)), _string(uid)
        span = self.steps.get(step_value)
        end = offset + len(line) + 1
        if span is None:
            self.steps[step_value] = [offset, end, 1]
        else:  # a step's lines are contiguous
            span[1], span[2] = end, span[2] + 1
        seen = self.uids.setdefault(uid_value, [])
        if not seen or seen[-1] != step_value:
            seen.append(step_value)

    def state(self) -> dict[str, Any]:
        return {"steps": [[s, *span] for s, span in self.steps.items()], "uids": self.uids}

    def restore(self, state: dict[str, Any]) -> None:
        self.steps = {int(s): [a, b, n] for s, a, b, n in state["steps"]}
        self.uids = {k: list(v) for k, v in state["uids"].items()}

    def records(self, step: int) -> list[dict[str, Any]]:
        """The step's trajectory records, in the file's order (group, then sample)."""
        span = self.steps.get(step)
        if span is None:
            return []
        return [json.loads(line) for line in self.read_lines(span[0], span[1])]


class JudgeIndex(Follower):
    """judge.jsonl by request id: `requests[id] = [[time, start, length, failed], ...]`."""

    kind = "judge"

    def reset(self) -> None:
        super().reset()
        self.requests: dict[str, list[list]] = {}

    def add(self, offset: int, line: bytes) -> None:
        when, request = _TIME.search(line, 0, HEAD), _REQUEST.search(line, 0, HEAD)
        if when is None or request is None:
            return
        # `error` is the third key from the end, after `raw`: a quote inside `raw` is escaped,
        # so the last unescaped `, "error": ` is the key itself
        at = line.rfind(_ERROR_KEY)
        failed = at >= 0 and not line.startswith(b"null", at + len(_ERROR_KEY))
        self.requests.setdefault(_string(request), []).append([float(when.group(1)), offset, len(line), failed])

    def state(self) -> dict[str, Any]:
        return {"requests": self.requests}

    def restore(self, state: dict[str, Any]) -> None:
        self.requests = state["requests"]

    def calls(self, request_id: str, after: float, until: float) -> list[list]:
        """The request's calls made in (after, until]: a step's window."""
        return [c for c in self.requests.get(request_id, []) if after < c[0] <= until]

    def read(self, call: list) -> dict[str, Any]:
        with open(self.path, "rb") as f:
            f.seek(call[1])
            return json.loads(f.read(call[2]))
