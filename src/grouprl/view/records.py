"""What the page may rely on in a record read from a run: each field the page uses, of the type
it uses, or left out.

A run's lines are JSON the trainer wrote, but their text is the policy's and a dataset's, and a
line may be damaged or written by another tool: a record is shaped before it is answered, so a
field of the wrong type costs that field (shown as missing), never the answer or the page. The
links a page follows (a turn's page image, a reward model's drawing) are never taken from a
record: the server builds them from files it found inside the run (`runs.Run.file`).
"""

from __future__ import annotations

import math
from typing import Any

SERVER_FIELDS = ("page_url", "image_urls", "judge", "unreadable")  # the server's own: a record's are dropped


def number(value: Any) -> float | int | None:
    """A finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


TRAJECTORY = {"sample": integer, "response_tokens": integer, "version": integer, "reward": number, "advantage": number,
              "time": number, "prompt": text, "response": text, "finish_reason": text, "truncated": flag}  # fmt: skip
TURN = {"turn": integer, "tokens": integer, "version": integer, "text": text, "action": text, "argument": text,
        "observation": text, "error": text, "unfinished": text, "page": text}  # fmt: skip


def keep(record: dict[str, Any], checks: dict[str, Any]) -> None:
    """Each field of `checks` that `record` holds stays if its check passes it, else goes; the
    server's own fields go."""
    for key in SERVER_FIELDS:
        record.pop(key, None)
    for key, check in checks.items():
        if key in record and check(record[key]) is None:
            del record[key]


def trajectory(record: dict[str, Any], turns: bool = True) -> dict[str, Any]:
    """A rollouts.jsonl record (step and uid already checked), its fields as the page reads them;
    `turns=False`: its turns only as far as a step's listing reads them (their actions)."""
    keep(record, TRAJECTORY)
    rewards = record.get("rewards")
    record["rewards"] = {str(k): number(v) for k, v in rewards.items()} if isinstance(rewards, dict) else {}
    images = record.get("images")
    record["images"] = {str(k): v for k, v in images.items() if isinstance(v, str)} if isinstance(images, dict) else {}
    listed = record.get("turns")
    listed = [t for t in listed if isinstance(t, dict)] if isinstance(listed, list) else []
    record["turns"] = [turn(t) for t in listed] if turns else [{"action": text(t.get("action"))} for t in listed]
    return record


def turn(record: dict[str, Any]) -> dict[str, Any]:
    """One turn of a trajectory: its text fields text, its figures numbers, its page a path with
    a size [width, height] (else neither)."""
    keep(record, TURN)
    size = record.get("page_size")
    if not (isinstance(size, list) and len(size) == 2 and all((number(x) or 0) > 0 for x in size)) or "page" not in record:
        record.pop("page", None)
        record.pop("page_size", None)
    return record


def judge_call(record: dict[str, Any]) -> dict[str, Any]:
    """A judge.jsonl record, the fields the page shows."""
    prompt = record.get("prompt")
    shown = None
    if isinstance(prompt, dict):
        shown = {"system": text(prompt.get("system")), "user": text(prompt.get("user")), "images": integer(prompt.get("images"))}
    scores = record.get("scores")
    return {
        "time": number(record.get("time")),
        "judge": text(record.get("judge")),
        "model": text(record.get("model")),
        "prompt": shown,
        "raw": text(record.get("raw")),
        "scores": {str(k): number(v) for k, v in scores.items()} if isinstance(scores, dict) else None,
        "aggregate": number(record.get("aggregate")),
        "error": text(record.get("error")),
        "cached": record.get("cached") is True,
        "attempts": integer(record.get("attempts")),
        "latency_s": number(record.get("latency_s")),
    }


def answer(record: dict[str, Any]) -> dict[str, Any]:
    """A held-out answers.jsonl row (its uid checked), the fields the page shows."""
    record["uid"] = str(record["uid"])
    keep(record, ANSWER)
    return record


ANSWER = {"prompt": text, "response": text, "accuracy": number, "reward": number, "skipped": flag}
