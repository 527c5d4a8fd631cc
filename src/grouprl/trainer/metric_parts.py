"""A step's metrics are put together from parts, each key written by exactly one of them
(the collector's scoring tallies, the batch's reward summary, the sampler's figures, the
update's, the peaks, the step's times). `merge` joins parts and refuses a key two parts write,
so no figure silently replaces another."""

from __future__ import annotations

from collections.abc import Mapping


class MetricClash(RuntimeError):
    """Two parts of a step's metrics wrote the same key."""


def merge(*parts: Mapping[str, float]) -> dict[str, float]:
    """The parts as one dict; a key in two parts raises MetricClash naming it."""
    out: dict[str, float] = {}
    for part in parts:
        clash = out.keys() & part.keys()
        if clash:
            raise MetricClash(f"metric written twice in one step: {', '.join(sorted(clash))}")
        out.update(part)
    return out
