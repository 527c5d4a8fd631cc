"""report.md: the join, the buckets, and the findings a careful reviewer would ask about,
each computed from the data (zero-advantage groups early in the order, unmatched samples, a
proxy score, agent counts, bad log lines)."""

from __future__ import annotations

import math

import numpy as np

from grouprl.curriculum.buckets import BUCKETS
from grouprl.curriculum.build_state import Build
from grouprl.curriculum.order import ORDERS

FIRST_BATCHES = 10  # batches of the edge order looked at for zero-advantage prompts
LISTED = 200  # excluded dataset rows listed in the report (all are in excluded.txt)

ORDER_TEXT = {
    "easy-to-hard": "mean score descending (easiest first), ties by uid",
    "hard-to-easy": "mean score ascending (hardest first), ties by uid",
    "spread": "sorted easiest first, cut into B strata, then one prompt of each stratum in turn, "
    "so every batch of B spans the difficulty range",
    "random": "a seeded permutation of the uid-sorted prompts",
}
assert set(ORDER_TEXT) == set(ORDERS)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def edge_batches(build: Build) -> tuple[int, int, int, int]:
    """(batches looked at, their slots, zero-spread prompts in them, batches made only of those)."""
    flat = build.matched.zero_spread[build.ordered["edge"]]
    b = build.options.batch_size
    batches = min(FIRST_BATCHES, math.ceil(len(flat) / b))
    head = flat[: batches * b]
    all_flat = sum(bool(head[i : i + b].all()) for i in range(0, len(head), b))
    return batches, len(head), int(head.sum()), all_flat


def findings(build: Build) -> list[str]:
    o, j, logs, m = build.options, build.join, build.logs, build.matched
    out: list[str] = []
    edge = build.ordered["edge"]
    flat = int(m.zero_spread[edge].sum())
    if flat:
        batches, slots, in_head, all_flat = edge_batches(build)
        out.append(
            f"{flat} of {len(edge)} edge prompts ({_pct(flat, len(edge))}) had every agent score alike: if that "
            f"repeats, their groups get zero GRPO advantage and teach nothing. Under order '{o.order}' they take "
            f"{in_head} of the {slots} slots of the first {batches} batch(es) of {o.batch_size}, and {all_flat} of "
            "those batches hold nothing else. --rule mixed moves them out of edge."
        )
    if not len(edge):
        out.append("the edge bucket is empty: there is nothing to train on in edge.parquet.")
    dataset_uids = len(j.matched_rows) + len(j.dataset_only)
    if j.dataset_only:
        out.append(
            f"{len(j.dataset_only)} of {dataset_uids} dataset samples ({_pct(len(j.dataset_only), dataset_uids)}) "
            "have no scored log record and are excluded (listed below and in excluded.txt); the curriculum "
            "says nothing about their difficulty."
        )
    if j.log_only:
        out.append(
            f"{len(j.log_only)} of {len(logs.uids)} log uids ({_pct(len(j.log_only), len(logs.uids))}) are not in "
            f"the dataset (dataset uid field '{j.uid_field}'): a different data version, or a wrong uid field/regex."
        )
    if o.fields.score_field != o.fields.reward_field:
        text = (
            f"buckets are cut on '{o.fields.score_field}', not on the training reward"
            f"{f' ({o.fields.reward_field!r})' if o.fields.reward_field else ''}: the difficulty is a proxy"
        )
        if build.correlation is not None:
            both = int((np.isfinite(logs.scores) & np.isfinite(logs.rewards)).sum())
            text += f"; their Pearson correlation over {both} records is {build.correlation:.3f}"
        elif o.fields.reward_field:
            text += f"; the logs carry no usable '{o.fields.reward_field}' to compare it with"
        out.append(text + ".")
    off = m.n != build.typical_n
    if off.any():
        examples = ", ".join(f"{m.uids[i]} (n={m.n[i]})" for i in np.flatnonzero(off)[:5])
        out.append(
            f"{int(off.sum())} of {len(m)} matched uids have a number of scored records other than the typical "
            f"{build.typical_n} (min {m.n.min()}, max {m.n.max()}), e.g. {examples}: their means are less or more "
            "certain than the rest."
        )
    if build.agent_repeats:
        out.append(
            f"{build.agent_repeats} records repeat a (uid, '{o.fields.agent_field}') pair: several runs or epochs "
            "of the same prompt are pooled into one mean."
        )
    if j.duplicates:
        out.append(f"{len(j.duplicates)} dataset rows repeat an earlier row's uid; only the first is kept.")
    if j.no_uid_rows:
        out.append(f"{len(j.no_uid_rows)} dataset rows have no value in '{j.uid_field}' and are excluded.")
    if logs.no_score:
        out.append(f"{logs.no_score} log records have no finite '{o.fields.score_field}' and were skipped.")
    if logs.no_uid:
        out.append(f"{logs.no_uid} log records yield no uid from '{o.fields.uid_field}' and were skipped.")
    if logs.malformed:
        out.append(f"{logs.malformed} log lines are not JSON objects and were skipped (listed below).")
    return out


def render_report(build: Build, summary: dict) -> str:
    o, j, logs, m = build.options, build.join, build.logs, build.matched
    lines = [
        "# Curriculum build",
        "",
        f"- logs: {', '.join(logs.files)} ({logs.records} records, {len(logs.scores)} scored, {len(logs.uids)} uids)",
        f"- uid: '{o.fields.uid_field}'"
        + (f" with regex `{o.fields.uid_regex}`" if o.fields.uid_regex else ""),
        f"- score: '{o.fields.score_field}'; dataset: {', '.join(o.dataset)} ({build.dataset_rows} rows, "
        f"uid field '{j.uid_field}')",
        f"- buckets: mastered mean > {o.easy:g}, edge {o.hard:g} <= mean <= {o.easy:g}, unsolvable mean < {o.hard:g}; "
        f"rule '{o.rule}'" + (" (edge also needs a non-zero spread)" if o.rule == "mixed" else ""),
        f"- order: {o.order}: {ORDER_TEXT[o.order]} (batch size {o.batch_size}, seed {o.seed})",
        "",
        "## Join",
        "",
        "| matched | log only | dataset only | duplicate rows | records without score | malformed lines |",
        "|---|---|---|---|---|---|",
        f"| {summary['matched']} | {summary['log_only']} | {summary['dataset_only']} | {summary['duplicates']} "
        f"| {summary['no_score']} | {summary['malformed_lines']} |",
        "",
        "## Buckets",
        "",
        "| bucket | prompts | share | mean score (min..max) | mean pass rate | all agents alike |",
        "|---|---|---|---|---|---|",
    ]
    for bucket in BUCKETS:
        p = build.ordered[bucket]
        if len(p):
            scores = f"{m.mean[p].mean():.3f} ({m.mean[p].min():.3f}..{m.mean[p].max():.3f})"
            rate, flat = f"{m.pass_rate[p].mean():.3f}", str(int(m.zero_spread[p].sum()))
        else:
            scores, rate, flat = "-", "-", "0"
        lines.append(f"| {bucket} | {len(p)} | {_pct(len(p), len(m))} | {scores} | {rate} | {flat} |")
    lines += ["", "pass rate = share of a uid's records scoring >= easy; all agents alike = max == min.", ""]
    lines += ["## Findings", ""]
    lines += [f"- {text}" for text in summary["warnings"]] or ["- none"]
    lines += ["", "## Edge order (first 20)", "", "| rank | uid | mean | std | n |", "|---|---|---|---|---|"]
    for rank, i in enumerate(build.ordered["edge"][:20]):
        lines.append(f"| {rank} | {m.uids[i]} | {m.mean[i]:.4f} | {m.std[i]:.4f} | {m.n[i]} |")
    if logs.malformed_lines:
        lines += ["", f"## Malformed log lines (first {len(logs.malformed_lines)} of {logs.malformed})", ""]
        lines += [f"- `{text}`" for text in logs.malformed_lines]
    excluded = [(row, uid, "no scored log record") for row, uid in j.dataset_only]
    excluded += [(row, uid, "repeated uid") for row, uid in j.duplicates]
    if excluded:
        lines += ["", f"## Excluded dataset rows ({len(excluded)}; all in excluded.txt)", ""]
        lines += [f"- row {row}: `{uid}` ({why})" for row, uid, why in excluded[:LISTED]]
        if len(excluded) > LISTED:
            lines.append(f"- ... {len(excluded) - LISTED} more")
    return "\n".join(lines) + "\n"
