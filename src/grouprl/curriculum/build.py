"""`grouprl curriculum build`: logs + dataset -> a curriculum folder.

    DIR/mastered.parquet, edge.parquet, unsolvable.parquet   the dataset's rows and schema, in
        curriculum order, each with extra_info.curriculum = {score, std, n, bucket, rank}
    DIR/summary.json    counts, thresholds, rule, order, inputs, warnings
    DIR/report.md       the join, the buckets, and what a reviewer should check
    DIR/histogram.png   mean score per uid with the two thresholds
    DIR/excluded.txt    dataset rows left out: no log record, a repeated uid, or no uid

Everything that can be checked before reading is checked first; the folder is written all at
once (see `output.atomic_folder`).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from grouprl.curriculum.buckets import BUCKETS, assign_buckets, check_thresholds
from grouprl.curriculum.build_state import Build, BuildOptions
from grouprl.curriculum.fields import UidExtractor, field_getter
from grouprl.curriculum.histogram import draw_histogram
from grouprl.curriculum.join import Join, join, read_dataset
from grouprl.curriculum.logs import LogScores, read_logs
from grouprl.curriculum.order import ORDERS, curriculum_order
from grouprl.curriculum.output import atomic_folder, check_target, with_curriculum
from grouprl.curriculum.report import findings, render_report
from grouprl.curriculum.stats import pearson, uid_stats
from grouprl.errors import ConfigError, DataError

log = logging.getLogger(__name__)


def build_curriculum(options: BuildOptions) -> dict:
    """Build the folder `options.out`; return the summary (also written to summary.json)."""
    check_options(options)
    logs = read_logs(options.logs, options.fields)
    if logs.records == 0:
        raise DataError(f"the logs ({', '.join(logs.files)}) hold no records")
    if not logs.uids:
        raise DataError(
            f"no log record has both a uid ('{options.fields.uid_field}') and a finite score "
            f"('{options.fields.score_field}'): {logs.no_uid} without uid, {logs.no_score} without score"
        )
    stats = uid_stats(logs.uids, logs.codes, logs.scores, easy=options.easy, hard=options.hard)
    table = read_dataset(options.dataset)
    joined = join(table, options.dataset, stats.uids, options.dataset_uid_field)
    if len(joined.matched_rows) == 0:
        sample_row = next((uid for _, uid in joined.dataset_only[:1]), None)
        raise DataError(
            f"no log uid matches a dataset uid (dataset field '{joined.uid_field}'): log uids look like "
            f"{stats.uids[0]!r}, dataset uids like {sample_row!r}; check --uid-field/--uid-regex/--dataset-uid-field"
        )
    matched = stats.take(joined.matched_stats)
    bucket_of = assign_buckets(
        matched.mean, matched.zero_spread, easy=options.easy, hard=options.hard, rule=options.rule
    )
    ordered = {}
    for code, bucket in enumerate(BUCKETS):
        members = np.flatnonzero(bucket_of == code)
        order = curriculum_order(
            [matched.uids[i] for i in members],
            matched.mean[members],
            options.order,
            batch_size=options.batch_size,
            seed=options.seed,
        )
        ordered[bucket] = members[order]
    if len(ordered["edge"]) == 0 and not options.allow_empty_edge:
        raise DataError(
            f"the edge bucket is empty ({len(matched)} matched uids, none with {options.hard:g} <= mean <= "
            f"{options.easy:g}{' and a non-zero spread' if options.rule == 'mixed' else ''}); "
            "adjust --easy/--hard or pass --allow-empty-edge"
        )
    build = Build(
        options=options,
        logs=logs,
        join=joined,
        matched=matched,
        bucket_of=bucket_of,
        ordered=ordered,
        correlation=pearson(logs.scores, logs.rewards),
        dataset_rows=table.num_rows,
        typical_n=Counter(matched.n.tolist()).most_common(1)[0][0],
        agent_repeats=_agent_repeats(logs),
    )
    summary = make_summary(build)
    with atomic_folder(Path(options.out)) as folder:
        for bucket, positions in ordered.items():
            rows = joined.matched_rows[positions]
            part = with_curriculum(
                table.take(rows),
                score=matched.mean[positions],
                std=matched.std[positions],
                n=matched.n[positions],
                bucket=bucket,
            )
            pq.write_table(part, folder / f"{bucket}.parquet")
        (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (folder / "report.md").write_text(render_report(build, summary))
        (folder / "excluded.txt").write_text(_excluded(joined))
        draw_histogram(
            matched.mean,
            easy=options.easy,
            hard=options.hard,
            path=folder / "histogram.png",
            title=f"{len(matched)} matched uids, score '{options.fields.score_field}'",
        )
    return summary


def check_options(options: BuildOptions) -> None:
    """Every mistake that needs no file read, so it fails before any work."""
    check_thresholds(options.easy, options.hard, options.rule)
    if options.order not in ORDERS:
        raise ConfigError(f"--order must be one of {', '.join(ORDERS)}, got {options.order!r}")
    if options.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {options.batch_size}")
    spec = options.fields
    UidExtractor(spec.uid_field, spec.uid_regex)  # field path and regex
    for name in (spec.score_field, spec.agent_field, spec.reward_field):
        if name:
            field_getter(name)
    check_target(Path(options.out))


def make_summary(build: Build) -> dict:
    o, j, logs = build.options, build.join, build.logs
    return {
        "matched": len(j.matched_rows),
        "log_only": len(j.log_only),
        "dataset_only": len(j.dataset_only),
        "duplicates": len(j.duplicates),
        "no_score": logs.no_score,
        "malformed_lines": logs.malformed,
        "buckets": {bucket: len(positions) for bucket, positions in build.ordered.items()},
        "thresholds": {"easy": o.easy, "hard": o.hard},
        "rule": o.rule,
        "order": o.order,
        "inputs": {
            "logs": logs.files,
            "dataset": list(o.dataset),
            "uid_field": o.fields.uid_field,
            "uid_regex": o.fields.uid_regex,
            "score_field": o.fields.score_field,
            "agent_field": o.fields.agent_field,
            "reward_field": o.fields.reward_field,
            "dataset_uid_field": j.uid_field,
            "batch_size": o.batch_size,
            "seed": o.seed,
        },
        "records": logs.records,
        "scored_records": len(logs.scores),
        "no_uid": logs.no_uid,
        "unscored_uids": logs.unscored_uids,
        "log_uids": len(logs.uids),
        "dataset_rows": build.dataset_rows,
        "dataset_rows_without_uid": len(j.no_uid_rows),
        "typical_n": build.typical_n,
        "score_reward_correlation": build.correlation,
        "edge_zero_spread": int(build.matched.zero_spread[build.ordered["edge"]].sum()),
        "warnings": findings(build),
    }


def _agent_repeats(logs: LogScores) -> int | None:
    if logs.agents is None:
        return None
    with_agent = logs.agents >= 0
    pairs = np.sort(logs.codes[with_agent] * (int(logs.agents.max(initial=0)) + 1) + logs.agents[with_agent])
    return int((pairs[1:] == pairs[:-1]).sum())


def _excluded(joined: Join) -> str:
    lines = ["# row\tuid\treason"]
    lines += [f"{row}\t{uid}\tno scored log record" for row, uid in joined.dataset_only]
    lines += [f"{row}\t{uid}\trepeats the uid of an earlier row" for row, uid in joined.duplicates]
    lines += [f"{row}\t\tno uid in field {joined.uid_field}" for row in joined.no_uid_rows]
    return "\n".join(lines) + "\n"
