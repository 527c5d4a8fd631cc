"""grouprl view's HTTP API over a run folder written here by hand (the trainer's and the judge
log's formats, field for field): steps and groups read by byte range, a sample's turns with
their pages and its judge calls (matched to the step by time), a uid across steps, held-out
answers, lines appended while it serves, and nothing served from outside the run."""

from __future__ import annotations

import json
import os
import socket

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from grouprl.cli import main
from grouprl.view.app import create_app
from grouprl.view.index import RolloutIndex
from grouprl.view.runs import open_runs
from view.run_files import client_of, make_run, rollout, write_lines


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path)


def test_steps_groups_samples_and_judge_calls(run):
    client = client_of(run)
    [summary] = client.get("/api/runs").json()
    assert summary["steps"] == [1, 2] and summary["trajectories"] == 8 and summary["evals"] == ["eval"]
    step1 = client.get("/api/runs/demo/steps/1").json()
    u1, u2 = step1["groups"]
    assert [s["reward"] for s in u1["samples"]] == [1.0, 0.0] and not u1["zero_variance"] and u2["zero_variance"]
    assert [s["truncated"] for s in u1["samples"]] == [False, True]
    assert [s["actions"] for s in u1["samples"]] == [["search", "bbox"], []]
    # step 1's window is (0, 100]: u1/0's first call (ok) and u1/1's (failed); step 2 holds u1/0's second
    assert [(s["judge_calls"], s["judge_failed"]) for s in u1["samples"]] == [(1, False), (1, True)]
    step2 = client.get("/api/runs/demo/steps/2").json()
    assert [(s["judge_calls"], s["judge_failed"]) for s in step2["groups"][0]["samples"]] == [(1, False), (0, False)]

    sample = client.get("/api/runs/demo/sample", params={"step": 1, "uid": "u1", "sample": 0}).json()
    assert [t["page_url"] for t in sample["turns"]] == ["files/demo/images/pages/p_1.png"] * 2
    [call] = sample["judge"]
    assert call["raw"] == 'correct "yes", "error": no' and call["error"] is None
    assert call["prompt"]["user"] == "response of u1/0"
    image = client.get("/" + sample["turns"][0]["page_url"])
    assert image.status_code == 200 and image.content == (run / "images/pages/p_1.png").read_bytes()
    later = client.get("/api/runs/demo/sample", params={"step": 2, "uid": "u1", "sample": 0}).json()
    assert [c["raw"] for c in later["judge"]] == ["wrong"]

    history = client.get("/api/runs/demo/uid", params={"uid": "u1"}).json()
    assert [(h["step"], [s["reward"] for s in h["samples"]]) for h in history] == [(1, [1.0, 0.0]), (2, [0.0, 0.0])]
    assert client.get("/api/runs/demo/answers", params={"folder": "eval"}).json() == {
        "rows": [{"uid": "v1", "prompt": "q", "response": "a", "accuracy": 1.0}], "unreadable": 0}
    assert client.get("/api/runs/demo/answers", params={"folder": ".."}).status_code == 404
    assert client.get("/api/runs/demo/steps/7").status_code == 404
    metrics = client.get("/api/runs/demo/metrics").json()
    assert [r["reward/mean"] for r in metrics["rows"]] == [0.25, 0.75]
    page = client.get("/")
    assert page.status_code == 200 and "static/plotly.min.js" in page.text
    assert client.get("/static/plotly.min.js").status_code == 200 and client.get("/static/app.js").status_code == 200


def test_a_live_run_half_a_line_waits_and_a_rewrite_starts_over(run):
    client = client_of(run)
    assert client.get("/api/runs").json()[0]["steps"] == [1, 2]
    line = json.dumps(rollout(3, "u4", 0, 0.25, 300.0)) + "\n"
    with open(run / "rollouts.jsonl", "a") as f:
        f.write(line[:50])  # a line being written
        f.flush()
        assert client.get("/api/runs").json()[0]["steps"] == [1, 2]
        f.write(line[50:])
    assert client.get("/api/runs").json()[0]["steps"] == [1, 2, 3]
    assert client.get("/api/runs/demo/steps/3").json()["groups"][0]["samples"][0]["reward"] == 0.25
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward/mean": 0.5}) + "\n")
    first = client.get("/api/runs/demo/metrics").json()
    more = client.get("/api/runs/demo/metrics", params={"since": 3, "generation": first["generation"]}).json()
    assert len(first["rows"]) == 3 and more["start"] == 3 and more["rows"] == []

    # the index is kept beside the run, and a second viewer starts from it
    kept = json.loads((run / ".view" / "rollouts.index.json").read_text())
    assert kept["end"] == (run / "rollouts.jsonl").stat().st_size and len(kept["steps"]) == 3
    again = RolloutIndex(run / "rollouts.jsonl", run / ".view" / "rollouts.index.json")
    assert again.end == kept["end"] and again.steps[3][2] == 1

    # a resumed run cut the file after step 1 and wrote a new step 2 (longer than before)
    lines = (run / "rollouts.jsonl").read_text().splitlines(keepends=True)[:4]
    write_lines(run / "rollouts.jsonl", [rollout(2, "u9", k, 0.1, 250.0) for k in range(6)])
    (run / "rollouts.jsonl").write_text("".join(lines) + (run / "rollouts.jsonl").read_text())
    summary = client.get("/api/runs").json()[0]
    assert summary["steps"] == [1, 2] and summary["trajectories"] == 10
    assert {g["uid"] for g in client.get("/api/runs/demo/steps/2").json()["groups"]} == {"u9"}


def test_only_images_inside_the_run_are_served(run, tmp_path):
    outside = tmp_path / "secret.png"
    Image.new("RGB", (4, 4)).save(outside)
    (run / "images" / "out.png").symlink_to(outside)
    (run / "images" / "notes.png").symlink_to(run / "metrics.jsonl")  # inside, but not an image file
    (run / "config.yaml").write_text("model: x\n")
    client = client_of(run)
    assert client.get("/files/demo/images/pages/p_1.png").status_code == 200
    refused = [
        "/files/demo/../secret.png", "/files/demo/%2e%2e/secret.png", "/files/demo/images/%2E%2E/%2e%2e/secret.png",
        "/files/demo/%2e%2e%2fsecret.png", "/files/demo/images%2f..%2f..%2fsecret.png", f"/files/demo/{outside}",
        f"/files/demo//{outside}", "/files/demo/%2F" + str(outside).lstrip("/"), "/files/demo/images/out.png",
        "/files/demo/images/notes.png", "/files/demo/config.yaml", "/files/demo/metrics.jsonl",
        "/files/demo/.view/rollouts.index.json", "/files/demo/images/pages/p_1.png%00.jsonl",
        "/files/demo/images\\..\\..\\secret.png", "/files/nope/images/pages/p_1.png", "/static/../runs.py",
        "/static/index.html/../../runs.py", "/static/%2e%2e%2fruns.py",
    ]  # fmt: skip
    for url in refused:
        answer = client.get(url)
        assert answer.status_code == 404, (url, answer.status_code)
        assert answer.content != outside.read_bytes()


def test_the_viewer_writes_nothing_but_its_index(run):
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}
    client = client_of(run)
    for url in ["/api/runs", "/api/runs/demo/steps/1", "/api/runs/demo/metrics", "/api/runs/demo/uid?uid=u1",
                "/api/runs/demo/sample?step=1&uid=u1&sample=0", "/files/demo/images/pages/p_1.png"]:  # fmt: skip
        assert client.get(url).status_code == 200
    assert client.post("/api/runs").status_code == 405 and client.delete("/files/demo/images/pages/p_1.png").status_code == 405
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file() and ".view" not in p.parts}
    assert after == before
    assert sorted(p.name for p in (run / ".view").iterdir()) == ["judge.index.json", "rollouts.index.json"]


def test_cli_failure_lines(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["view", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"grouprl: error: {tmp_path / 'nowhere'}: no such folder\n"
    assert main(["view", str(run), str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grouprl: error: {empty} is not a run folder") and err.count("\n") == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["view", str(run), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grouprl: error: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1
    assert not os.path.exists(empty / ".view")  # refused before anything was indexed


def test_a_read_only_run_keeps_its_index_in_the_cache(run, tmp_path, monkeypatch):
    import grouprl.view.index as index

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real_access = os.access
    monkeypatch.setattr(index.os, "access", lambda path, mode: False if ".view" in str(path) else real_access(path, mode))
    client = client_of(run)
    assert client.get("/api/runs").json()[0]["steps"] == [1, 2]
    assert client.get("/api/runs/demo/steps/1").status_code == 200  # the judge log's index too
    [kept] = (tmp_path / "cache" / "grouprl" / "view").iterdir()
    assert sorted(p.name for p in kept.iterdir()) == ["judge.index.json", "rollouts.index.json"]


def slow_judge_index(monkeypatch, added: list) -> None:
    """JudgeIndex.add noting each line it indexes and taking 50 ms over it: a build that lasts
    long enough for another request to come in meanwhile."""
    import time

    from grouprl.view.index import JudgeIndex

    real_add = JudgeIndex.add

    def add(index, offset, line):
        added.append(offset)
        time.sleep(0.05)
        real_add(index, offset, line)

    monkeypatch.setattr(JudgeIndex, "add", add)


STEP1_JUDGED = [[(1, False), (1, True)], [(0, False), (0, False)]]  # u1/0 ok, u1/1 failed; u2 none


def test_two_first_requests_for_a_step_at_once_build_the_judge_index_once(run, monkeypatch):
    """Sync routes run on a thread pool: two requests for a fresh run's step that come together
    (its judge log not yet indexed) get the same whole answer, and judge.jsonl's 3 lines are
    indexed once."""
    import threading

    import httpx

    from grouprl.retriever.service import BackgroundServer

    added: list[int] = []
    slow_judge_index(monkeypatch, added)
    answers: list = [None, None]
    together = threading.Barrier(2)

    def ask(k, url):
        together.wait()
        answers[k] = httpx.get(f"{url}/api/runs/demo/steps/1", timeout=30)

    with BackgroundServer(create_app(open_runs([str(run)]))) as server:
        threads = [threading.Thread(target=ask, args=(k, server.url)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert [a.status_code for a in answers] == [200, 200] and answers[0].json() == answers[1].json()
    groups = answers[0].json()["groups"]
    assert [[(s["judge_calls"], s["judge_failed"]) for s in g["samples"]] for g in groups] == STEP1_JUDGED
    lines = (run / "judge.jsonl").read_bytes().split(b"\n")
    assert added == [0, len(lines[0]) + 1, len(lines[0]) + len(lines[1]) + 2]  # each line once, in order


def test_the_judge_index_is_built_in_the_background_after_the_runs_are_listed(run, monkeypatch):
    """/api/runs answers without the judge log's index, then starts building it on a thread of
    its own; a step asked for meanwhile waits for that build (not a second one), and the index
    is then kept beside the run."""
    added: list[int] = []
    slow_judge_index(monkeypatch, added)
    [demo] = open_runs([str(run)])
    client = TestClient(create_app([demo]), base_url="http://localhost:8008")
    assert client.get("/api/runs").json()[0]["steps"] == [1, 2]
    assert demo.indexing is not None and demo.indexing.daemon  # started once the runs were answered
    groups = client.get("/api/runs/demo/steps/1").json()["groups"]  # while it builds: waits for it
    assert [[(s["judge_calls"], s["judge_failed"]) for s in g["samples"]] for g in groups] == STEP1_JUDGED
    assert len(added) == 3
    first = demo.indexing
    assert client.get("/api/runs").status_code == 200 and demo.indexing is first  # one build a viewer
    first.join(5)
    kept = json.loads((run / ".view" / "judge.index.json").read_text())
    assert kept["end"] == (run / "judge.jsonl").stat().st_size and sorted(kept["requests"]) == ["u1/0", "u1/1"]
    assert len(added) == 3
