"""Turn a reward spec from the config into a callable: a built-in name or `file.py:function`."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path

from grouprl.errors import ConfigError
from grouprl.rewards.retrieval import RETRIEVAL_REWARDS
from grouprl.rewards.rules import RULES

# every built-in reward by name: rule rewards and retrieval metrics
BUILTIN: dict[str, Callable] = {**RULES, **RETRIEVAL_REWARDS}


def load_reward_function(spec: str) -> Callable:
    """Return the reward function named by `spec`.

    `spec` is a key of `BUILTIN` or `path/to/file.py:function` (a relative path is read
    from the current directory; a config file's own are made absolute beside it when it loads). The function may be sync or `async def`; the composite
    awaits coroutine results. Every failure is a one-line `ConfigError`.
    """
    spec = spec.strip()
    path_text, sep, function_name = spec.rpartition(":")
    if not sep or not path_text.endswith(".py"):
        if spec.endswith(".py"):
            raise ConfigError(f"reward {spec!r} names a file but no function: use {spec}:function_name")
        if spec in BUILTIN:
            return BUILTIN[spec]
        if sep and re.fullmatch(r"[A-Za-z_][\w.]*", path_text) and function_name.isidentifier():
            return _load_from_module(path_text, function_name, spec)
        raise ConfigError(
            f"unknown reward {spec!r}: built-in rewards are {', '.join(sorted(BUILTIN))}, "
            "or give path/to/file.py:function or package.module:function"
        )
    return _load_from_file(Path(path_text), function_name.strip(), spec)


def _load_from_module(module_name: str, function_name: str, spec: str) -> Callable:
    """`package.module:function` (TRL's `trl.rewards:accuracy_reward`): imported, not read from a file."""
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a missing package is the user's to install: one line
        first_line = (str(e).splitlines() or [""])[0]
        raise ConfigError(f"reward {spec!r}: cannot import {module_name}: {type(e).__name__}: {first_line}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"reward {spec!r}: {module_name} has no function {function_name!r}")
    return function


def _load_from_file(path: Path, function_name: str, spec: str) -> Callable:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"reward file not found: {path} (from {spec!r})")
    if not function_name:
        raise ConfigError(f"reward {spec!r} names no function after ':'")
    # A module name unique to the file, so two reward files called rewards.py do not clash
    # in sys.modules-based machinery (pickling, tracebacks).
    module_name = f"grouprl_user_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"cannot import reward file {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # its functions pickle by reference (dataclasses, workers forked from here)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file is the user's input: report it in one line
        del sys.modules[module_name]
        first_line = (str(e).splitlines() or [""])[0]
        raise ConfigError(f"error importing reward file {path}: {type(e).__name__}: {first_line}") from None
    if not hasattr(module, function_name):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(
            f"reward file {path} has no function {function_name!r} (callables there: {', '.join(public) or 'none'})"
        )
    function = getattr(module, function_name)
    if not callable(function):
        raise ConfigError(
            f"{function_name!r} in reward file {path} is a {type(function).__name__}, not callable"
        )
    return function
