"""Score (or re-score) a rollouts.jsonl with a judge: `grouprl judge score`.

Each input record (the trainer's rollouts.jsonl fields: uid, sample, step, prompt, response,
ground_truth, retrieved, rewards, reward, ...) is judged with the same client, cache,
concurrency cap and fault handling as in training, and written to the output as the input
record plus `judge: {name, model, scores, aggregate, error, cached}`, in completion order.

Resuming: records whose (uid, sample, step) key is already in the output are skipped, and the
cache answers any call that was paid for but not yet written, so a killed run restarted with
the same arguments neither repeats nor pays twice. Each output line is one write; a partial
last line (a crash mid-write on another filesystem) is cut off at start. Lines whose judge call
failed are removed at start too (`retry_failed`, the default), so those records are judged again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl.errors import DataError, UserError
from grouprl.rewards.judges.base import JudgeResult
from grouprl.rewards.judges.client import JudgeClient
from grouprl.rewards.judges.component import build_request
from grouprl.rewards.judges.images import JudgeImageError
from grouprl.rewards.judges.log import write_line

logger = logging.getLogger(__name__)
# Stop with a UserError when the first this-many results all failed: the judge is down or misconfigured.
ABORT_AFTER = 10


@dataclass
class ScoreSummary:
    total: int = 0  # records in the input
    skipped: int = 0  # already in the output
    scored: int = 0  # judged successfully now
    failed: int = 0  # judged now, judge call failed (written with `error`)
    cache_hits: int = 0
    requests: int = 0  # HTTP requests (or local generations) sent


def record_key(record: dict[str, Any]) -> tuple[str, str, str]:
    return (str(record.get("uid")), str(record.get("sample")), str(record.get("step")))


def prepare_output(path: Path, retry_failed: bool = False) -> set[tuple[str, str, str]]:
    """Keys already scored in `path`; cuts a partial last line; drops failed lines if asked."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        logger.warning("dropping a partial last line (%d bytes) of %s", len(data) - cut, path)
        with open(path, "r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    keys, kept, dropped = set(), [], 0
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            raise DataError(f"{path} holds a line that is not JSON; is it a judge score output?") from None
        if retry_failed and (record.get("judge") or {}).get("error"):
            dropped += 1
            continue
        keys.add(record_key(record))
        kept.append(line)
    if dropped:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_bytes(b"".join(line + b"\n" for line in kept))
        os.replace(temporary, path)
    return keys


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a rollouts.jsonl; a partial last line (a trainer still writing) is skipped."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                if not line.endswith(b"\n"):
                    logger.warning("skipping the partial last line of %s", path)
                    return
                raise DataError(f"{path} line {number} is not JSON") from None
            if not isinstance(record, dict) or "response" not in record:
                raise DataError(f"{path} line {number} has no 'response' field (is it a rollouts.jsonl?)")
            yield record


def judged_record(record: dict[str, Any], client: JudgeClient, result: JudgeResult) -> dict[str, Any]:
    return {
        **record,
        "judge": {
            "name": client.name,
            "model": client.backend.model,
            "scores": result.scores,
            "aggregate": result.aggregate if math.isfinite(result.aggregate) else None,
            "error": result.error,
            "cached": result.cached,
        },
    }


async def score_log(
    client: JudgeClient,
    input_path: str | Path,
    out_path: str | Path,
    *,
    retry_failed: bool = True,
    progress: bool = True,
) -> ScoreSummary:
    """Judge every record of `input_path` not yet in `out_path`; append results there."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    input_path, out_path = Path(input_path), Path(out_path)
    if not input_path.is_file():
        raise DataError(f"rollout log not found: {input_path}")
    if out_path.resolve() == input_path.resolve():
        raise UserError("--out must differ from --input (the output is the input plus judge scores)")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = prepare_output(out_path, retry_failed)
    summary = ScoreSummary(total=count_lines(input_path))
    window = asyncio.Semaphore(2 * client.cfg.max_concurrent_requests)  # records read ahead of the judge
    first_errors: list[str] = []
    lock = threading.Lock()
    tasks: set[asyncio.Task] = set()

    columns = (TextColumn("judging"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with open(out_path, "ab", buffering=0) as out, Progress(*columns, disable=not progress) as bar:
        task_id = bar.add_task("judge", total=summary.total)

        async def judge_one(record: dict[str, Any]) -> None:
            try:
                try:
                    request = build_request(
                        question=str(record.get("prompt", "")),
                        response=str(record.get("response", "")),
                        ground_truth=record.get("ground_truth"),
                        retrieved=record.get("retrieved") or [],
                        extra_info=record.get("extra_info")
                        if isinstance(record.get("extra_info"), dict)
                        else {},
                        image_base_path=client.cfg.image_base_path,
                        request_id="/".join(record_key(record)),
                    )
                except JudgeImageError as e:
                    result = JudgeResult(error=f"bad input: {e}")
                else:
                    result = await client.judge(request)
                write_line(out, json.dumps(judged_record(record, client, result), ensure_ascii=False), lock)
                summary.requests += result.attempts
                summary.cache_hits += result.cached
                if result.ok:
                    summary.scored += 1
                else:
                    summary.failed += 1
                if len(first_errors) < ABORT_AFTER and summary.scored == 0:
                    first_errors.append(result.error or "")
                bar.advance(task_id)
            finally:
                window.release()

        seen: set[tuple[str, str, str]] = set()
        try:
            for record in read_records(input_path):
                key = record_key(record)
                if key in done or key in seen:
                    summary.skipped += 1
                    bar.advance(task_id)
                    continue
                seen.add(key)
                await window.acquire()
                if summary.scored == 0 and len(first_errors) >= ABORT_AFTER:
                    break
                task = asyncio.create_task(judge_one(record))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    if summary.scored == 0 and len(first_errors) >= ABORT_AFTER:
        raise UserError(f"judge {client.name!r}: every call failed; first error: {first_errors[0]}")
    return summary
