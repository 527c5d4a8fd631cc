"""`grouprl sft [config.yaml] [section.key=value ...]`: supervised fine-tuning (see `grouprl.trainer.sft`).

Without a YAML file the defaults apply: gold search trajectories of the built-in slides task on
the built-in SmolLM2-135M-Instruct. The lead's `cli.py` registers the verb with `add_parser`.
"""

from __future__ import annotations


def add_parser(subparsers) -> None:
    """Register the `sft` verb on an argparse subparsers object (func returns the exit status)."""
    sft = subparsers.add_parser(
        "sft",
        help="supervised fine-tuning on conversations: grouprl sft [config.yaml] [section.key=value ...]",
    )
    sft.add_argument("items", nargs="*", help="an optional YAML file, then dotted overrides")
    sft.add_argument(
        "--dry-run", action="store_true", help="validate the settings and print the plan; load nothing"
    )
    sft.set_defaults(func=cmd_sft)


def cmd_sft(args) -> int:
    from grouprl.config import load_config
    from grouprl.trainer.sft import describe_sft, run_sft, validate_sft

    items = list(args.items)
    path = items.pop(0) if items and "=" not in items[0] else None
    cfg = load_config(path, items)
    if args.dry_run:
        validate_sft(cfg.sft)
        plan = describe_sft(cfg)  # reads the data files' columns: a missing one stops here
        print("config is valid. plan:")
        for line in plan:
            print("  " + line)
        return 0
    summary = run_sft(cfg)
    parts = [
        f"{summary['steps']} steps on {summary['train_conversations']} conversations",
        f"train loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}",
    ]
    if "eval_loss_before" in summary:
        parts.append(f"eval loss {summary['eval_loss_before']:.3f} -> {summary['eval_loss_after']:.3f}")
    if "accuracy_before" in summary:
        parts.append(f"held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}")
    if "protocol_rate_before" in summary:
        parts.append(
            f"protocol {summary['protocol_rate_before']:.0%} -> {summary['protocol_rate_after']:.0%}"
        )
    timing = f"{summary['train_seconds']:.0f} s, {summary['train_cpu_seconds']:.0f} CPU-s"
    print("sft: " + ", ".join(parts) + f" ({timing}); model: {summary['model']}")
    return 0
