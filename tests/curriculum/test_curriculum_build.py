"""`grouprl curriculum build` end to end on small hand-worked data: join counts, buckets,
orders, the written tables (schema kept, extra_info.curriculum, loadable by grouprl), the
report's findings, and all-or-nothing output."""

import argparse
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import grouprl.curriculum.build as build_module
from grouprl.curriculum.cli import add_parser, main
from grouprl.data.dataset import load_samples

REGEX = r"uid_(\d+)_page"
# ndcg per agent; 107 has two agents only, 199 is not in the dataset, 106 is not in the log
SCORES = {
    "101": [1.0, 1.0, 0.5, 1.0],  # 0.875 mastered
    "102": [0.5, 0.0, 1.0, 0.5],  # 0.5 edge, std sqrt(.125)
    "103": [0.0, 0.0, 0.0, 0.0],  # unsolvable, all alike
    "104": [0.25, 0.25, 0.25, 0.25],  # edge under rule mean, all alike
    "105": [0.75, 0.25, 0.5, 0.5],  # 0.5 edge: ties with 102, after it by uid
    "107": [0.5, 0.75],  # 0.625 edge
    "199": [1.0, 0.0, 1.0, 0.0],
}
DATASET_IDS = ["101", "102", "103", "104", "105", "106", "102", "107"]  # row 6 repeats 102


def source_records():
    records = []
    for uid, scores in SCORES.items():
        for agent, score in enumerate(scores):
            judge = 1.0 if score >= 0.5 else 0.0
            records.append(
                {
                    "agent_id": agent,
                    "question": f"q{uid}",
                    "ndcg_value": score,
                    "vlm_score": judge,
                    "final_score": 0.8 * judge + 0.2 * score,
                    "reference_documents": ["/data/cover.jpg", f"/data/images/uid_{uid}_page_3.jpg"],
                }
            )
    records.append(
        {"agent_id": 4, "ndcg_value": None, "reference_documents": ["/data/images/uid_101_page_1.jpg"]}
    )
    return records


def verl_dataset(path, ids=DATASET_IDS):
    table = pa.table(
        {
            "data_source": ["slidevqa"] * len(ids),
            "prompt": [[{"role": "user", "content": f"question {i}"}] for i in ids],
            "reward_model": [{"style": "rule", "ground_truth": f"answer {i}"} for i in ids],
            "extra_info": [{"index": row, "reference_page": 3} for row in range(len(ids))],
            "id": ids,
        }
    )
    pq.write_table(table, path)
    return path


@pytest.fixture
def source(tmp_path):
    logs = tmp_path / "phase1.json"
    logs.write_text(json.dumps(source_records(), indent=1))  # the source's layout: one JSON array
    return {"logs": logs, "dataset": verl_dataset(tmp_path / "train.parquet"), "out": tmp_path / "curriculum"}


def build(capsys, *argv):
    parser = argparse.ArgumentParser(prog="grouprl")
    add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(["curriculum", "build", *map(str, argv)])
    code = args.func(args)
    return code, capsys.readouterr().out


def source_args(source, *extra):
    return [
        "--logs",
        source["logs"],
        "--dataset",
        source["dataset"],
        "--out",
        source["out"],
        "--uid-field",
        "reference_documents",
        "--uid-regex",
        REGEX,
        "--score-field",
        "ndcg_value",
        "--reward-field",
        "final_score",
        "--agent-field",
        "agent_id",
        *extra,
    ]


def ids_and_curriculum(path):
    table = pq.read_table(path)
    return table.column("id").to_pylist(), [
        row["curriculum"] for row in table.column("extra_info").to_pylist()
    ]


def test_source_layout_end_to_end(source, capsys):
    code, out = build(capsys, *source_args(source, "--batch-size", "2"))
    assert code == 0
    summary = json.loads((source["out"] / "summary.json").read_text())
    assert {
        k: summary[k]
        for k in ("matched", "log_only", "dataset_only", "duplicates", "no_score", "malformed_lines")
    } == {
        "matched": 6,
        "log_only": 1,
        "dataset_only": 1,
        "duplicates": 1,
        "no_score": 1,
        "malformed_lines": 0,
    }
    assert summary["buckets"] == {"mastered": 1, "edge": 4, "unsolvable": 1}
    assert summary["thresholds"] == {"easy": 0.7, "hard": 0.1} and summary["rule"] == "mean"
    assert summary["inputs"]["dataset_uid_field"] == "id" and summary["typical_n"] == 4
    assert "matched 6 uids (log only 1, dataset only 1, duplicate rows 1)" in out

    ids, curriculum = ids_and_curriculum(source["out"] / "edge.parquet")
    assert ids == ["107", "102", "105", "104"]  # mean 0.625, 0.5, 0.5 (tie by uid), 0.25
    assert [c["rank"] for c in curriculum] == [0, 1, 2, 3]
    assert [c["score"] for c in curriculum] == [0.625, 0.5, 0.5, 0.25]
    assert [c["n"] for c in curriculum] == [2, 4, 4, 4]
    assert curriculum[1]["std"] == pytest.approx(np.sqrt(0.125), abs=1e-15) and curriculum[3]["std"] == 0.0
    assert {c["bucket"] for c in curriculum} == {"edge"}
    assert ids_and_curriculum(source["out"] / "mastered.parquet")[0] == ["101"]
    assert ids_and_curriculum(source["out"] / "unsolvable.parquet")[0] == ["103"]

    # the dataset's own schema is kept, extra_info gains only `curriculum`
    original, edge = pq.read_table(source["dataset"]), pq.read_table(source["out"] / "edge.parquet")
    assert edge.column_names == original.column_names
    for name in ("data_source", "prompt", "reward_model", "id"):
        assert edge.schema.field(name).type == original.schema.field(name).type
    info = edge.column("extra_info").to_pylist()[0]
    assert (info["index"], info["reference_page"]) == (7, 3)

    # grouprl's own loader reads it, in curriculum order
    samples = load_samples([str(source["out"] / "edge.parquet")])
    assert [s.uid for s in samples] == ["107", "102", "105", "104"]
    assert samples[0].extra_info["curriculum"]["score"] == 0.625
    assert samples[0].ground_truth == "answer 107"

    report = (source["out"] / "report.md").read_text()
    # 104 is all alike: with batches of 2 it sits in the 2nd batch next to 105
    assert "1 of 4 edge prompts (25.0%) had every agent score alike" in report
    assert "they take 1 of the 4 slots of the first 2 batch(es) of 2, and 0 of those batches" in report
    assert "1 of 7 dataset samples (14.3%) have no scored log record" in report
    assert "1 of 7 log uids (14.3%) are not in the dataset" in report
    correlation = np.corrcoef(
        [r["ndcg_value"] for r in source_records()[:-1]], [r["final_score"] for r in source_records()[:-1]]
    )[0, 1]
    assert "buckets are cut on 'ndcg_value', not on the training reward ('final_score')" in report
    assert f"their Pearson correlation over 26 records is {correlation:.3f}" in report
    assert summary["score_reward_correlation"] == pytest.approx(correlation, abs=1e-12)
    assert "1 of 6 matched uids have a number of scored records other than the typical 4" in report
    assert "107 (n=2)" in report
    assert "- row 5: `106` (no scored log record)" in report and "- row 6: `102` (repeated uid)" in report
    excluded = (source["out"] / "excluded.txt").read_text().splitlines()
    assert excluded[1:] == ["5\t106\tno scored log record", "6\t102\trepeats the uid of an earlier row"]
    with Image.open(source["out"] / "histogram.png") as image:
        assert image.size == (800, 460) and image.format == "PNG"


def test_rule_mixed_and_other_orders(source, capsys):
    build(capsys, *source_args(source, "--rule", "mixed", "--order", "hard-to-easy"))
    summary = json.loads((source["out"] / "summary.json").read_text())
    # 104 (0.25, all alike) is 0.45 from easy and 0.15 from hard: unsolvable
    assert summary["buckets"] == {"mastered": 1, "edge": 3, "unsolvable": 2}
    assert ids_and_curriculum(source["out"] / "edge.parquet")[0] == ["102", "105", "107"]
    assert ids_and_curriculum(source["out"] / "unsolvable.parquet")[0] == ["103", "104"]
    assert "every agent score alike" not in (source["out"] / "report.md").read_text()

    build(capsys, *source_args(source, "--order", "hard-to-easy", "--batch-size", "1"))
    report = (source["out"] / "report.md").read_text()
    assert (
        "they take 1 of the 4 slots of the first 4 batch(es) of 1, and 1 of those batches hold nothing else"
        in report
    )

    build(capsys, *source_args(source, "--order", "spread", "--batch-size", "2"))
    # easy-first 107 102 105 104 -> strata [107 102] [105 104] -> 107 105 102 104
    assert ids_and_curriculum(source["out"] / "edge.parquet")[0] == ["107", "105", "102", "104"]


def test_grouprl_rollouts_with_loader_uids(tmp_path, capsys):
    """rollouts.jsonl carries the loader's uid: `<stem>-<index>` for a dataset without ids."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "extra_info": {"index": i}} for i in range(4)]
    dataset = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), dataset)
    rewards = {"train-0": [1.0, 1.0], "train-1": [0.0, 1.0], "train-2": [0.5, 0.0]}
    lines = []
    for uid, values in rewards.items():
        for sample, value in enumerate(values):
            lines.append(
                json.dumps(
                    {
                        "run": "r",
                        "step": 3,
                        "uid": uid,
                        "sample": sample,
                        "reward": value,
                        "rewards": {"correctness": value},
                    }
                )
            )
    lines.insert(2, '{"run": "r", "uid": "train-1", "rew')  # a line cut short by a crash
    (tmp_path / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "cur"
    code, _ = build(
        capsys, "--logs", tmp_path / "*.jsonl", "--dataset", dataset, "--out", out, "--batch-size", "1"
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["inputs"]["dataset_uid_field"] == "@loader"
    assert (summary["matched"], summary["dataset_only"], summary["malformed_lines"]) == (3, 1, 1)
    assert summary["buckets"] == {"mastered": 1, "edge": 2, "unsolvable": 0}
    assert summary["score_reward_correlation"] is None
    report = (out / "report.md").read_text()
    assert "buckets are cut on" not in report  # the score is the training reward
    assert f"`{tmp_path / 'rollouts.jsonl'}:3: " in report
    assert pq.read_table(out / "edge.parquet").column("extra_info").to_pylist() == [
        {"index": 1, "curriculum": {"score": 0.5, "std": 0.5, "n": 2, "bucket": "edge", "rank": 0}},
        {"index": 2, "curriculum": {"score": 0.25, "std": 0.25, "n": 2, "bucket": "edge", "rank": 1}},
    ]


def test_plain_dataset_without_extra_info_gets_one(tmp_path, capsys):
    dataset = tmp_path / "train.jsonl"
    dataset.write_text(
        "".join(json.dumps({"id": f"p{i}", "question": f"q{i}", "answer": str(i)}) + "\n" for i in range(3))
    )
    logs = tmp_path / "r.jsonl"
    logs.write_text(
        "".join(json.dumps({"uid": f"p{i}", "reward": r}) + "\n" for i, r in [(0, 0.5), (0, 0.0), (1, 0.3)])
    )
    out = tmp_path / "cur"
    assert build(capsys, "--logs", logs, "--dataset", dataset, "--out", out)[0] == 0
    edge = pq.read_table(out / "edge.parquet")
    assert edge.column_names == ["id", "question", "answer", "extra_info"]
    assert edge.column("id").to_pylist() == ["p1", "p0"]
    assert edge.column("extra_info").to_pylist()[0] == {
        "curriculum": {"score": 0.3, "std": 0.0, "n": 1, "bucket": "edge", "rank": 0}
    }
    assert [s.uid for s in load_samples([str(out / "edge.parquet")])] == ["p1", "p0"]


# ---------------------------------------------------------------------------- all or nothing
def run_main(capsys, *argv):
    code = main(["build", *map(str, argv)])
    _, err = capsys.readouterr()
    return code, err


def test_errors_are_one_line_and_leave_no_output(source, capsys):
    cases = [
        (["--hard", "0.8", "--easy", "0.7"], "threshold hard (0.8) is above easy (0.7)"),
        (["--uid-regex", r"uid_\d+"], "has 0 capture groups"),
        (["--easy", "0.001", "--hard", "0.001"], "the edge bucket is empty"),
        (["--dataset-uid-field", "extra_info.nope"], "the dataset has no field 'extra_info.nope'"),
    ]
    for extra, message in cases:
        code, err = run_main(capsys, *source_args(source), *extra)
        assert code == 2 and err.startswith("grouprl: error: ") and err.count("\n") == 1, err
        assert message in err
        assert not source["out"].exists()
    assert sorted(p.name for p in source["out"].parent.iterdir()) == [
        "phase1.json",
        "train.parquet",
    ]  # no temp folders
    code, err = run_main(capsys, *source_args(source, "--logs", source["out"].parent / "*.jsonl"))
    assert code == 2 and "glob matches no file" in err


def test_empty_edge_allowed_on_request(source, capsys):
    code, out = build(
        capsys, *source_args(source, "--easy", "0.001", "--hard", "0.001", "--allow-empty-edge")
    )
    assert code == 0 and "warning: the edge bucket is empty" in out
    assert pq.read_table(source["out"] / "edge.parquet").num_rows == 0
    assert pq.read_table(source["out"] / "mastered.parquet").num_rows == 5


def test_a_failure_keeps_the_previous_build_untouched(source, capsys, monkeypatch):
    build(capsys, *source_args(source))
    before = {p.name: p.read_bytes() for p in source["out"].iterdir()}
    code, _ = run_main(capsys, *source_args(source, "--uid-regex", r"nothing_(\d+)"))
    assert code == 2

    def broken_histogram(*args, **kwargs):  # fails after the tables are written
        raise RuntimeError("disk full")

    monkeypatch.setattr(build_module, "draw_histogram", broken_histogram)
    with pytest.raises(RuntimeError, match="disk full"):
        build(capsys, *source_args(source, "--order", "random"))
    assert {p.name: p.read_bytes() for p in source["out"].iterdir()} == before
    assert sorted(p.name for p in source["out"].parent.iterdir()) == [
        "curriculum",
        "phase1.json",
        "train.parquet",
    ]
    monkeypatch.undo()
    build(capsys, *source_args(source, "--order", "random"))  # a later success replaces it
    assert json.loads((source["out"] / "summary.json").read_text())["order"] == "random"


def test_a_folder_with_other_files_is_not_replaced(source, capsys):
    source["out"].mkdir()
    (source["out"] / "notes.txt").write_text("mine")
    code, err = run_main(capsys, *source_args(source))
    assert code == 2 and "holds other files" in err
    assert (source["out"] / "notes.txt").read_text() == "mine"
