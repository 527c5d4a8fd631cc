"""What `--dry-run` says of a data file from its columns and first rows alone: the layout, what it
holds, and one DataError line naming the file when a column the run needs is absent."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grouprl.data.layout import describe_data_file, peek
from grouprl.errors import DataError


def png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def verl_parquet(path, *, with_truth=True, conversation=False):
    """HF-datasets style: a struct reward_model, images as {bytes, path} dicts."""
    prompt = [{"role": "user", "content": "<image>colour?"}]
    if conversation:
        prompt.append({"role": "assistant", "content": "red"})
    row = {"prompt": prompt, "images": [{"bytes": png(), "path": None}], "extra_info": {"index": 0}}
    if with_truth:
        row["reward_model"] = {"style": "rule", "ground_truth": "red"}
    pq.write_table(pa.Table.from_pylist([row]), path)
    return path


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verl_parquet_for_rl_and_sft(tmp_path):
    path = verl_parquet(tmp_path / "v.parquet")
    assert describe_data_file(path, "rl") == "verl layout: prompt, reward_model.ground_truth, images"
    assert describe_data_file(path, "sft") == (
        "verl layout: prompt, reward_model.ground_truth as the assistant's reply (as it is), images"
    )
    assert describe_data_file(path, "sft", "<answer>{ground_truth}</answer>").endswith(
        "as the assistant's reply (as '<answer>{ground_truth}</answer>'), images"
    )
    conversation = verl_parquet(tmp_path / "c.parquet", with_truth=False, conversation=True)
    assert describe_data_file(conversation, "sft") == (
        "verl layout: conversations in 'prompt' (its assistant turns are learned), images"
    )


def test_parquet_is_read_by_its_schema_and_text_columns_only(tmp_path, monkeypatch):
    path = verl_parquet(tmp_path / "v.parquet")
    read = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        read.append(kwargs.get("columns"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    columns, rows, truth = peek(path)
    assert columns == ["prompt", "images", "extra_info", "reward_model"] and truth
    assert read == [["prompt", "reward_model"]] and len(rows) == 1  # never the image bytes


def test_missing_ground_truth_is_said_for_rl_and_an_error_for_sft(tmp_path):
    path = verl_parquet(tmp_path / "v.parquet", with_truth=False)
    assert describe_data_file(path, "rl") == (
        "verl layout: prompt, no reward_model.ground_truth (fine only for rewards that need no reference), images"
    )
    with pytest.raises(DataError) as e:
        describe_data_file(path, "sft")
    assert str(e.value) == (
        f"{path}: verl layout without reward_model.ground_truth (no prompt of its first rows ends with an "
        "assistant turn): nothing to learn as the assistant's reply"
    )
    plain = jsonl(tmp_path / "q.jsonl", [{"question": "2+2?"}])
    assert describe_data_file(plain, "rl").startswith("plain layout: question, no answer")
    with pytest.raises(DataError, match="plain layout without answer: nothing to learn"):
        describe_data_file(plain, "sft")


def test_only_the_first_jsonl_lines_are_read(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(8)]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")  # the loader would refuse it
    assert describe_data_file(path, "sft") == "plain layout: question, answer as the assistant's reply (as it is)"
    assert describe_data_file(jsonl(tmp_path / "m.jsonl", [{"messages": []}]), "sft") == "conversations (messages)"


@pytest.mark.parametrize(
    "rows, purpose, message",
    [
        ([{"prompt_text": "hi"}], "rl", "has columns prompt_text; expected the verl layout (prompt, optional"),
        ([{"prompt_text": "hi"}], "sft", "has columns prompt_text; expected conversations (messages), or the verl"),
        ([{"messages": []}], "rl", "holds conversations (messages), the format of grouprl sft; RL data needs"),
        ([], "rl", "is empty"),
    ],
)
def test_unusable_files_are_one_line(tmp_path, rows, purpose, message):
    path = jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as e:
        describe_data_file(path, purpose)
    assert str(e.value).startswith(f"{path} " if "empty" not in message else "dataset ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_an_empty_parquet_file_is_empty(tmp_path):
    path = tmp_path / "e.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match=f"dataset {path} is empty"):
        describe_data_file(path)
