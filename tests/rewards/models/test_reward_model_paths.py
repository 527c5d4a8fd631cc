"""What a reward model needs that can be checked before its worker starts: a local path that
exists (transformers would call a missing one a malformed repo id) and, for text_to_image,
diffusers (the `image` extra)."""

import sys

import pytest

from grouprl.config import RewardComponentConfig, RewardConfig, RewardModelConfig
from grouprl.errors import ModelLoadError, UserError
from grouprl.rewards import CompositeReward
from grouprl.rewards.models.kinds import TextToImage, _source


def classifier(path: str) -> RewardConfig:
    return RewardConfig(
        models=[RewardModelConfig(name="rm", kind="sequence_classifier", path=path)],
        components=[RewardComponentConfig(name="preference", function="model:rm")],
    )


@pytest.mark.parametrize("relative", [False, True])
def test_a_missing_local_path_is_named_as_such(tmp_path, monkeypatch, relative):
    monkeypatch.chdir(tmp_path)
    path, where = ("runs/rm/model", f" in {tmp_path}") if relative else (f"{tmp_path}/gone", "")
    with pytest.raises(UserError) as info:
        CompositeReward.from_config(classifier(path))
    assert str(info.value) == (
        f"reward models (rm) failed to load: ModelLoadError: reward model 'rm': path '{path}' does not exist "
        f"(not a local folder{where}, and not a hub id)"
    )


def test_a_path_under_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "rm").mkdir()
    assert _source(RewardModelConfig(name="rm", kind="clip", path="~/rm")) == str(tmp_path / "rm")


def test_text_to_image_without_diffusers_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # as where diffusers is not installed
    draw = RewardModelConfig(name="draw", kind="text_to_image", path=str(tmp_path))
    cfg = RewardConfig(
        models=[draw, RewardModelConfig(name="look", kind="scene_scorer", images_from="draw")],
        components=[RewardComponentConfig(name="looks", function="model:look")],
    )
    line = "reward model 'draw' (text_to_image) needs diffusers: pip install 'grouprl[image]'"
    with pytest.raises(UserError) as info:
        CompositeReward.from_config(cfg)
    assert str(info.value) == f"reward models (draw, look) failed to load: ModelLoadError: {line}"
    with pytest.raises(ModelLoadError) as info:  # the worker's own loader says the same
        TextToImage(draw)
    assert str(info.value) == line
