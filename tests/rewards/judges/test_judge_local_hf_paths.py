"""The local judge's `model` as a path: one that does not exist is named as such (transformers
would call it a malformed repo id), and "~" is expanded."""

import pytest

from grouprl.errors import ModelLoadError
from grouprl.rewards.judges.local_hf import LocalHFBackend
from helpers import tiny_model_and_tokenizer


@pytest.mark.parametrize("model", ["runs/judge/model", "./judge", "~/no-judge-here"])
def test_a_missing_local_judge_model_is_named_as_such(judge_config, tmp_path, monkeypatch, model):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelLoadError) as info:
        LocalHFBackend(judge_config(None, backend="local", model=model, device="cpu"))
    where = "" if model.startswith("~") else f" in {tmp_path}"
    assert str(info.value) == (
        f"cannot load local judge model {model!r}: it does not exist (not a local folder{where}, and not a hub id)"
    )


def test_a_judge_model_under_home_loads(judge_config, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    tiny_model_and_tokenizer(tmp_path / "judge")
    backend = LocalHFBackend(judge_config(None, backend="local", model="~/judge", device="cpu"))
    assert backend.model_name == "~/judge"
