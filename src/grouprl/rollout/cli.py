"""`grouprl engine serve`: rollout engines on this machine for trainers on others
(rollout.engine_address); see rollout/engines/service.py.

GROUPRL_ENGINE_KEY=... grouprl engine serve [--host 127.0.0.1] [--port 7100] [--devices cuda:0,cuda:1]
"""

from __future__ import annotations

import argparse
import re

from grouprl.config import DEVICE
from grouprl.errors import ConfigError

DEFAULT_PORT = 7100


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `engine` verb and its `serve` sub-verb."""
    engine = subparsers.add_parser("engine", help="serve rollout engines to trainers on other machines")
    verbs = engine.add_subparsers(dest="engine_verb", required=True)
    serve = verbs.add_parser(
        "serve",
        help="one engine process per connected trainer rank, on --devices (asynchronous training's "
        "rollout.engine_address); GROUPRL_ENGINE_KEY must hold the secret the trainers hold",
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address trainers connect to (this machine's, on their network)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"(default {DEFAULT_PORT}; 0 = any free port, printed)")
    serve.add_argument(
        "--devices", default="cpu",
        help="comma-separated, one engine each: cuda:0,cuda:1 or cpu,cpu (default: one engine on the CPU)",
    )  # fmt: skip
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from grouprl.rollout.engines.service import run

    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    for device in devices:
        if not re.fullmatch(DEVICE, device):
            raise ConfigError(f"--devices: {device!r} is not cpu, cuda or cuda:N")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be from 0 to 65535, got {args.port}")
    return run(args.host, args.port, devices)
