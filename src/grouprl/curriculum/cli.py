"""`grouprl curriculum build`: registered on the main parser by `add_parser(subparsers)`."""

from __future__ import annotations

import argparse

from grouprl.curriculum.buckets import RULES
from grouprl.curriculum.join import AUTO
from grouprl.curriculum.logs import LogFields
from grouprl.curriculum.order import ORDERS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the `curriculum` verb (sub-verb `build`) to the main parser's subparsers."""
    curriculum = subparsers.add_parser(
        "curriculum", help="difficulty buckets and orders from earlier runs' logs"
    )
    verbs = curriculum.add_subparsers(dest="curriculum_verb", required=True)
    build = verbs.add_parser(
        "build",
        help="bucket a dataset by the scores earlier runs got on it",
        description="Join trajectory logs to a dataset by uid, bucket each uid by its mean score "
        "(mastered > easy, edge in [hard, easy], unsolvable < hard), order the buckets, and write "
        "mastered/edge/unsolvable.parquet, summary.json, report.md and histogram.png into --out.",
    )
    build.add_argument(
        "--logs", nargs="+", required=True, metavar="LOG", help="log files or globs (JSONL or a JSON array)"
    )
    build.add_argument(
        "--dataset", nargs="+", required=True, metavar="FILE", help="training data (parquet/jsonl/json)"
    )
    build.add_argument("--out", required=True, metavar="DIR", help="output folder (replaced atomically)")
    build.add_argument("--uid-field", default="uid", help="dotted log field holding the uid (default: uid)")
    build.add_argument(
        "--uid-regex", default=None, help="regex with one group cutting the uid out of --uid-field"
    )
    build.add_argument(
        "--score-field", default="reward", help="dotted log field holding the score (default: reward)"
    )
    build.add_argument("--agent-field", default=None, help="dotted log field naming the agent (optional)")
    build.add_argument(
        "--reward-field",
        default="reward",
        help="the training reward, correlated with --score-field when they differ (default: reward; '' = none)",
    )
    build.add_argument("--easy", type=float, default=0.7, help="mastered above this mean (default: 0.7)")
    build.add_argument("--hard", type=float, default=0.1, help="unsolvable below this mean (default: 0.1)")
    build.add_argument(
        "--rule", choices=RULES, default="mean", help="mixed: edge also needs agents that disagree"
    )
    build.add_argument("--order", choices=ORDERS, default="easy-to-hard", help="order inside each bucket")
    build.add_argument(
        "--batch-size", type=int, default=8, help="prompts per step, for 'spread' and the report (8)"
    )
    build.add_argument(
        "--dataset-uid-field", default=AUTO, help="dataset field with the uid, '@loader', or auto"
    )
    build.add_argument("--seed", type=int, default=0, help="seed of the 'random' order")
    build.add_argument(
        "--allow-empty-edge", action="store_true", help="write the output even if edge is empty"
    )
    build.set_defaults(func=cmd_build)


def cmd_build(args: argparse.Namespace) -> int:
    from grouprl.curriculum.build import BuildOptions, build_curriculum

    options = BuildOptions(
        logs=args.logs,
        dataset=args.dataset,
        out=args.out,
        fields=LogFields(
            uid_field=args.uid_field,
            uid_regex=args.uid_regex,
            score_field=args.score_field,
            agent_field=args.agent_field,
            reward_field=args.reward_field or None,
        ),
        dataset_uid_field=args.dataset_uid_field,
        easy=args.easy,
        hard=args.hard,
        rule=args.rule,
        order=args.order,
        batch_size=args.batch_size,
        seed=args.seed,
        allow_empty_edge=args.allow_empty_edge,
    )
    summary = build_curriculum(options)
    buckets = summary["buckets"]
    print(
        f"matched {summary['matched']} uids (log only {summary['log_only']}, dataset only "
        f"{summary['dataset_only']}, duplicate rows {summary['duplicates']}); records without score "
        f"{summary['no_score']}, malformed lines {summary['malformed_lines']}"
    )
    print(
        f"buckets: mastered {buckets['mastered']}, edge {buckets['edge']}, unsolvable {buckets['unsolvable']}"
    )
    for text in summary["warnings"]:
        print(f"warning: {text}")
    print(f"wrote {args.out} (report.md, summary.json, histogram.png, mastered/edge/unsolvable.parquet)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m grouprl.curriculum.cli build ...`: the same command without the main CLI."""
    import sys

    from grouprl.errors import UserError

    parser = argparse.ArgumentParser(prog="grouprl")
    add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(["curriculum", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except UserError as e:
        print(f"grouprl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
