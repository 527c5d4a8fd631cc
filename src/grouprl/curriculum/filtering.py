"""Dynamic filtering: keep the batch size while dropping groups with no learning signal.

A group whose n rewards are all equal has every GRPO advantage r_i - mean(r) = 0, so it adds
generation cost and no gradient. The trainer over-samples prompts and keeps the first
`batch_size` groups that have a spread, generating at most `max_oversample x batch_size`
prompts per step:

    candidates = []
    while (k := prompts_to_draw(rewards_of(candidates), B, max_oversample)) > 0:
        candidates += generate_and_score(sampler.draw(k))
    selection = select_groups(rewards_of(candidates), B)     # indices to train on
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def keep_groups(group_rewards: Sequence[Sequence[float]]) -> list[bool]:
    """True for each group whose rewards are not all equal (a non-zero advantage exists)."""
    return [len(rewards) > 0 and max(rewards) > min(rewards) for rewards in group_rewards]


def prompts_to_draw(group_rewards: Sequence[Sequence[float]], batch_size: int, max_oversample: float) -> int:
    """How many more prompts to generate this step (0: stop and select).

    The first call (no candidates) asks for `batch_size`. Later calls ask for the missing
    informative groups divided by the share of informative groups seen so far (all the rest
    of the budget when none was informative), never beyond the cap
    max(batch_size, floor(batch_size x max_oversample)) prompts in total.
    """
    cap = max(batch_size, math.floor(batch_size * max_oversample))
    drawn = len(group_rewards)
    if drawn == 0:
        return batch_size
    informative = sum(keep_groups(group_rewards))
    missing = batch_size - informative
    if missing <= 0:
        return 0
    wanted = cap - drawn if informative == 0 else math.ceil(missing * drawn / informative)
    return max(0, min(wanted, cap - drawn))


@dataclass
class GroupSelection:
    keep: list[int]  # candidate indices to train on, in draw order
    zero_variance_dropped: int  # all-equal groups left out (the avoided zero-advantage groups)
    zero_variance_kept: int  # all-equal groups kept to fill the batch when too few had a spread
    informative_dropped: int  # groups with a spread drawn beyond the batch (generated, unused)
    extra_prompts: int  # candidates beyond batch_size


def select_groups(group_rewards: Sequence[Sequence[float]], batch_size: int) -> GroupSelection:
    """The first `batch_size` groups with a spread; when there are fewer, the earliest all-equal
    groups fill the batch so its size stays `batch_size` (or every candidate, if fewer)."""
    informative = keep_groups(group_rewards)
    with_spread = [i for i, keep in enumerate(informative) if keep]
    flat = [i for i, keep in enumerate(informative) if not keep]
    chosen = with_spread[:batch_size]
    fill = flat[: max(0, batch_size - len(chosen))]
    return GroupSelection(
        keep=sorted(chosen + fill),
        zero_variance_dropped=len(flat) - len(fill),
        zero_variance_kept=len(fill),
        informative_dropped=len(with_spread) - len(chosen),
        extra_prompts=max(0, len(group_rewards) - batch_size),
    )
