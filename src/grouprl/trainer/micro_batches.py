"""Cutting a mini-batch into micro-batches that respect GRPO groups and a memory budget.

A micro-batch is what one forward/backward holds. Two limits exist:
- a row count (`actor.micro_batch_size`), the classic fixed micro-batch;
- a token budget (`actor.micro_batch_tokens`, verl's dynamic batch size): the padded tokens a
  forward sees, so a step with short responses packs many rows and one with long responses
  few, at about constant memory.

With the shared prefix the unit of work is a *prefix unit*: a set of prompts run once, whose
rows go through one or more micro-batches. Whole groups that fit together share one
micro-batch; a group too large for one micro-batch is split into several that all reuse its
single prefix pass (forward and backward, see `logprobs.Prefix`), instead of recomputing the
prompt per micro-batch. Rows are sorted by response length inside a group, and groups by
their longest response, so micro-batches hold rows of similar length and little padding.
The loss does not depend on any of this: micro-batch weights make the accumulated gradient
equal the mini-batch's (update.micro_batch_weight).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixUnit:
    """Prompts computed once, and the micro-batches of rows that continue them."""

    prompts: list[list[int]]  # distinct prompts of the unit
    micro_batches: list[list[int]]  # row indices; each list is one forward/backward
    prompt_of_row: dict[int, int]  # row -> index into `prompts`

    @property
    def rows(self) -> list[int]:
        return [r for micro in self.micro_batches for r in micro]


def _padded_tokens(rows: list[int], response_lengths: list[int]) -> int:
    """Response tokens a micro-batch's forward sees: rows x its longest response."""
    return len(rows) * max((response_lengths[r] for r in rows), default=0)


def plan_micro_batches(
    rows: list[int],
    prompt_ids: list[list[int]],
    response_lengths: list[int],
    *,
    max_rows: int,
    max_tokens: int = 0,
    shared_prefix: bool = True,
    keys: list | None = None,
) -> list[PrefixUnit]:
    """Cut `rows` (indices into prompt_ids / response_lengths) into prefix units.

    keys: per row, what makes two prompts the same prompt (default: their token ids; a VLM's
    rows add their images, since equal ids with other images are another prompt).

    max_tokens = 0: at most `max_rows` rows per micro-batch. max_tokens > 0: at most that many
    padded tokens per micro-batch (distinct prompts + rows x longest response; without the
    shared prefix, rows x longest prompt+response), and `max_rows` is ignored; a single row
    over the budget still gets a micro-batch of its own.
    """
    if not rows:
        return []
    key = (lambda r: keys[r]) if keys is not None else (lambda r: tuple(prompt_ids[r]))
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    # longest responses first, inside each group and across groups: neighbours have similar widths
    ordered = [sorted(g, key=lambda r: (-response_lengths[r], r)) for g in groups.values()]
    ordered.sort(key=lambda g: (-response_lengths[g[0]], g[0]))

    if not shared_prefix:
        flat = [r for g in ordered for r in g]
        width = [len(prompt_ids[r]) + response_lengths[r] for r in range(len(prompt_ids))]
        return [
            _unit([micro], prompt_ids, key)
            for micro in _pack(flat, lambda rs: len(rs) * max(width[r] for r in rs), max_rows, max_tokens)
        ]

    def cost(rs: list[int]) -> int:  # distinct prompts (padded to the longest) + padded responses
        prompts = {key(r): len(prompt_ids[r]) for r in rs}
        return len(prompts) * max(prompts.values()) + _padded_tokens(rs, response_lengths)

    units: list[PrefixUnit] = []
    current: list[int] = []  # whole groups sharing one micro-batch
    for group in ordered:
        if _fits(current + group, cost, max_rows, max_tokens):
            current += group
            continue
        if current:
            units.append(_unit([current], prompt_ids, key))
            current = []
        if _fits(group, cost, max_rows, max_tokens):
            current = list(group)
        else:  # one prefix pass, its rows over several micro-batches
            prompt_tokens = len(prompt_ids[group[0]])
            budget = max(max_tokens - prompt_tokens, 1) if max_tokens else 0
            micro = _pack(group, lambda rs: _padded_tokens(rs, response_lengths), max_rows, budget)
            units.append(_unit(micro, prompt_ids, key))
    if current:
        units.append(_unit([current], prompt_ids, key))
    return units


def _fits(rows: list[int], cost, max_rows: int, max_tokens: int) -> bool:
    return cost(rows) <= max_tokens if max_tokens else len(rows) <= max_rows


def _pack(rows: list[int], cost, max_rows: int, max_tokens: int) -> list[list[int]]:
    """Greedy in order: start a new micro-batch when the next row would break the limit."""
    out: list[list[int]] = []
    for r in rows:
        if out and _fits(out[-1] + [r], cost, max_rows, max_tokens):
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _unit(micro_batches: list[list[int]], prompt_ids: list[list[int]], key) -> PrefixUnit:
    index: dict = {}
    first: list[int] = []  # a row of each distinct prompt
    prompt_of_row = {}
    for m in micro_batches:
        for r in m:
            k = key(r)
            if k not in index:
                index[k] = len(index)
                first.append(r)
            prompt_of_row[r] = index[k]
    return PrefixUnit([list(prompt_ids[r]) for r in first], micro_batches, prompt_of_row)
