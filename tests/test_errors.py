"""Telling a local model folder that does not exist from a hub id (`missing_local_path`)."""

import os

import pytest

from grouprl.errors import missing_local_path


@pytest.mark.parametrize(
    "source", ["/models/x", "./x", "../x", "~/x", "runs/sft/model", "a/b/c", "my model", "x\\y", "-x", "a..b", "a/.x"]
)
def test_a_path_no_hub_id_can_be_is_a_missing_local_folder(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reason = missing_local_path(source)
    where = "" if os.path.isabs(os.path.expanduser(source)) else f" in {tmp_path}"
    assert reason == f"not a local folder{where}, and not a hub id"


@pytest.mark.parametrize(
    "source", ["gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "owner/name_1.v2", ""]
)
def test_a_hub_id_or_an_existing_folder_is_not_missing(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert missing_local_path(source) is None
    (tmp_path / "runs" / "sft" / "model").mkdir(parents=True)
    assert missing_local_path("runs/sft/model") is None
    assert missing_local_path(str(tmp_path / "runs")) is None
