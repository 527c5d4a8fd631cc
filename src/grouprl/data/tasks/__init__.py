"""Built-in tasks generated offline (no downloads), by name: `TASKS[name](n, seed, split, ...)`."""

from __future__ import annotations

from collections.abc import Callable

from grouprl.data.sample import Sample
from grouprl.data.tasks.arithmetic import make_arithmetic
from grouprl.data.tasks.scenes import make_scenes
from grouprl.data.tasks.shapes import make_shapes
from grouprl.data.tasks.slides import make_slides
from grouprl.errors import ConfigError

TASKS: dict[str, Callable[..., list[Sample]]] = {
    "arithmetic": make_arithmetic,
    "scenes": make_scenes,
    "shapes": make_shapes,
    "slides": make_slides,
}


def make_task(name: str, n: int, seed: int, split: str = "train", **options) -> list[Sample]:
    """`TASKS[name](n, seed, split, **options)`, with a one-line error for an unknown name."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}: built-in tasks are {', '.join(sorted(TASKS))}")
    return TASKS[name](n, seed, split, **options)
