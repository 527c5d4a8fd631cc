"""`grouprl train --dry-run` reads each data file's columns (never a model): one `data:` line per
file naming its layout and what it holds, and one error line when a needed column is absent."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

import grouprl.trainer.setup as run_setup
from grouprl.cli import main


def forbid_models(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for name in ("load_causal_lm", "load_tokenizer", "resolve_model_path"):
        monkeypatch.setattr(run_setup, name, forbidden)


def test_dry_run_says_each_files_layout(tmp_path, capsys, monkeypatch):
    forbid_models(monkeypatch)
    verl = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "prompt": [{"role": "user", "content": "<image>colour?"}],
        "images": [{"bytes": b"\x89PNG", "path": None}],
        "reward_model": {"style": "rule", "ground_truth": "red"},
    }]), verl)
    plain = tmp_path / "q.jsonl"
    plain.write_text(json.dumps({"id": "q", "question": "Describe the picture."}) + "\n")
    assert main(["train", "--dry-run", f"data.train_files=[{verl}]", f"data.val_files=[{plain}]"]) == 0
    out = capsys.readouterr().out
    assert f"  data: {verl}: verl layout: prompt, reward_model.ground_truth, images\n" in out
    assert (
        f"  data: {plain}: plain layout: question, no answer (fine only for rewards that need no reference)\n"
    ) in out


def test_dry_run_refuses_a_file_without_the_needed_columns(tmp_path, capsys, monkeypatch):
    forbid_models(monkeypatch)
    conversations = tmp_path / "sft.jsonl"
    conversations.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["train", "--dry-run", f"data.train_files=[{conversations}]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grouprl: error: {conversations} holds conversations (messages), the format of grouprl sft")
    assert err.count("\n") == 1
