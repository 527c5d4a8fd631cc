"""The viewer's index over the writers' own lines and over anything else: lines as
`RolloutWriter` and `JudgeLog` write them are read by their anchored leading (and, for the
judge log, trailing) fields without being parsed whole; any other key order is parsed whole and
read the same, never misread (a policy's text holding `"step": 99` once moved a line to step
99); and fuzzed lines (hypothesis) never raise, are placed as the whole-line parse places them
whenever they are JSON, and are read in time linear in their size."""

from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import grouprl.view.index as index_module
from grouprl.data.sample import Sample
from grouprl.rewards.judges.base import JudgePrompt, JudgeResult
from grouprl.rewards.judges.log import JudgeLog
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.loggers import RolloutWriter
from grouprl.view.index import JudgeIndex, RolloutIndex, parse_line
from grouprl.view.runs import Metrics

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip


@pytest.fixture
def whole_parses(monkeypatch) -> list[bytes]:
    """The lines the index parsed whole (not read by the writers' pattern)."""
    seen: list[bytes] = []

    def counted(line):
        seen.append(line)
        return parse_line(line)

    monkeypatch.setattr(index_module, "parse_line", counted)
    return seen


def trajectory(uid: str, index: int, text: str) -> Trajectory:
    sample = Sample(uid=uid, messages=[{"role": "user", "content": "q"}], ground_truth="g")
    turns = [{"turn": 0, "text": text, "action": "search", "argument": text, "observation": text, "error": None}]
    return Trajectory(sample=sample, index=index, prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1],
                      response_text=text, finish_reason="stop", turns=turns, rewards={"judge": 0.5}, reward=0.5)  # fmt: skip


# the policy's text, written to look like the fields the index reads
TRICKY = ['"step": 99, "uid": "evil"', '\\"step\\": 7', "\u00e9\u4e2d\ud83d\ude00", '", "error": "x", "cached": true, "attempts": 1}',
          "\n\r\t\x00", '{"run": "x", "step": 5, "uid": "u", "sample": 0}']  # fmt: skip


def test_the_writers_lines_are_read_by_their_leading_fields(tmp_path, whole_parses):
    """The key order RolloutWriter and JudgeLog promise (step, uid, sample after run; time,
    judge, request_id first and error, cached, attempts last) is what the index reads without
    parsing: not one of their lines is parsed whole, and each is placed as the parse places it."""
    rollouts = tmp_path / "rollouts.jsonl"
    lines = []
    for step in (1, 2):
        trajectories = [trajectory(f"u{k}\"\\{text}", k, text) for k, text in enumerate(TRICKY)]
        lines += RolloutWriter.lines('run "quoted"', step, trajectories, {t.uid: "p" for t in trajectories})
    rollouts.write_text("\n".join(lines) + "\n")
    index = RolloutIndex(rollouts)
    index.refresh()
    assert whole_parses == [] and index.unreadable == 0
    parsed = [json.loads(line) for line in lines]
    assert {s: span[2] for s, span in index.steps.items()} == {1: len(TRICKY), 2: len(TRICKY)}
    assert index.uids == {r["uid"]: [1, 2] for r in parsed}
    assert [r["step"] for r in index.records(2)[0]] == [2] * len(TRICKY)  # (a step's page parses its lines)
    whole_parses.clear()

    log = JudgeLog(tmp_path / "judge.jsonl")
    prompt = JudgePrompt(system="s", user="u")
    for k, text in enumerate(TRICKY):
        ok = JudgeResult(scores={"correctness": 1.0}, aggregate=1.0, raw=text, attempts=1)
        failed = JudgeResult(raw=text, error=f"unparsable: {text}", attempts=2)
        log.write("grader", "m", f"u{k}/{text}", ok if k % 2 else failed, prompt)
    log.close()
    judged = JudgeIndex(tmp_path / "judge.jsonl")
    judged.refresh()
    assert whole_parses == [] and judged.unreadable == 0
    records = [json.loads(line) for line in (tmp_path / "judge.jsonl").read_bytes().splitlines()]
    assert {k: [c[3] for c in v] for k, v in judged.requests.items()} == {r["request_id"]: [r["error"] is not None] for r in records}
    assert [c[0] for v in judged.requests.values() for c in v] == [r["time"] for r in records]


def test_any_other_key_order_is_parsed_whole_and_read_the_same(tmp_path, whole_parses):
    moved = {"prompt": 'x", "step": 99, "uid": "evil', "run": "r", "step": 1, "uid": "u1", "sample": 0, "time": 1.0}
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps(moved) + "\n" + json.dumps({"uid": 5, "step": 2, "run": "r"}) + "\n")
    index = RolloutIndex(rollouts)
    index.refresh()
    assert len(whole_parses) == 2 and index.unreadable == 0
    assert sorted(index.steps) == [1, 2] and index.uids == {"u1": [1], "5": [2]}  # a numeric uid reads as its text
    judge = {"request_id": 'a", "time": 5', "time": 2.0, "error": None, "raw": ', "error": "x"', "judge": "j"}
    (tmp_path / "judge.jsonl").write_text(json.dumps(judge) + "\n")
    judged = JudgeIndex(tmp_path / "judge.jsonl")
    judged.refresh()
    assert judged.requests == {'a", "time": 5': [[2.0, 0, len(json.dumps(judge)), False]]}


# ------------------------------------------------------------------------------------ fuzzing
def writer_line(rng: random.Random, pieces: list[str]) -> bytes:
    text = "".join(rng.choice(pieces) for _ in range(rng.randrange(6)))
    record = {"run": "r", "step": rng.randrange(-2, 4), "uid": text, "sample": rng.randrange(3), "response": text,
              "turns": [{"text": text}], "time": rng.random()}  # fmt: skip
    return json.dumps(record, ensure_ascii=rng.random() < 0.5).encode("utf-8", "backslashreplace")  # as JudgeLog writes


def judge_writer_line(rng: random.Random, pieces: list[str]) -> bytes:
    text = "".join(rng.choice(pieces) for _ in range(rng.randrange(6)))
    record = {"time": rng.random() * 10 ** rng.randrange(-3, 12), "judge": text, "request_id": text, "raw": text,
              "scores": {text: 1}, "aggregate": None, "error": rng.choice([None, text]), "cached": rng.random() < 0.5,
              "attempts": rng.randrange(4)}  # fmt: skip
    return json.dumps(record, ensure_ascii=False).encode("utf-8", "backslashreplace")


def mutate(line: bytes, rng: random.Random, junk: bytes) -> bytes:
    """A writer's line cut, spliced or overwritten somewhere (a crash, another tool, a disk)."""
    at = rng.randrange(len(line) + 1)
    kind = rng.randrange(4)
    if kind == 0:
        return line[:at]
    if kind == 1:
        return line[:at] + junk + line[at:]
    if kind == 2:
        return line[:at] + junk + line[at + len(junk) :]
    return line


PIECES = st.lists(st.sampled_from(TRICKY + ["a", "\\", '"', "}", "{", "\ud800", " ", "step", ":"]), min_size=1, max_size=6)
JUNK = st.binary(max_size=8) | st.sampled_from([b'"', b"\\", b"}", b"\xff", b"\\u", b'\\"', b", ", b"NaN", b"1e999"])


def reference_rollout(line: bytes) -> tuple[int, str] | None:
    record = parse_line(line)
    if isinstance(record, dict) and type(record.get("step")) is int and type(record.get("uid")) in (str, int):
        return record["step"], str(record["uid"])
    return None


@FUZZ
@given(seed=st.integers(0, 2**32), pieces=PIECES, junk=JUNK)
def test_fuzzed_rollout_lines_never_raise_and_json_ones_are_placed_as_parsed(tmp_path, seed, pieces, junk):
    rng = random.Random(seed)
    lines = [mutate(writer_line(rng, pieces), rng, junk).replace(b"\n", b" ") for _ in range(8)]
    path = tmp_path / f"rollouts-{seed}.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    index = RolloutIndex(path)
    index.refresh()  # never raises
    steps, uids, unreadable = {}, {}, 0
    for line in (x for x in lines if x.strip()):
        expected = reference_rollout(line)
        head = index_module._ROLLOUT_HEAD.match(line)
        if head and line.endswith(b"}") and index_module._literal(head.group(2)) is not None:
            read = int(head.group(1)), index_module._literal(head.group(2))
            assert expected in (None, read)  # a line JSON reads is read the same by its leading fields
        elif expected is None:
            unreadable += 1
            continue
        else:
            read = expected
        steps[read[0]] = steps.get(read[0], 0) + 1
        if uids.setdefault(read[1], [])[-1:] != [read[0]]:
            uids[read[1]].append(read[0])
    # a line that only looks like the writer's (its middle broken) is placed, and counted when
    # its step is read; every other line JSON cannot read is counted now
    assert index.unreadable == unreadable
    assert {s: span[2] for s, span in index.steps.items()} == steps and index.uids == uids
    for step in index.steps:
        records, bad = index.records(step)
        assert all(r["step"] == step for r in records) and len(records) + bad <= index.steps[step][2] + len(lines)


@FUZZ
@given(seed=st.integers(0, 2**32), pieces=PIECES, junk=JUNK)
def test_fuzzed_judge_and_metrics_lines_never_raise_and_read_as_parsed(tmp_path, seed, pieces, junk):
    rng = random.Random(seed)
    lines = [mutate(judge_writer_line(rng, pieces), rng, junk).replace(b"\n", b" ") for _ in range(8)]
    path = tmp_path / f"judge-{seed}.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    judged = JudgeIndex(path)
    judged.refresh()
    for line in (x for x in lines if x.strip()):
        record = parse_line(line)
        call = index_module._judge_call(line)
        if isinstance(record, dict) and isinstance(record.get("request_id"), str) and type(record.get("time")) in (int, float):
            assert call == (float(record["time"]), record["request_id"], record.get("error") is not None)
    for calls in judged.requests.values():
        for call in calls:
            judged.read(call)  # a dict or None, never an exception
    metrics = Metrics(path)
    metrics.refresh()
    assert len(metrics.rows) + metrics.unreadable == sum(1 for x in lines if x.strip())


@pytest.mark.parametrize("kind", ["rollouts", "judge", "metrics"])
def test_a_line_is_read_in_time_linear_in_its_size(tmp_path, kind):
    """One line of 1 MB and of 2 MB, of the shapes that make pattern readers slow (an endless
    string of escapes, a head that almost matches, a tail key repeated): twice the bytes, at most
    about twice the time (the best of five of each, in turn; the line's reading alone, not the
    file's)."""

    def line(n: int) -> bytes:
        if kind == "rollouts":
            return b'{"run": "' + b'\\"' * (n // 2) + b'", "step": 1, "uid": "u", "sample": 0' + b" " * 10 + b"x"
        if kind == "judge":
            return b'{"time": 1.0, "judge": "j", "request_id": "r", ' + b', "error": ' * (n // 11) + b'"x'
        return b'{"step": 1, "a": [' + b"[" * 900 + b"]" * 900 + b"," * (n // 2) + b"]}"

    def seconds(data: bytes) -> float:
        index = {"rollouts": RolloutIndex, "judge": JudgeIndex, "metrics": Metrics}[kind](tmp_path / "unused")
        t0 = time.perf_counter()
        index.add(0, data)
        assert index.unreadable == 1
        return time.perf_counter() - t0

    small, large = alternating(seconds, line(1 << 20), line(2 << 20))
    assert large < 3.0 * small + 10e-3, (small, large)


def alternating(seconds, small, large, rounds: int = 5) -> tuple[float, float]:
    """The best of `rounds` timings of each input, taken in turn (both see the machine's load)."""
    times = [(seconds(small), seconds(large)) for _ in range(rounds)]
    return min(t[0] for t in times), min(t[1] for t in times)


def test_a_line_longer_than_a_read_is_read_once(tmp_path, monkeypatch):
    """A line spanning many reads (CHUNK bytes each) is joined once, not grown read by read."""
    monkeypatch.setattr(index_module, "CHUNK", 1 << 16)
    path = tmp_path / "rollouts.jsonl"
    record = {"run": "r", "step": 1, "uid": "u", "sample": 0, "response": "x" * (4 << 20)}
    path.write_bytes(json.dumps(record).encode() + b"\n" + json.dumps({**record, "step": 2}).encode() + b"\n")
    joined = []
    real = bytes.join
    monkeypatch.setattr(index_module, "_join", lambda parts: joined.append(len(parts)) or real(b"", parts))
    index = RolloutIndex(path)
    index.refresh()
    assert sorted(index.steps) == [1, 2] and index.unreadable == 0
    assert sum(joined) <= 2 * (path.stat().st_size // (1 << 16) + 2)  # each read joined at most once or twice
