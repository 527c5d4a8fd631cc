"""`grouprl view RUN [RUN ...] [--host 127.0.0.1] [--port 8008]`: a local page over run folders."""

from __future__ import annotations

import argparse

from grouprl.errors import UserError
from grouprl.ports import check_port_free


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `view` verb."""
    view = subparsers.add_parser(
        "view", help="see runs in a browser: curves, each step's groups, a sample's turns and pages, held-out answers"
    )
    view.add_argument("runs", nargs="+", metavar="RUN", help="run folders (<output_dir>/<experiment_name>), finished or running")
    view.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1: this machine only); requests are answered for it, the loopback's names and addresses",
    )
    view.add_argument("--port", type=int, default=8008, help="port to listen on")
    view.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error"), help="uvicorn log level"
    )
    view.set_defaults(func=cmd_view)


def cmd_view(args: argparse.Namespace) -> int:
    from grouprl.view.app import create_app, plotly_js
    from grouprl.view.runs import open_runs

    runs = open_runs(args.runs)  # a missing folder or one that is no run: one line, before listening
    if plotly_js() is None:
        raise UserError("grouprl view draws its curves with plotly, which is not installed: pip install 'grouprl[view]'")
    check_port_free(args.host, args.port)
    for run in runs:  # the steps' index, built (or extended) before the first page asks for it;
        run.refresh(judges=False)  # the judge logs' in the background once /api/runs is answered
    import uvicorn

    url = f"http://{args.host}:{args.port}"
    print(f"grouprl view: {', '.join(r.name for r in runs)} on {url} (Ctrl-C to stop)", flush=True)
    uvicorn.run(create_app(runs, hosts=(args.host,)), host=args.host, port=args.port, log_level=args.log_level)
    return 0

