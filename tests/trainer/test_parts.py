"""A run's parts grouped by stage (trainer/parts.py): each stage reads every part it is given
(none handed over unused) and the groups are frozen records."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import grouprl.trainer.parts as parts_module
from grouprl.trainer.parts import Ahead, CollectParts, EvalParts, LearnParts, Parts

TRAINER = Path(parts_module.__file__).parent

# each group, the module of the stage it is given to, and the names that stage holds it by
READERS = [
    (CollectParts, "step.py", {"p", "self.p", "parts"}),
    (LearnParts, "learner.py", {"p", "self.p", "parts"}),
    (EvalParts, "evaluation.py", {"p", "self.p", "parts"}),
    (Ahead, "pipeline.py", {"ahead"}),
]


def read_through(source: str, holders: set[str]) -> set[str]:
    """The attributes read on any of `holders` (`p.engine`, `self.p.reward`, `ahead.runner`)."""
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in holders
    }


def test_the_check_sees_what_a_stage_reads():
    source = "x = self.p.engine\ny = p.reward + other.sampler\nz = parts.ranks\n"
    assert read_through(source, {"p", "self.p", "parts"}) == {"engine", "reward", "ranks"}


@pytest.mark.parametrize("group, module, holders", READERS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_each_stage_reads_every_part_it_is_given(group, module, holders):
    read = read_through((TRAINER / module).read_text(), holders)
    given = {f.name for f in dataclasses.fields(group)}
    assert given <= read, f"{group.__name__} gives {module} what it never reads: {sorted(given - read)}"


@pytest.mark.parametrize("group", [CollectParts, LearnParts, EvalParts, Ahead, Parts])
def test_the_groups_are_frozen(group):
    assert group.__dataclass_params__.frozen
    record = group(**{f.name: None for f in dataclasses.fields(group)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.ranks = None
