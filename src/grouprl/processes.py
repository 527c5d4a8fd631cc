"""Child processes that start as a fresh interpreter would (no forked threads, no CUDA state),
without an interpreter's seconds of imports: forked from multiprocessing's forkserver, a server
process that imported the heavy modules once and started no thread or device. The server is one
a process: the rollout engines and the reward-model worker fork from the same one, with the
preload of whichever started it first (the rest import in the child). A child takes its
parent's environment as it is at the child's start; a plain forked child would have the
server's, from the server's start."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import forkserver


def start_server(preload: list[str]) -> None:
    """Start the server now (when it is not running) with `preload` imported: the first child
    then starts without waiting for those imports."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    forkserver.ensure_running()


def start_fresh(target: Callable, args: tuple, name: str, preload: list[str]) -> multiprocessing.Process:
    """`target(*args)` in a daemon child forked from the server (started with `preload` when
    this is the first child), in this process's environment as it is now."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    process = context.Process(target=_in_environ, args=(dict(os.environ), target, args), name=name, daemon=True)
    process.start()
    return process


def _in_environ(environ: dict[str, str], target: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)
