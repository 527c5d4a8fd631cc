import hashlib
import io
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grouprl.data import load_samples
from grouprl.data.dataset import _plain
from grouprl.errors import DataError

PLAIN_ROWS = [
    {"id": "p1", "question": "What is 2 + 2?", "answer": "4", "gold_docs": ["doc7"], "system": "Be brief."},
    {"id": "p2", "question": "Capital of France?", "answer": "Paris", "gold_docs": None, "system": None},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def png_bytes(colour=(200, 30, 30), size=(8, 6)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png_bytes()


def verl_table():
    """The VRAG/verl layout: nested prompt list, reward_model struct, extra_info struct, image bytes."""
    return pa.table(
        {
            "data_source": ["slidevqa", "slidevqa"],
            "prompt": [
                [{"role": "system", "content": "Search first."}, {"role": "user", "content": "<image>Who won?"}],
                [{"role": "user", "content": "How many slides?"}],
            ],
            "images": [[PNG], []],
            "reward_model": [
                {"style": "rule", "ground_truth": "Alice"},
                {"style": "rule", "ground_truth": "12"},
            ],
            "extra_info": [
                {"index": 0, "reference_page": [3, 4], "question": "Who won?"},
                {"index": 1, "reference_page": [9], "question": "How many slides?"},
            ],
            "ability": ["vqa", "vqa"],
        }
    )


def test_plain_jsonl(tmp_path):
    samples = load_samples([write_jsonl(tmp_path / "qa.jsonl", PLAIN_ROWS)])
    first, second = samples
    assert first.uid == "p1"
    assert first.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    assert first.ground_truth == "4"
    assert first.extra_info == {"gold_docs": ["doc7"]}
    assert first.images == []
    assert second.messages == [{"role": "user", "content": "Capital of France?"}]
    assert second.extra_info == {}


def test_plain_parquet_round_trip(tmp_path):
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist(PLAIN_ROWS), path)
    from_parquet = load_samples([str(path)])
    from_jsonl = load_samples([write_jsonl(tmp_path / "qa.jsonl", PLAIN_ROWS)])
    assert from_parquet == from_jsonl


def test_plain_json_list(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(PLAIN_ROWS))
    assert [s.uid for s in load_samples([str(path)])] == ["p1", "p2"]


def test_verl_parquet(tmp_path):
    path = tmp_path / "slides.parquet"
    pq.write_table(verl_table(), path)
    first, second = load_samples([str(path)])

    assert first.uid == "slides-0"  # extra_info.index with the file stem
    assert second.uid == "slides-1"
    assert first.messages == [
        {"role": "system", "content": "Search first."},
        {"role": "user", "content": "<image>Who won?"},
    ]
    assert first.ground_truth == "Alice"
    assert first.images == [PNG]
    assert first.data_source == "slidevqa"
    assert first.extra_info == {
        "index": 0,
        "reference_page": [3, 4],
        "question": "Who won?",
        "ability": "vqa",
    }
    # plain python all the way down
    assert type(first.extra_info["index"]) is int
    assert type(first.extra_info["reference_page"]) is list
    assert type(first.messages) is list and type(first.messages[0]) is dict
    assert type(first.images[0]) is bytes


def test_layout_is_detected_per_file(tmp_path):
    verl = tmp_path / "v.parquet"
    pq.write_table(verl_table(), verl)
    plain = write_jsonl(tmp_path / "p.jsonl", PLAIN_ROWS)
    assert [s.uid for s in load_samples([str(verl), plain])] == ["v-0", "v-1", "p1", "p2"]


def test_uid_sources_in_order(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    rows = [
        {"prompt": messages, "uid": "top-uid", "id": "top-id", "extra_info": {"uid": "x", "index": 0}},
        {"prompt": messages, "id": 17, "extra_info": {"uid": "x", "index": 1}},
        {"prompt": messages, "extra_info": {"id": "inner-id", "index": 2}},
        {"prompt": messages, "extra_info": {"index": 3}},
        {"prompt": messages},
    ]
    samples = load_samples([write_jsonl(tmp_path / "d.jsonl", rows)])
    prompt_hash = hashlib.sha1(b'[{"content": "hi", "role": "user"}]').hexdigest()[:16]
    assert [s.uid for s in samples] == ["top-uid", "17", "inner-id", "d-3", prompt_hash]


def test_repeated_uids_get_suffixes_and_one_warning(tmp_path, caplog):
    rows = [{"id": uid, "question": "q", "answer": "a"} for uid in ["a", "b", "a", "a", "a#2", "b"]]
    with caplog.at_level(logging.WARNING, logger="grouprl.data.dataset"):
        samples = load_samples([write_jsonl(tmp_path / "d.jsonl", rows)])
    # "a#2" is a real id further down, so the second repeat of "a" skips to #3
    assert [s.uid for s in samples] == ["a", "b", "a#3", "a#4", "a#2", "b#2"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("3 samples")


def test_same_file_twice_is_made_unique(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", PLAIN_ROWS)
    assert [s.uid for s in load_samples([path, path])] == ["p1", "p2", "p1#2", "p2#2"]


def test_max_samples_stops_across_files(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", PLAIN_ROWS)
    second = write_jsonl(tmp_path / "b.jsonl", [{"id": "b1", "question": "q", "answer": "a"}])
    assert [s.uid for s in load_samples([first, second], max_samples=3)] == ["p1", "p2", "b1"]
    assert [s.uid for s in load_samples([first, second], max_samples=1)] == ["p1"]
    assert len(load_samples([first, second], max_samples=0)) == 3


def test_numpy_values_become_python():
    import numpy as np

    value = _plain({"a": np.int64(3), "b": np.array([1.5, 2.5]), "c": [np.str_("x")], "d": pa.scalar(4)})
    assert value == {"a": 3, "b": [1.5, 2.5], "c": ["x"], "d": 4}
    assert [type(value["a"]), type(value["b"][0]), type(value["c"][0]), type(value["d"])] == [
        int,
        float,
        str,
        int,
    ]


# -- errors ----------------------------------------------------------------------------
def error_of(paths):
    with pytest.raises(DataError) as caught:
        load_samples([str(p) for p in paths])
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_missing_file(tmp_path):
    assert "dataset file not found" in error_of([tmp_path / "nope.parquet"])


def test_unknown_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("id,question\n")
    message = error_of([path])
    assert "unknown dataset extension '.csv'" in message and ".parquet, .jsonl, .json" in message


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"this is not parquet at all")
    assert f"cannot read parquet file {path}" in error_of([path])


def test_bad_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n\n{"question": oops}\n')
    assert f"bad JSON in {path} line 3" in error_of([path])


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n[1, 2]\n')
    assert "line 2 is a list, expected an object" in error_of([path])


def test_bad_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n {"question": "q",\n}\n]')
    assert f"bad JSON in {path} line 3" in error_of([path])


def test_json_that_is_not_a_list(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"question": "q", "answer": "a"}')
    assert "must hold a JSON list of objects" in error_of([path])


def test_not_utf8(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"question": "\xff"}\n')
    assert "not UTF-8" in error_of([path])


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json", "empty.parquet"])
def test_empty_files(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(
            pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path
        )
    else:
        path.write_text("[]" if name.endswith(".json") else "\n")
    assert f"dataset {path} is empty" in error_of([path])


def test_no_files():
    with pytest.raises(DataError, match="no dataset files given"):
        load_samples([])


def test_missing_columns_name_found_and_accepted(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"query": ["q"], "answer": ["a"]}), path)
    message = error_of([path])
    assert "has columns query, answer" in message
    assert "verl layout (prompt" in message and "plain layout (question, optional answer" in message


def test_malformed_prompt_names_the_row(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "ok"}]}, {"prompt": [{"x": 1}]}]
    )
    assert "row 1: 'prompt' must be a non-empty list of {role, content} messages" in error_of([path])


def test_empty_question_names_the_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": " ", "answer": "a"}])
    assert "row 0: 'question' must be non-empty text" in error_of([path])


# ---------------------------------------------------------------- images
def test_image_paths_resolve_against_the_data_file_and_placeholders_are_added(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png_bytes())
    (tmp_path / "img" / "b.png").write_bytes(png_bytes((0, 0, 255)))
    rows = [
        {"id": "q1", "question": "Which is red?", "answer": "a", "images": ["img/a.png", "img/b.png"]},
        {"id": "q2", "question": "Look: <image> and say", "answer": "b", "images": ["img/b.png"]},
    ]
    first, second = load_samples([write_jsonl(tmp_path / "data.jsonl", rows)])
    assert first.images == [str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "b.png")]
    assert first.messages[-1]["content"] == "<image><image>Which is red?"  # one per image, up front
    assert second.messages[-1]["content"] == "Look: <image> and say"  # placed by the user: kept


@pytest.mark.parametrize(
    "images, question, message",
    [
        (["gone.png"], "q <image>", "row 0: image 0: image file not found: {dir}/gone.png"),
        ([b"not an image"], "q <image>", "row 0: image 0: unreadable image (UnidentifiedImageError: "),
        (["ok.png"], "<image> and <image>", "row 0: 2 <image> placeholder(s) in the prompt but 1 image(s)"),
        ([], "see <image>", "row 0: 1 <image> placeholder(s) in the prompt but 0 image(s)"),
    ],
)
def test_bad_images_are_one_line_naming_the_row(tmp_path, images, question, message):
    (tmp_path / "ok.png").write_bytes(png_bytes())
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "q", "question": question, "answer": "x", "images": images}]), path)
    with pytest.raises(DataError) as e:
        load_samples([str(path)])
    expected = f"{path} " + message.format(dir=tmp_path)
    if expected.endswith(": "):  # the reader's own wording follows
        assert str(e.value).startswith(expected) and "\n" not in str(e.value)
    else:
        assert str(e.value) == expected


def test_plain_rows_without_an_answer_have_no_ground_truth(tmp_path):
    """Prompts scored without a reference (image prompts scored by CLIP) need no answer column."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question": "a cat"}\n{"question": "two dogs"}\n')
    samples = load_samples([path])
    assert [s.messages[-1]["content"] for s in samples] == ["a cat", "two dogs"]
    assert [s.ground_truth for s in samples] == [None, None]
