"""rollouts.jsonl names the pages an agent's turns showed or cropped by files inside the run:
each page is copied once into images/pages/ (two corpora's pages of the same name kept apart),
and a page that is gone keeps its own path."""

from __future__ import annotations

import json

from grouprl.data.sample import Sample
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.loggers import RolloutWriter


def test_turn_pages_are_copied_into_the_run_once(tmp_path):
    first, second = tmp_path / "a" / "p1.png", tmp_path / "b" / "p1.png"
    for path, data in ((first, b"page a"), (second, b"page b")):
        path.parent.mkdir()
        path.write_bytes(data)
    gone = str(tmp_path / "gone.png")
    turns = [
        {"turn": 0, "action": "search", "page": str(first), "page_size": [20, 10]},
        {"turn": 1, "action": "bbox", "page": str(first), "page_size": [20, 10]},
        {"turn": 2, "action": "search", "page": str(second), "page_size": [20, 10]},
        {"turn": 3, "action": "search", "page": gone, "page_size": [20, 10]},
        {"turn": 4, "action": "answer"},
    ]
    t = Trajectory(sample=Sample(uid="u", messages=[{"role": "user", "content": "q"}]), index=0, prompt_ids=[1], turns=turns)
    images = tmp_path / "run" / "images"
    (line,) = RolloutWriter.lines("run", 1, [t], {}, images)
    pages = [turn.get("page") for turn in json.loads(line)["turns"]]
    assert pages[0] == pages[1] != pages[2] and pages[3] == gone and pages[4] is None
    assert pages[0].startswith("images/pages/p1_") and pages[2].startswith("images/pages/p1_")
    assert (tmp_path / "run" / pages[0]).read_bytes() == b"page a"
    assert (tmp_path / "run" / pages[2]).read_bytes() == b"page b"
    assert sorted(p.name for p in (images / "pages").iterdir()) == sorted({pages[0][13:], pages[2][13:]})
    assert t.turns[0]["page"] == str(first)  # the trajectory's own records are left as they were
    (again,) = RolloutWriter.lines("run", 2, [t], {}, images)  # a later step: the same files
    assert [turn.get("page") for turn in json.loads(again)["turns"]] == pages


def test_ranks_copying_the_same_page_at_once_both_succeed(tmp_path, monkeypatch):
    """Every rank writes its rows' lines: two copying one page at the same moment each write a
    partial file of their own (one shared name made the second rename fail)."""
    import shutil
    import threading

    from grouprl.trainer import loggers

    page = tmp_path / "p.png"
    page.write_bytes(b"page")
    both_copied = threading.Barrier(2, timeout=10)
    copy = shutil.copyfile

    def copy_then_wait(source, target):
        copy(source, target)
        both_copied.wait()  # both partial files written before either is renamed

    monkeypatch.setattr(loggers.shutil, "copyfile", copy_then_wait)
    images = tmp_path / "run" / "images"
    turns = [{"turn": 0, "action": "search", "page": str(page), "page_size": [4, 2]}]
    results, errors = [], []

    def rank(k: int) -> None:
        t = Trajectory(sample=Sample(uid=f"u{k}", messages=[{"role": "user", "content": "q"}]), index=0, prompt_ids=[1], turns=turns)
        try:
            results.append(json.loads(RolloutWriter.lines("run", 1, [t], {}, images)[0])["turns"][0]["page"])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1
    assert (tmp_path / "run" / results[0]).read_bytes() == b"page"
    assert [p.name for p in (images / "pages").iterdir()] == [results[0].split("/")[-1]]  # no partial left
