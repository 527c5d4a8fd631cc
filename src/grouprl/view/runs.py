"""A run folder as the viewer reads it: its metrics, its steps' groups, a sample's turns and
judge calls, its held-out answers, and the files inside it that a page may show.

A run folder is what `grouprl train` writes (`<output_dir>/<experiment_name>/`): metrics.jsonl,
rollouts.jsonl, judge.jsonl (and judge.rank<N>.jsonl), images/, config.yaml, and
`grouprl eval`'s answers.jsonl in eval/ (or any folder holding an answers.jsonl). Nothing here
writes into it but the viewer's own index (`index.index_folder`). Each line is read alone: one
that cannot be read is skipped and counted (`unreadable`, in every answer that skipped one), and
each record is shaped before it is answered (`records.py`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from grouprl.errors import UserError
from grouprl.view import records as shape
from grouprl.view.index import Follower, JudgeIndex, RolloutIndex, index_folder, parse_line

RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "config.yaml", "answers.jsonl", "eval/answers.jsonl")
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp", ".gif": "image/gif"}
SUMMARY_CHARS = 240  # of a sample's answer in a step's listing


class NotARunError(UserError):
    """A folder given to `grouprl view` that is missing or holds no run."""


class Metrics(Follower):
    """metrics.jsonl parsed, line by line as it grows."""

    kind = "metrics"

    def reset(self) -> None:
        super().reset()
        self.rows: list[dict[str, Any]] = []

    def add(self, offset: int, line: bytes) -> None:
        row = parse_line(line)
        if isinstance(row, dict) and shape.integer(row.get("step")) is not None:
            self.rows.append({str(k): v for k, v in row.items() if k == "step" or shape.number(v) is not None})
        else:
            self.unreadable += 1


class Run:
    def __init__(self, folder: str | Path, name: str):
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise NotARunError(f"{folder}: no such folder")
        if not any((path / f).is_file() for f in RUN_FILES):
            raise NotARunError(
                f"{folder} is not a run folder: it holds none of metrics.jsonl, rollouts.jsonl, "
                "config.yaml or answers.jsonl (give the folder grouprl train writes: <output_dir>/<experiment_name>)"
            )
        self.root = path.resolve()
        self.name = name
        self.store = index_folder(self.root)
        self.metrics = Metrics(self.root / "metrics.jsonl")
        self.rollouts = RolloutIndex(self.root / "rollouts.jsonl", self.store / "rollouts.index.json")
        self.judges: dict[Path, JudgeIndex] = {}
        self.step_times: dict[int, float] = {}  # when a step's lines were written (its judge window's end)
        # requests come on several threads (FastAPI's pool) and the judge logs' index on one of
        # its own: `lock` keeps the steps (metrics, rollouts), `judge_lock` the judge logs; who
        # needs both takes `judge_lock` first
        self.lock = threading.Lock()
        self.judge_lock = threading.Lock()
        self.indexing: threading.Thread | None = None

    # -- what is there -----------------------------------------------------------------------
    def refresh(self, judges: bool = True) -> None:
        """Read what the run's files gained. `judges=False`: not the judge logs (only a step's or
        a sample's page needs them, so a run opens without building their index)."""
        if judges:
            with self.current():
                return
        with self.lock:
            self._refresh_steps()

    @contextmanager
    def current(self) -> Iterator[None]:
        """Holds the run still, its steps and judge logs read up to now: a step's page is made
        inside. The judge logs' index is built (or extended) before the steps are locked, so a
        first build keeps no one from the run's steps; it is extended again after them (a
        step's judge calls are logged before its rollouts)."""
        with self.judge_lock:
            self._refresh_judges()
            with self.lock:
                self._refresh_steps()
                self._refresh_judges()
                yield

    def index_judges(self) -> threading.Thread:
        """Build the judge logs' index on a thread of its own (once; a step or sample asked for
        meanwhile waits for it rather than building it again)."""
        with self.lock:
            if self.indexing is None:
                self.indexing = threading.Thread(target=self._index_judges, name=f"view-index-{self.name}", daemon=True)
                self.indexing.start()
            return self.indexing

    def _index_judges(self) -> None:
        with self.judge_lock:
            self._refresh_judges()

    def _refresh_steps(self) -> None:
        self.metrics.refresh()
        if self.rollouts.refresh():
            self.step_times.clear()

    def _refresh_judges(self) -> None:
        for path in sorted(self.root.glob("judge*.jsonl")):
            if path not in self.judges:
                self.judges[path] = JudgeIndex(path, self.store / f"{path.stem}.index.json")
            self.judges[path].refresh()

    def evals(self) -> list[str]:
        """The folders (relative to the run, "." for the run itself) holding an answers.jsonl."""
        found = [self.root / "answers.jsonl", *sorted(self.root.glob("*/answers.jsonl"))]
        return [str(p.parent.relative_to(self.root)) for p in found if p.is_file()]

    def summary(self) -> dict[str, Any]:
        with self.lock:
            self._refresh_steps()
            steps, rows = dict(self.rollouts.steps), len(self.metrics.rows)
            unreadable = {"metrics.jsonl": self.metrics.unreadable, "rollouts.jsonl": self.rollouts.unreadable}
        unreadable.update({path.name: judge.unreadable for path, judge in list(self.judges.items())})  # as indexed so far
        return {
            "name": self.name,
            "steps": sorted(steps),
            "trajectories": sum(span[2] for span in steps.values()),
            "metric_rows": rows,
            "judge_logs": len(list(self.root.glob("judge*.jsonl"))),
            "evals": self.evals(),
            "unreadable": {name: n for name, n in unreadable.items() if n},  # lines skipped, by file
        }

    # -- one step ----------------------------------------------------------------------------
    def step_groups(self, step: int) -> dict[str, Any]:
        """A step's groups, each with its samples' figures (no full texts: those are per sample)."""
        with self.current():
            return self._step_groups(step)

    def _step_groups(self, step: int) -> dict[str, Any]:
        records, unreadable = self.rollouts.records(step)
        records = [shape.trajectory(r, turns=False) for r in records]
        window = self._window(step, records)
        groups: dict[str, dict[str, Any]] = {}
        for r in records:
            group = groups.setdefault(
                r["uid"], {"uid": r["uid"], "prompt": _cut(r.get("prompt")), "ground_truth": r.get("ground_truth"), "samples": []}
            )
            judged = self._judge_calls(r, window)
            group["samples"].append({
                "sample": r.get("sample"),
                "reward": r.get("reward"),
                "rewards": r["rewards"],
                "advantage": r.get("advantage"),
                "response_tokens": r.get("response_tokens"),
                "truncated": bool(r.get("truncated")),
                "finish_reason": r.get("finish_reason"),
                "version": r.get("version"),
                "actions": [t.get("action") for t in r["turns"]],
                "answer": _cut(r.get("response"), tail=True),
                "judge_calls": len(judged),
                "judge_failed": any(c[3] for c in judged),
            })  # fmt: skip
        for group in groups.values():
            rewards = [s["reward"] for s in group["samples"]]
            finite = [x for x in rewards if isinstance(x, (int, float)) and math.isfinite(x)]
            group["zero_variance"] = len(finite) == len(rewards) and len(set(finite)) <= 1
            group["reward_mean"] = sum(finite) / len(finite) if finite else None
        return {"step": step, "groups": list(groups.values()), "unreadable": unreadable}

    def sample(self, step: int, uid: str, sample: int) -> dict[str, Any] | None:
        """One trajectory's whole record, each turn's page as a link, and its judge calls."""
        with self.current():
            return self._sample(step, uid, sample)

    def _sample(self, step: int, uid: str, sample: int) -> dict[str, Any] | None:
        records, unreadable = self.rollouts.records(step)
        records = [shape.trajectory(r) for r in records]
        record = next((r for r in records if r["uid"] == uid and r.get("sample") == sample), None)
        if record is None:
            return None
        for turn in record["turns"]:  # links only to files found inside the run (shaping dropped the record's own)
            if "page" in turn and self.file(turn["page"]) is not None:
                turn["page_url"] = self.file_url(turn["page"])
        record["image_urls"] = {model: self.file_url(path) for model, path in record["images"].items() if self.file(path)}
        window = self._window(step, records)
        calls = [self._read_call(call) for call in self._judge_calls(record, window)]
        record["judge"] = [call for call in calls if call is not None]
        record["unreadable"] = unreadable + len(calls) - len(record["judge"])
        return record

    def uid_history(self, uid: str) -> list[dict[str, Any]]:
        """A prompt's group at every step it was drawn: its samples' rewards and answers."""
        with self.lock:
            self._refresh_steps()
            steps = list(self.rollouts.uids.get(uid, []))
        out = []
        for step in steps:
            records, unreadable = self.rollouts.records(step)
            records = [shape.trajectory(r, turns=False) for r in records if r["uid"] == uid]
            out.append({
                "step": step,
                "samples": [
                    {"sample": r.get("sample"), "reward": r.get("reward"), "answer": _cut(r.get("response"), tail=True)}
                    for r in records
                ],
                "unreadable": unreadable,
            })  # fmt: skip
        return out

    # -- judge calls of a sample -------------------------------------------------------------
    def _window(self, step: int, records: list[dict[str, Any]]) -> tuple[float, float]:
        """The times a step's judge calls fall in: after the previous step's lines were written,
        up to this step's (the trainer writes a step's lines once it is scored)."""
        steps = sorted(self.rollouts.steps)
        at = steps.index(step) if step in steps else -1
        until = max((r.get("time") or 0.0 for r in records), default=0.0)
        after = self._step_time(steps[at - 1]) if at > 0 else 0.0
        return after, until

    def _step_time(self, step: int) -> float:
        """When a step's lines were written: the last one's time (that of the last readable line
        that has one)."""
        if step not in self.step_times:
            span = self.rollouts.steps[step]
            when = 0.0
            for line in reversed(list(self.rollouts.read_lines(span[0], span[1]))):
                record = parse_line(line)
                if isinstance(record, dict) and shape.number(record.get("time")) is not None:
                    when = float(record["time"])
                    break
            self.step_times[step] = when
        return self.step_times[step]

    def _judge_calls(self, record: dict[str, Any], window: tuple[float, float]) -> list[list]:
        request = f"{record.get('uid')}/{record.get('sample')}"
        return [[*c, judge] for judge in self.judges.values() for c in judge.calls(request, *window)]

    @staticmethod
    def _read_call(call: list) -> dict[str, Any] | None:
        record = call[4].read(call)
        return shape.judge_call(record) if record is not None else None

    # -- held-out answers --------------------------------------------------------------------
    def answers(self, folder: str) -> dict[str, Any]:
        """A held-out answers.jsonl's rows (complete lines) and how many could not be read."""
        rows, unreadable = [], 0
        if folder not in self.evals():
            return {"rows": rows, "unreadable": unreadable}
        with open(self.root / folder / "answers.jsonl", "rb") as f:
            for line in f:
                if line.endswith(b"\n") and line.strip():
                    row = parse_line(line)
                    if isinstance(row, dict) and isinstance(row.get("uid"), (str, int)):
                        rows.append(shape.answer(row))
                    else:
                        unreadable += 1
        return {"rows": rows, "unreadable": unreadable}

    # -- files inside the run ----------------------------------------------------------------
    def file(self, relative: str) -> Path | None:
        """The image file `relative` names inside the run, or None: a path that is absolute, climbs
        (`..`), ends outside the run once links are followed, is not a file or not an image."""
        if not relative or "\x00" in relative or "\\" in relative:
            return None
        parts = PurePosixPath(relative)
        if parts.is_absolute() or ".." in parts.parts or parts.suffix.lower() not in IMAGE_TYPES:
            return None
        try:
            target = (self.root / parts).resolve(strict=True)
        except (OSError, RuntimeError):
            return None
        if not target.is_relative_to(self.root) or not target.is_file():
            return None
        if target.suffix.lower() not in IMAGE_TYPES:  # a link named .png to something else
            return None
        return target

    def file_url(self, relative: str) -> str:
        from urllib.parse import quote

        return f"files/{quote(self.name)}/{quote(relative)}"


def _cut(text: Any, tail: bool = False) -> str:
    text = "" if text is None else str(text)
    if len(text) <= SUMMARY_CHARS:
        return text
    return "…" + text[-SUMMARY_CHARS:] if tail else text[:SUMMARY_CHARS] + "…"


def open_runs(folders: list[str]) -> list[Run]:
    """The runs, named by their folder's name (made unique)."""
    runs: list[Run] = []
    for folder in folders:
        base = Path(folder).expanduser().resolve().name or "run"
        name, k = base, 2
        while any(r.name == name for r in runs):
            name, k = f"{base}-{k}", k + 1
        runs.append(Run(folder, name))
    return runs
