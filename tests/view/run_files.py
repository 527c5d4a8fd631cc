"""A run folder written by hand in the trainer's and the judge log's formats, field for field,
for the viewer's tests (`make_run`), and a client of the viewer over it on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient
from PIL import Image

from grouprl.view.app import create_app
from grouprl.view.runs import open_runs


def turn(k, action, argument, page=None, size=None, **extra):
    record = {
        "turn": k, "text": f"I think. <{action}>{argument}</{action}>", "action": action, "argument": argument,
        "observation": f"seen {k}", "error": None, "tokens": 5, "masked_tokens": 3, "finish_reason": "stop",
        "images": int(page is not None), "image_files": [],
    }  # fmt: skip
    if page:
        record.update(page=page, page_size=size)
    return {**record, **extra}


def rollout(step, uid, sample, reward, when, truncated=False, turns=None):
    return {
        "run": "demo", "step": step, "uid": uid, "sample": sample, "prompt": f"question {uid}",
        "response": f"answer of {uid}/{sample} at {step}", "turns": turns or [], "retrieved": [],
        "rewards": {"judge": reward, "format": 1.0}, "reward": reward, "advantage": reward - 0.5,
        "response_tokens": 12, "truncated": truncated, "finish_reason": "length" if truncated else "eos",
        "version": step - 1, "ground_truth": "gold", "time": when,
    }  # fmt: skip


def judge_line(when, request_id, raw, error=None):
    return {
        "time": when, "judge": "grader", "request_id": request_id, "model": "fake",
        "prompt": {"system": "grade it", "user": f"response of {request_id}", "images": 0},
        "latency_s": 0.01, "prompt_tokens": 11, "completion_tokens": 7, "raw": raw,
        "scores": None if error else {"correctness": 1}, "aggregate": None if error else 1.0,
        "error": error, "cached": False, "attempts": 1,
    }  # fmt: skip


def write_lines(path: Path, records, mode="w"):
    with open(path, mode) as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def make_run(tmp_path: Path) -> Path:
    """A two-step run: metrics, rollouts (step 1: u1 with two turns on a page, u2; step 2: u1,
    u3), three judge calls (u1/0 at each step, u1/1 failed) and a held-out answers.jsonl."""
    folder = tmp_path / "runs" / "demo"
    (folder / "images" / "pages").mkdir(parents=True)
    Image.new("RGB", (40, 20), (200, 10, 10)).save(folder / "images" / "pages" / "p_1.png")
    write_lines(folder / "metrics.jsonl", [{"step": 1, "reward/mean": 0.25, "time/generate": 1.5}, {"step": 2, "reward/mean": 0.75}])
    page = "images/pages/p_1.png"
    turns = [turn(0, "search", "cats", page, [20, 10]), turn(1, "bbox", "[0, 0, 10, 5]", page, [20, 10])]
    write_lines(folder / "rollouts.jsonl", [
        rollout(1, "u1", 0, 1.0, 100.0, turns=turns), rollout(1, "u1", 1, 0.0, 100.0, truncated=True),
        rollout(1, "u2", 0, 0.5, 100.0), rollout(1, "u2", 1, 0.5, 100.0),
        rollout(2, "u1", 0, 0.0, 200.0), rollout(2, "u1", 1, 0.0, 200.0),
        rollout(2, "u3", 0, 1.0, 200.0), rollout(2, "u3", 1, 0.0, 200.0),
    ])  # fmt: skip
    write_lines(folder / "judge.jsonl", [
        judge_line(90.0, "u1/0", 'correct "yes", "error": no'),  # an error key inside raw is not the key
        judge_line(91.0, "u1/1", None, error="timeout after 1 attempt"),
        judge_line(190.0, "u1/0", "wrong"),
    ])  # fmt: skip
    (folder / "eval").mkdir()
    write_lines(folder / "eval" / "answers.jsonl", [{"uid": "v1", "prompt": "q", "response": "a", "accuracy": 1.0}])
    return folder


def client_of(*folders):
    return TestClient(create_app(open_runs([str(f) for f in folders])), base_url="http://127.0.0.1:8008")
