"""`grouprl judge score`: judge an existing rollouts.jsonl (see score_log.py).

    grouprl judge score --config judge.yaml --input rollouts.jsonl --out scored.jsonl
    grouprl judge score --input rollouts.jsonl --out scored.jsonl \\
        --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen2.5-7B-Instruct [--api-key-env VAR]

--config is a grouprl config (its reward.judges), a file with a `judges:` list, or one judge's
settings as a mapping; --judge picks one when there are several. Flags override the file, so
without --config a judge is fully described by flags. Registered by `add_parser(subparsers)`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

from grouprl.config import JudgeConfig, _coerce, load_config
from grouprl.errors import ConfigError


def add_parser(subparsers: Any) -> None:
    judge = subparsers.add_parser("judge", help="LLM/VLM judges: score a rollout log")
    verbs = judge.add_subparsers(dest="judge_verb", required=True)
    score = verbs.add_parser(
        "score",
        help="score (or re-score) a rollouts.jsonl with a judge; resumable",
        description="Judge every record of --input not yet in --out; flags override --config.",
    )
    score.add_argument("--config", help="YAML: a grouprl config, a `judges:` list, or one judge's settings")
    score.add_argument("--input", required=True, help="rollouts.jsonl to score")
    score.add_argument("--out", required=True, help="output jsonl (appended; re-running resumes)")
    score.add_argument("--judge", help="name of the judge to use when the config defines several")
    score.add_argument("--backend", choices=["openai", "gemini", "local"], help="judge backend")
    score.add_argument("--base-url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    score.add_argument("--model", help="judge model name (local backend: folder or hub id)")
    score.add_argument("--api-key-env", help="name of the environment variable holding the API key")
    score.add_argument("--max-concurrent", type=int, help="requests in flight at once")
    score.add_argument("--max-retries", type=int, help="retries after a failed attempt")
    score.add_argument("--prompt-template", help="prompt template file, or builtin:<name>")
    score.add_argument("--cache", help="SQLite cache file ('' = no cache)")
    score.add_argument("--log", help="also write judge.jsonl (every call) here")
    score.add_argument(
        "--skip-failed", action="store_true", help="do not re-judge records that failed before"
    )
    score.add_argument("--no-progress", action="store_true", help="no progress bar")
    score.set_defaults(func=cmd_judge_score)


def _judges_in(path: str) -> list[JudgeConfig]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"judge config not found: {p}")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"malformed YAML in {p}: {getattr(e, 'problem', e)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"judge config {p} must be a mapping")
    if "reward" in tree:
        return list(load_config(p).reward.judges)
    if "judges" in tree:
        return _coerce(tree["judges"], list[JudgeConfig], "judges")
    return [_coerce(tree, JudgeConfig, "judge")]


def judge_config_from_args(args: argparse.Namespace) -> JudgeConfig:
    judges = _judges_in(args.config) if args.config else [JudgeConfig()]
    if args.judge:
        chosen = [j for j in judges if j.name == args.judge]
        if not chosen:
            raise ConfigError(
                f"no judge named {args.judge!r} in {args.config}; defined: {', '.join(j.name for j in judges)}"
            )
        cfg = chosen[0]
    elif len(judges) == 1:
        cfg = judges[0]
    else:
        names = ", ".join(j.name for j in judges) or "none"
        raise ConfigError(f"{args.config} defines {len(judges)} judges ({names}); pick one with --judge")
    overrides = {
        "backend": args.backend,
        "base_url": args.base_url,
        "model": args.model,
        "api_key_env": args.api_key_env,
        "max_concurrent_requests": args.max_concurrent,
        "max_retries": args.max_retries,
        "prompt_template": args.prompt_template,
        "cache_path": args.cache,
    }
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def cmd_judge_score(args: argparse.Namespace) -> int:
    from grouprl.rewards.judges.client import JudgeClient
    from grouprl.rewards.judges.score_log import score_log

    cfg = judge_config_from_args(args)
    client = JudgeClient(cfg, log_path=args.log)
    try:
        summary = asyncio.run(
            score_log(
                client, args.input, args.out, retry_failed=not args.skip_failed, progress=not args.no_progress
            )
        )
    finally:
        client.close()
    print(
        f"judged {summary.scored + summary.failed} of {summary.total} records "
        f"({summary.skipped} already in {args.out}): {summary.scored} scored, {summary.failed} failed; "
        f"{summary.requests} requests, {summary.cache_hits} cache hits",
        file=sys.stderr,
    )
    return 1 if summary.failed else 0
