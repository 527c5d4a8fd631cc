"""`grouprl judge score` end to end through its own argparse parser: output records, flags over
config files, resuming after a killed run (no repeats, no paying twice, no half lines), failed
records judged again, and one-line errors."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from grouprl.errors import ConfigError, DataError, UserError
from grouprl.rewards.judges.cli import add_parser
from rewards.judges.fake_server import Reply

RUNNER = (
    "import argparse, sys\n"
    "from grouprl.rewards.judges.cli import add_parser\n"
    "parser = argparse.ArgumentParser(prog='grouprl')\n"
    "add_parser(parser.add_subparsers(dest='verb', required=True))\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.func(args))\n"
)


def run_cli(*argv):
    parser = argparse.ArgumentParser(prog="grouprl")
    add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(["judge", "score", *argv, "--no-progress"])
    return args.func(args)


def write_rollouts(path, count, per_group=4, step=3):
    records = [
        {
            "run": "demo",
            "step": step,
            "uid": f"u{i // per_group}",
            "sample": i % per_group,
            "prompt": f"question number {i}",
            "response": f"<think>GRADE:{i % 6}</think>\n<answer>{i}</answer>",
            "ground_truth": str(i),
            "retrieved": [],
            "rewards": {"correctness": 1.0},
            "reward": 1.0,
        }
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_scores_every_record_and_keeps_its_fields(start_server, tmp_path):
    server = start_server()
    records = write_rollouts(tmp_path / "rollouts.jsonl", 10)
    out = tmp_path / "scored" / "out.jsonl"
    code = run_cli(
        "--input", str(tmp_path / "rollouts.jsonl"), "--out", str(out),
        "--base-url", server.base_url, "--model", "judge-m", "--cache", "",
    )  # fmt: skip
    assert code == 0
    scored = sorted(read_jsonl(out), key=lambda r: int(r["ground_truth"]))
    assert len(scored) == 10 and server.requests == 10
    for record, result in zip(records, scored):
        judge = result.pop("judge")
        assert result == record
        grade = int(record["ground_truth"]) % 6
        assert judge == {
            "name": "judge",
            "model": "judge-m",
            "scores": {"correctness": pytest.approx(grade / 5)},
            "aggregate": pytest.approx(grade / 5),
            "error": None,
            "cached": False,
        }
    assert server.bodies[0]["model"] == "judge-m"
    prompt = server.bodies[0]["messages"][0]["content"]
    assert "## Final answer given" not in prompt and "question number" in prompt  # the default template


@pytest.mark.parametrize("layout", ["grouprl", "judges", "single"])
def test_config_files_and_flags_that_override_them(start_server, tmp_path, layout):
    server = start_server()
    judge_yaml = (
        "name: strict\nbackend: openai\nbase_url: http://127.0.0.1:9/v1\nmodel: from-file\n"
        "max_concurrent_requests: 7\ncache_path: ''\nfields: {correctness: 1.0}\nscale: 10\n"
    )
    lines = judge_yaml.splitlines()
    if layout == "grouprl":  # a whole grouprl config: its reward.judges
        text = "reward:\n  judges:\n" + "".join(
            ("  - " if i == 0 else "    ") + ln + "\n" for i, ln in enumerate(lines)
        )
    elif layout == "judges":  # a list of judges
        text = "judges:\n" + "".join(("- " if i == 0 else "  ") + ln + "\n" for i, ln in enumerate(lines))
    else:  # one judge's settings
        text = judge_yaml
    config = tmp_path / "judge.yaml"
    config.write_text(text)
    write_rollouts(tmp_path / "r.jsonl", 3)
    out = tmp_path / "out.jsonl"
    assert run_cli("--config", str(config), "--input", str(tmp_path / "r.jsonl"), "--out", str(out),
                   "--base-url", server.base_url) == 0  # fmt: skip
    scored = read_jsonl(out)
    assert {r["judge"]["name"] for r in scored} == {"strict"}
    assert {r["judge"]["model"] for r in scored} == {"from-file"}
    # scale 10 from the file: GRADE:g scores g / 10
    assert sorted(r["judge"]["aggregate"] for r in scored) == pytest.approx([0.0, 0.1, 0.2])


def test_several_judges_need_a_choice(tmp_path):
    config = tmp_path / "judges.yaml"
    config.write_text("judges:\n- {name: a, model: m}\n- {name: b, model: m}\n")
    write_rollouts(tmp_path / "r.jsonl", 1)
    with pytest.raises(ConfigError, match=r"defines 2 judges \(a, b\); pick one with --judge"):
        run_cli("--config", str(config), "--input", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="no judge named 'c'"):
        run_cli("--config", str(config), "--judge", "c", "--input", str(tmp_path / "r.jsonl"), "--out", "o")
    config.write_text("judges:\n- {name: a, model: m, max_retries: lots}\n")
    with pytest.raises(ConfigError, match=r"config key 'judges\[0\].max_retries' must be an integer"):
        run_cli("--config", str(config), "--input", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o"))


def test_user_mistakes_are_one_line_errors(start_server, tmp_path):
    server = start_server()
    with pytest.raises(DataError, match="rollout log not found"):
        run_cli(
            "--input",
            str(tmp_path / "nope.jsonl"),
            "--out",
            str(tmp_path / "o"),
            "--model",
            "m",
            "--cache",
            "",
        )
    (tmp_path / "bad.jsonl").write_text('{"response": "x"}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl line 2 is not JSON"):
        run_cli("--input", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o"), "--model", "m",
                "--base-url", server.base_url, "--cache", "")  # fmt: skip
    (tmp_path / "other.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="no 'response' field"):
        run_cli(
            "--input",
            str(tmp_path / "other.jsonl"),
            "--out",
            str(tmp_path / "o"),
            "--model",
            "m",
            "--cache",
            "",
        )
    write_rollouts(tmp_path / "r.jsonl", 30)
    started = time.monotonic()
    with pytest.raises(UserError, match="every call failed; first error: cannot connect to http://127.0.0.1:1/v1"):
        run_cli("--input", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o2"), "--model", "m",
                "--base-url", "http://127.0.0.1:1/v1", "--cache", "", "--max-retries", "0")  # fmt: skip
    assert time.monotonic() - started < 5


def test_failed_records_are_written_then_judged_again(start_server, tmp_path):
    broken = {"on": True}
    server = start_server(
        behaviour=lambda call: (
            Reply("status", status=503) if broken["on"] and "number 1\n" in call.user_text else Reply()
        )
    )
    write_rollouts(tmp_path / "r.jsonl", 4)
    out = tmp_path / "out.jsonl"
    common = ["--input", str(tmp_path / "r.jsonl"), "--out", str(out), "--model", "m",
              "--base-url", server.base_url, "--max-retries", "0"]  # fmt: skip
    cache = ["--cache", str(tmp_path / "cache.sqlite")]
    assert run_cli(*common, *cache) == 1  # one record failed
    failed = [r for r in read_jsonl(out) if r["judge"]["error"]]
    assert [r["ground_truth"] for r in failed] == ["1"]
    assert failed[0]["judge"]["error"].startswith("HTTP 503") and failed[0]["judge"]["aggregate"] is None
    requests_before = server.requests
    assert run_cli(*common, *cache, "--skip-failed") == 0  # nothing new to judge
    assert server.requests == requests_before
    broken["on"] = False
    assert run_cli(*common, *cache) == 0
    assert server.requests == requests_before + 1  # only the failed record; the rest were in the output
    final = read_jsonl(out)
    assert sorted(r["ground_truth"] for r in final) == ["0", "1", "2", "3"]
    assert all(r["judge"]["error"] is None for r in final)


@pytest.mark.slow
def test_a_killed_run_resumes_without_repeats_or_half_lines(start_server, tmp_path):
    server = start_server(latency=0.1)
    records = write_rollouts(tmp_path / "r.jsonl", 40)
    out = tmp_path / "out.jsonl"
    argv = ["judge", "score", "--input", str(tmp_path / "r.jsonl"), "--out", str(out), "--model", "m",
            "--base-url", server.base_url, "--cache", str(tmp_path / "cache.sqlite"), "--max-concurrent", "2",
            "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-c", RUNNER, *argv], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 8):
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    written_before = out.read_text().count("\n")
    assert 8 <= written_before < 40, "the run must be killed mid-way"
    with open(out, "ab") as f:
        f.write(b'{"uid": "u9", "sample": 1, "step": 3, "respo')  # a torn last line
    requests_before = server.requests

    assert run_cli(*argv[2:-1]) == 0
    final = read_jsonl(out)  # every line parses: the torn one is gone
    keys = [(r["uid"], r["sample"], r["step"]) for r in final]
    assert len(keys) == len(set(keys)) == 40
    assert set(keys) == {(r["uid"], r["sample"], r["step"]) for r in records}
    new_requests = server.requests - requests_before
    # paid for at most the records not written before the kill; answers that arrived between
    # the kill's last write and the kill come from the cache
    assert new_requests <= 40 - written_before
    assert server.requests <= 40 + 2  # at most the 2 requests in flight at the kill were paid twice
