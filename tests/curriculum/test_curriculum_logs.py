"""Log readers: both layouts, dotted fields, uid regexes, JSON arrays and JSONL, globs, bad
lines; and the pyarrow fast path agreeing with the line-by-line path."""

import io
import json

import numpy as np
import pyarrow.json as pj
import pytest

import grouprl.curriculum.logs as logs_module
from grouprl.curriculum.extract import FieldExtractor
from grouprl.curriculum.logs import LogFields, read_logs
from grouprl.errors import ConfigError, DataError

REGEX = r"uid_(\d+)_page"


def write_jsonl(path, records, raw_lines=()):
    lines = [json.dumps(r) for r in records]
    for index, text in raw_lines:
        lines.insert(index, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def per_uid(result):
    """{uid: sorted scores} from a LogScores."""
    out = {}
    for code, score in zip(result.codes.tolist(), result.scores.tolist()):
        out.setdefault(result.uids[code], []).append(score)
    return {uid: sorted(scores) for uid, scores in out.items()}


def rollout(uid, sample, reward, ndcg, **extra):
    return {
        "run": "r",
        "step": 1,
        "uid": uid,
        "sample": sample,
        "prompt": "p",
        "response": "a",
        "turns": 1,
        "retrieved": [],
        "rewards": {"ndcg": ndcg, "judge": reward},
        "reward": reward,
        "advantage": 0.0,
        "response_tokens": 3,
        "truncated": False,
        "finish_reason": "stop",
        "ground_truth": "x",
        **extra,
    }


def test_grouprl_rollouts_default_fields_and_a_dotted_component(tmp_path):
    path = write_jsonl(
        tmp_path / "rollouts.jsonl",
        [
            rollout("q1", 0, 1.0, 0.5),
            rollout("q1", 1, 0.0, 0.25),
            rollout("q2", 0, 0.5, 1.0),
            rollout("q2", 1, None, 0.0),  # a non-finite reward was logged as null
        ],
    )
    result = read_logs([str(path)], LogFields())
    assert per_uid(result) == {"q1": [0.0, 1.0], "q2": [0.5]}
    assert (result.records, result.no_score, result.unscored_uids) == (4, 1, 0)
    by_ndcg = read_logs([str(path)], LogFields(score_field="rewards.ndcg"))
    assert per_uid(by_ndcg) == {"q1": [0.25, 0.5], "q2": [0.0, 1.0]}
    # the training reward rides along for the proxy correlation (NaN where it was null)
    assert np.array_equal(by_ndcg.rewards, np.array([1.0, 0.0, 0.5, np.nan]), equal_nan=True)


def test_source_layout_uid_from_a_list_of_paths_first_match_wins(tmp_path):
    records = [
        {
            "reference_documents": ["/x/cover.jpg", "/d/uid_12_page_1.jpg", "/d/uid_13_page_2.jpg"],
            "ndcg_value": 0.5,
        },
        {"reference_documents": ["/d/uid_12_page_4.jpg"], "ndcg_value": 1},
        {"reference_documents": ["/x/none.jpg"], "ndcg_value": 0.3},  # no uid in it
        {"reference_documents": "/d/uid_14_page_1.jpg", "ndcg_value": 0.0},  # a single string works too
        {"reference_documents": [], "ndcg_value": 0.9},
        {"other": 1, "ndcg_value": 0.9},  # no such field
    ]
    path = write_jsonl(tmp_path / "phase1.jsonl", records)
    result = read_logs(
        [str(path)], LogFields(uid_field="reference_documents", uid_regex=REGEX, score_field="ndcg_value")
    )
    assert per_uid(result) == {"12": [0.5, 1.0], "14": [0.0]}
    assert result.no_uid == 3 and result.records == 6


def test_json_array_nested_fields_int_uids_and_globs(tmp_path):
    (tmp_path / "a.json").write_text(
        json.dumps(
            [
                {"extra_info": {"uid": 7}, "score": {"ndcg": 0.5}},
                {"extra_info": {"uid": 7}, "score": {"ndcg": True}},  # a pass/fail flag counts as 1
                {"extra_info": {"uid": "8"}, "score": {"ndcg": "high"}},  # not a number
            ],
            indent=2,
        )
    )
    write_jsonl(tmp_path / "b.jsonl", [{"extra_info": {"uid": "8"}, "score": {"ndcg": 0.25}}])
    (tmp_path / "c.jsonl").write_text("\n\n")  # empty files are fine
    fields = LogFields(uid_field="extra_info.uid", score_field="score.ndcg")
    result = read_logs([str(tmp_path / "*.json*"), str(tmp_path / "a.json")], fields)  # a.json once
    assert result.files == [str(tmp_path / n) for n in ("a.json", "b.jsonl", "c.jsonl")]
    assert per_uid(result) == {"7": [0.5, 1.0], "8": [0.25]}
    assert (result.records, result.no_score, result.unscored_uids) == (4, 1, 0)


def test_malformed_lines_are_skipped_counted_and_located(tmp_path):
    good = [rollout("q1", i, 0.5, 0.5) for i in range(4)]
    path = write_jsonl(
        tmp_path / "r.jsonl", good, raw_lines=[(1, '{"uid": "q1", "reward": 0.'), (3, "[1, 2]"), (4, "")]
    )
    # lines: 1 good, 2 cut short, 3 good, 4 an array, 5 blank (not counted), 6 good, 7 good
    result = read_logs([str(path)], LogFields())
    assert result.malformed == 2 and per_uid(result) == {"q1": [0.5] * 4}
    assert result.malformed_lines[0].startswith(f"{path}:2: ")
    assert result.malformed_lines[1] == f"{path}:4: a JSON list, not an object"


def test_a_bad_line_inside_large_blocks_costs_only_its_neighbourhood(tmp_path, monkeypatch):
    """Small blocks force the pyarrow path, its halving and the line-by-line tail together."""
    monkeypatch.setattr(logs_module, "_JSONL_BLOCK", 4096)
    monkeypatch.setattr(logs_module, "_FEW_LINES", 4)
    rng = np.random.default_rng(0)
    records = [rollout(f"q{int(rng.integers(50))}", i, float(rng.integers(5)) / 4, 0.0) for i in range(600)]
    bad = {(100, "{oops"), (101, '{"uid": 1}{"uid": 2}'), (350, "  "), (599, "\ufeff{")}
    path = write_jsonl(tmp_path / "r.jsonl", records, raw_lines=sorted(bad))
    result = read_logs([str(path)], LogFields())
    expected = {}
    for r in records:
        expected.setdefault(r["uid"], []).append(r["reward"])
    assert per_uid(result) == {u: sorted(v) for u, v in expected.items()}
    assert result.malformed == 3 and result.records == 600
    assert [line.split(":")[1] for line in result.malformed_lines] == ["101", "102", "600"]


def test_arrow_and_python_paths_extract_the_same():
    records = [
        {"uid": "a", "score": 1, "reward": 0.5, "agent": 1, "docs": ["/uid_1_page_1", "/uid_2_page_1"]},
        {"uid": "", "score": 0.5, "reward": None, "agent": 2, "docs": ["none", None]},
        {"score": None, "agent": None, "docs": None},
        {"uid": None, "score": 2.5, "reward": 1, "docs": ["/uid_3_page_9"]},
        {"uid": "b", "score": 0.25, "reward": 0.0, "agent": 1, "docs": []},
    ]
    text = "".join(json.dumps(r) + "\n" for r in records)
    table = pj.read_json(io.BytesIO(text.encode()))
    for uid_field, regex in (("uid", None), ("docs", REGEX), ("uid", "(a|b)")):
        extractor = FieldExtractor(uid_field, regex, "score", "reward", "agent")
        fast, slow = extractor.from_table(table), extractor.from_records(records)
        assert fast.uids.tolist() == slow.uids.tolist()
        assert np.array_equal(fast.scores, slow.scores, equal_nan=True)
        assert np.array_equal(fast.rewards, slow.rewards, equal_nan=True)
        assert fast.agents.tolist() == slow.agents.tolist()
    extractor = FieldExtractor("docs", REGEX, "score")
    assert extractor.from_table(table).uids.tolist() == ["1", None, None, "3", None]
    ints = [{"id": 5, "s": True}, {"id": 6, "s": False}]
    table = pj.read_json(io.BytesIO("".join(json.dumps(r) + "\n" for r in ints).encode()))
    fast, slow = (
        FieldExtractor("id", None, "s").from_table(table),
        FieldExtractor("id", None, "s").from_records(ints),
    )
    assert fast.uids.tolist() == slow.uids.tolist() == ["5", "6"]
    assert fast.scores.tolist() == slow.scores.tolist() == [1.0, 0.0]


# ---------------------------------------------------------------------------- mistakes
def test_missing_files_and_empty_globs(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        read_logs([str(tmp_path / "gone.jsonl")], LogFields())
    with pytest.raises(DataError, match="glob matches no file"):
        read_logs([str(tmp_path / "*.jsonl")], LogFields())


@pytest.mark.parametrize(
    "regex, message",
    [
        (r"uid_\d+", "has 0 capture groups"),
        (r"(uid)_(\d+)", "has 2 capture groups"),
        (r"uid_(\d+", "not a valid"),
    ],
)
def test_uid_regex_needs_exactly_one_group(tmp_path, regex, message):
    path = write_jsonl(tmp_path / "r.jsonl", [{"docs": ["uid_1_page_1"], "s": 1}])
    with pytest.raises(ConfigError, match=message):
        read_logs([str(path)], LogFields(uid_field="docs", uid_regex=regex, score_field="s"))


def test_fields_missing_from_every_record_are_named(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"ref": ["/d/uid_1_page_1.jpg"], "ndcg_value": 0.5}])
    with pytest.raises(
        DataError,
        match=r"no log record has the uid field 'uid' \(fields of the first record: ref, ndcg_value\)",
    ):
        read_logs([str(path)], LogFields())
    with pytest.raises(DataError, match="no log record has the score field 'reward'"):
        read_logs([str(path)], LogFields(uid_field="ref", uid_regex=REGEX))
    with pytest.raises(DataError, match=r"--uid-regex 'page_\(\\d\+\)x' matches no value of 'ref'"):
        read_logs([str(path)], LogFields(uid_field="ref", uid_regex=r"page_(\d+)x", score_field="ndcg_value"))


def test_a_broken_json_array_is_an_error_with_its_line(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"uid": "a", "reward": 1},\n  {"uid": "b", "reward": }\n]\n')
    with pytest.raises(DataError, match=r"a.json line 3: Expecting value"):
        read_logs([str(path)], LogFields())
    path.write_text('[{"uid": "a", "reward": 1}, 5, {"uid": "b", "reward": 0}]')
    result = read_logs([str(path)], LogFields())
    assert result.malformed == 1 and "element 2 is a JSON int" in result.malformed_lines[0]
    assert per_uid(result) == {"a": [1.0], "b": [0.0]}


def test_json_array_larger_than_the_read_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(logs_module, "_CHUNK", 7)  # every element straddles reads
    records = [{"uid": f"u{i % 3}", "reward": i / 10, "text": "x" * (i % 13)} for i in range(40)]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=1))
    result = read_logs([str(tmp_path / "a.json")], LogFields())
    assert result.records == 40 and result.malformed == 0
    assert per_uid(result) == {f"u{k}": sorted(i / 10 for i in range(40) if i % 3 == k) for k in range(3)}
