"""grouprl view against a run whose text is untrusted, each finding tried as it was found, on
127.0.0.1: a page elsewhere rebinding its name to this machine (a foreign Host), a record's own
link to an image elsewhere, the index written through a link, lines that cannot be read (cut
short, not JSON, a bad escape, bytes that are not UTF-8, a judge line's `"time": --1`, fields
of the wrong type) at the start and appended to a live run, and what every answer carries (a
Content-Security-Policy)."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from grouprl.retriever.service import BackgroundServer
from grouprl.view.app import CSP, create_app
from grouprl.view.runs import open_runs
from view.run_files import client_of, judge_line, make_run, rollout, turn, write_lines

ROUTES = [
    "/", "/static/app.js", "/static/plotly.min.js", "/api/runs", "/api/runs/demo/metrics", "/api/runs/demo/steps/1",
    "/api/runs/demo/sample?step=1&uid=u1&sample=0", "/api/runs/demo/uid?uid=u1", "/api/runs/demo/answers?folder=eval",
    "/files/demo/images/pages/p_1.png",
]  # fmt: skip


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path)


def test_a_foreign_host_is_refused_on_every_route(run):
    """DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1 asks with its
    own name in Host; it read /api/runs and every trajectory before. Loopback names, the
    --host given and addresses written out are answered."""
    with BackgroundServer(create_app(open_runs([str(run)]), hosts=("viewer.lan",))) as server:
        port = server.port
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for route in ROUTES:
                refused = client.get(route, headers={"Host": f"evil.example:{port}"})
                assert refused.status_code == 403, route
                assert "demo" not in refused.text and refused.headers["content-security-policy"] == CSP
                assert client.get(route, headers={"Host": f"127.0.0.1:{port}"}).status_code == 200, route
            for host in ["localhost", f"localhost:{port}", f"[::1]:{port}", f"viewer.lan:{port}", f"10.1.2.3:{port}",
                         f"LOCALHOST:{port}"]:  # fmt: skip
                assert client.get("/api/runs", headers={"Host": host}).status_code == 200, host
            for host in ["evil.example", f"localhost.evil.example:{port}", f"127.0.0.1.evil.example:{port}", "",
                         f"localhost.:{port}", "::1", f"127.0.0.1:{port}x"]:  # fmt: skip
                assert client.get("/api/runs", headers={"Host": host}).status_code == 403, host


def test_every_answer_carries_the_content_security_policy(run):
    client = client_of(run)
    for route in [*ROUTES, "/api/runs/demo/steps/9", "/files/demo/metrics.jsonl", "/nowhere"]:
        answer = client.get(route)
        assert answer.headers["content-security-policy"] == CSP, route
        assert answer.headers["x-content-type-options"] == "nosniff"
    policy = dict(part.strip().split(" ", 1) for part in CSP.split(";"))
    assert policy["default-src"] == "'self'" and policy["img-src"] == "'self' data:"
    assert "unsafe-inline" not in CSP and "unsafe-eval" not in CSP and "http" not in CSP


def test_a_records_own_links_never_reach_the_page(run):
    """A turn whose page file is missing but which carries its own page_url, and a record with
    its own image_urls: neither reaches an <img src>; links are built only from files found."""
    evil = "https://evil.example/pixel.png"
    turns = [turn(0, "search", "x", "images/pages/missing.png", [20, 10], page_url=evil),
             turn(1, "search", "y", "images/pages/p_1.png", [20, 10], page_url=evil), turn(2, "answer", "z", page_url=evil)]  # fmt: skip
    record = {**rollout(3, "u9", 0, 1.0, 300.0, turns=turns), "image_urls": {"clip": evil}, "images": {"clip": evil}}
    write_lines(run / "rollouts.jsonl", [record], "a")
    sample = client_of(run).get("/api/runs/demo/sample", params={"step": 3, "uid": "u9", "sample": 0}).json()
    assert [t.get("page_url") for t in sample["turns"]] == [None, "files/demo/images/pages/p_1.png", None]
    assert sample["image_urls"] == {} and evil not in json.dumps({k: v for k, v in sample.items() if k != "images"})


def test_the_index_is_never_written_through_a_link(run, tmp_path, monkeypatch):
    """A `.view/rollouts.index.json.partial` linking to a file outside the run had that file
    overwritten with index JSON; the index itself as a link, and `.view` as a link, likewise."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / ".view").mkdir()
    (run / ".view" / "rollouts.index.json.partial").symlink_to(victim)
    (run / ".view" / "judge.index.json").symlink_to(victim)
    client = client_of(run)
    assert client.get("/api/runs/demo/steps/1").status_code == 200
    assert victim.read_text() == "precious\n"
    assert not (run / ".view" / "judge.index.json").is_symlink()  # replaced by the index, the link's target untouched
    assert json.loads((run / ".view" / "judge.index.json").read_text())["kind"] == "judge"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = make_run(tmp_path / "second")
    (other / ".view").symlink_to(elsewhere)
    assert client_of(other).get("/api/runs/demo/steps/1").status_code == 200
    assert list(elsewhere.iterdir()) == []  # refused: the index went to the cache
    [kept] = (tmp_path / "cache" / "grouprl" / "view").iterdir()
    assert sorted(p.name for p in kept.iterdir()) == ["judge.index.json", "rollouts.index.json"]


BAD_ROLLOUTS = {  # each line belongs to step 1 (or would): one line it costs, nothing more
    "truncated": b'{"run": "demo", "step": 1, "uid": "u1", "sample": 2, "prompt": "q',
    "non-json": b'{"run": "demo", "step": 1, "uid": "u1", "sample": 2} trailing words}',
    "bad-escape": b'{"run": "demo", "step": 1, "uid": "u\\x", "sample": 2}',
    "non-utf8-uid": b'{"run": "demo", "step": 1, "uid": "u\xff", "sample": 2}',
    "not-an-object": b"[1, 2, 3]",
    "huge-int": b'{"run": "demo", "step": 1' + b"0" * 5000 + b', "uid": "u1", "sample": 2}',
    "nested": b'{"step": 1, "uid": "u1", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "garbage": b"\x00\xff not json at all",
}
SHAPES = {  # lines that read, with fields of the wrong type: shown without those fields
    "wrong-types": {**rollout(1, "u1", 2, 0.5, 100.0), "reward": "high", "advantage": "low", "turns": 5, "rewards": [1], "response": 7},
    "wrong-turns": {**rollout(1, "u1", 2, 0.5, 100.0), "turns": [3, {"page": 5, "page_size": "x", "argument": []}]},
    "nan-and-surrogate": {**rollout(1, "u1", 2, float("nan"), 100.0), "response": "\udc80 lone", "advantage": float("inf")},
}


def routes_answer(client) -> list[int]:
    paths = ["/api/runs", "/api/runs/demo/steps/1", "/api/runs/demo/steps/2", "/api/runs/demo/sample?step=1&uid=u1&sample=0",
             "/api/runs/demo/sample?step=2&uid=u1&sample=0", "/api/runs/demo/uid?uid=u1", "/api/runs/demo/metrics"]  # fmt: skip
    return [client.get(p).status_code for p in paths]


def insert_into_step_1(path, line: bytes) -> None:
    """`line` after step 1's first line (inside its byte range)."""
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([lines[0], line, *lines[1:]]))


@pytest.mark.parametrize("name", list(BAD_ROLLOUTS))
def test_a_line_that_cannot_be_read_costs_that_line(run, name):
    """At the start (it stopped the viewer, or answered 500 for that step, the next, the sample
    and the uid) and appended to a live run: every answer 200, the line counted."""
    insert_into_step_1(run / "rollouts.jsonl", BAD_ROLLOUTS[name])
    client = client_of(run)
    assert routes_answer(client) == [200] * 7
    runs = client.get("/api/runs").json()[0]
    step = client.get("/api/runs/demo/steps/1").json()
    # the index places a line that begins and ends as the writer's (read whole only when its
    # step is asked for); every other line it cannot read it counts at once
    placed = name == "non-json"
    assert runs["unreadable"] == ({} if placed else {"rollouts.jsonl": 1}) and runs["trajectories"] == 8 + placed
    assert step["unreadable"] == 1 and [len(g["samples"]) for g in step["groups"]] == [2, 2]
    # live: the same line appended as step 3 (a new step), then a good line of step 3
    with open(run / "rollouts.jsonl", "ab") as f:
        f.write(BAD_ROLLOUTS[name].replace(b'"step": 1', b'"step": 3') + b"\n")
        f.write((json.dumps(rollout(3, "u4", 0, 0.25, 300.0)) + "\n").encode())
    assert routes_answer(client) == [200] * 7
    assert client.get("/api/runs/demo/steps/3").json()["groups"][0]["samples"][0]["reward"] == 0.25


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_field_of_the_wrong_type_costs_that_field(run, name):
    insert_into_step_1(run / "rollouts.jsonl", json.dumps(SHAPES[name]).encode())
    client = client_of(run)
    assert routes_answer(client) == [200] * 7
    step = client.get("/api/runs/demo/steps/1").json()
    [u1_2] = [s for s in step["groups"][0]["samples"] if s["sample"] == 2]
    assert step["unreadable"] == 0 and u1_2["actions"] in ([], [None])
    if name != "wrong-turns":
        assert u1_2["reward"] is None and u1_2["advantage"] is None  # a string, NaN, inf: no figure
    sample = client.get("/api/runs/demo/sample", params={"step": 1, "uid": "u1", "sample": 2})
    assert sample.status_code == 200 and sample.text.isascii()  # a lone surrogate travels as an escape
    for t in sample.json()["turns"]:
        assert "page" not in t and "page_url" not in t and "argument" not in t


@pytest.mark.parametrize("live", [False, True])
def test_a_judge_line_that_cannot_be_read_costs_that_line(run, live):
    """judge.jsonl's `"time": --1` stopped the viewer at start with a traceback; appended to a
    live run it turned every answer into 500 and killed the judge index's thread."""
    bad = b'{"time": --1, "judge": "grader", "request_id": "u1/0", "error": null, "cached": false, "attempts": 1}\n'
    [demo] = open_runs([str(run)])
    if not live:
        with open(run / "judge.jsonl", "ab") as f:
            f.write(bad)
        demo.refresh()  # as `grouprl view` opens a run
    client = TestClient(create_app([demo]), base_url="http://127.0.0.1:8008")
    assert client.get("/api/runs").status_code == 200
    demo.indexing.join(10)
    if live:
        with open(run / "judge.jsonl", "ab") as f:
            f.write(bad)
            f.write((json.dumps(judge_line(95.0, "u2/0", "late")) + "\n").encode())
    assert routes_answer(client) == [200] * 7
    assert client.get("/api/runs").json()[0]["unreadable"] == {"judge.jsonl": 1}
    groups = client.get("/api/runs/demo/steps/1").json()["groups"]
    assert [[(s["judge_calls"], s["judge_failed"]) for s in g["samples"]] for g in groups] == [
        [(1, False), (1, True)], [(1 if live else 0, False), (0, False)]]
    sample = client.get("/api/runs/demo/sample", params={"step": 1, "uid": "u1", "sample": 0}).json()
    assert [c["raw"] for c in sample["judge"]] == ['correct "yes", "error": no'] and sample["unreadable"] == 0
    assert not demo.indexing.is_alive()


def test_metrics_and_answers_lines_are_read_alone_and_counted(run):
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "reward/mean": NaN, "actor/kl": 0.5, "bad": "text"}\n{"step": "4"}\nnot json\n')
    with open(run / "eval" / "answers.jsonl", "ab") as f:
        f.write(b'{"uid": "v2", "prompt": "q", "response": "\\udc80", "accuracy": "high"}\n{"no uid": 1}\n\xff\n')
    client = client_of(run)
    metrics = client.get("/api/runs/demo/metrics").json()
    assert metrics["rows"][-1] == {"step": 3, "actor/kl": 0.5} and metrics["unreadable"] == 2
    answers = client.get("/api/runs/demo/answers", params={"folder": "eval"}).json()
    assert [r["uid"] for r in answers["rows"]] == ["v1", "v2"] and "accuracy" not in answers["rows"][1]
    assert answers["unreadable"] == 2
    assert client.get("/api/runs").json()[0]["unreadable"] == {"metrics.jsonl": 2}


@pytest.mark.parametrize(
    "rollouts, judge",
    [
        ('{"version": 2, "kind": "rollouts", "steps": [[1, "a", null, 3]], "end": "x"}', "[1, 2"),
        ('{"version": 2, "kind": "rollouts", "end": 5, "mark": "zz", "unreadable": 0, "steps": [], "uids": {}}',
         '{"version": 2, "kind": "judge", "end": 0, "mark": "", "unreadable": 0, "requests": {"u1/0": [["x", 0, 1, 2]]}}'),
    ],
)
def test_a_damaged_index_is_built_again_or_read_around(run, rollouts, judge):
    client_of(run).get("/api/runs/demo/steps/1")
    (run / ".view" / "rollouts.index.json").write_text(rollouts)
    (run / ".view" / "judge.index.json").write_text(judge)
    client = client_of(run)
    assert routes_answer(client) == [200] * 7
    assert client.get("/api/runs").json()[0]["trajectories"] == 8
