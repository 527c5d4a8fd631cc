"""judge.jsonl: one line per judged request, each written with a single write + flush.

Fields, in this order: `time`, `judge`, `request_id`, `model`, `prompt` (the rendered system and
user text and the number of images sent; null when the request never rendered), `latency_s`,
`prompt_tokens`, `completion_tokens`, `raw` (the judge's own output), `scores`, `aggregate`,
`error`, `cached`, `attempts`. `grouprl view` reads a line whose first three and last three keys
are these, written by `json.dumps`'s default separators, without parsing it whole (any other
line it parses: the order is a matter of speed, checked by tests/view/test_view_index.py).
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

from grouprl.rewards.judges.base import JudgePrompt, JudgeResult


def write_line(file, text: str, lock: threading.Lock) -> None:
    """Append `text` + newline to an unbuffered binary file in one write (looping only on a
    short write), so a killed process never leaves half a line behind a complete one. A lone
    surrogate (a dataset's or a reply's JSON escape, which only a string can hold) is written
    back as its escape: the line stays UTF-8 and reads back as it was."""
    data = (text + "\n").encode("utf-8", "backslashreplace")
    with lock:
        view = memoryview(data)
        while view:
            view = view[file.write(view) :]


class JudgeLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # raw: one os.write per line
        self._lock = threading.Lock()

    def write(
        self, judge: str, model: str, request_id: str, result: JudgeResult, prompt: JudgePrompt | None = None
    ) -> None:
        record = {
            "time": time.time(),
            "judge": judge,
            "request_id": request_id,
            "model": model,
            "prompt": (
                None
                if prompt is None
                else {
                    "system": prompt.system,
                    "user": prompt.user,
                    "images": sum(len(images) for _, images in prompt.image_groups),
                }
            ),
            "latency_s": round(result.latency_s, 6),
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "raw": result.raw,
            "scores": result.scores,
            "aggregate": result.aggregate if math.isfinite(result.aggregate) else None,
            "error": result.error,
            "cached": result.cached,
            "attempts": result.attempts,
        }
        write_line(self._file, json.dumps(record, ensure_ascii=False), self._lock)

    def close(self) -> None:
        with self._lock:
            self._file.close()
