"""Folders written whole and renamed into place take a mkdir's mode (0777 less the umask), not
mkdtemp's owner-only 0700: an exported model is readable by a serving process of another user."""

import os
import stat

import pytest

from grouprl.files import temp_folder, umask
from helpers import tiny_model_and_tokenizer


@pytest.fixture
def mask():
    def set_mask(value):
        os.umask(value)

    old = os.umask(0o022)
    yield set_mask
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("value, expected", [(0o022, 0o755), (0o027, 0o750), (0o077, 0o700), (0o002, 0o775)])
def test_a_temp_folder_has_a_mkdirs_mode(tmp_path, mask, value, expected):
    mask(value)
    assert umask() == value  # read, and left as it was
    assert mode(temp_folder(".x.tmp-", tmp_path)) == expected
    assert umask() == value


def test_an_exported_model_and_a_curriculum_follow_the_umask(tmp_path, mask):
    from grouprl.curriculum.output import atomic_folder
    from grouprl.trainer.export import export_model

    mask(0o022)
    model, tokenizer = tiny_model_and_tokenizer()
    final = export_model(model, tokenizer, tmp_path / "run" / "final", merge_lora=False)
    assert mode(final) == 0o755 and all(mode(f) == 0o644 for f in final.iterdir())
    with atomic_folder(tmp_path / "curriculum") as folder:
        (folder / "a.txt").write_text("x")
    assert mode(tmp_path / "curriculum") == 0o755
