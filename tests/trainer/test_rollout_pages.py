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
