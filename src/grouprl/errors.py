"""Errors a user can cause. The CLI prints these as one line and exits non-zero;
anything else is an internal bug and keeps its traceback."""

import os
import re


class UserError(Exception):
    """A mistake in input the user controls (files, config, servers, models)."""


class ConfigError(UserError):
    """An unknown key, a wrong type or an impossible combination of settings."""


class DataError(UserError):
    """A dataset that is missing, unreadable, empty or lacks a needed column."""


class ModelLoadError(UserError):
    """A model path or id that cannot be loaded."""


def need(ok: bool, message: str) -> None:
    """A setting's check: ConfigError(message), one line, unless `ok`."""
    if not ok:
        raise ConfigError(message)


def one_of(key: str, value: str, allowed) -> None:
    """`value` of config key `key` must be one of `allowed` (named sorted in the message)."""
    need(value in allowed, f"config key '{key}' must be one of {', '.join(sorted(allowed))}, got {value!r}")


# a hub id: `name` or `owner/name`, each part of letters, digits, -, _ and . (not at either end)
_HUB_ID = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?(?:/[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?)?")


def missing_local_path(source: str) -> str | None:
    """Why a model location cannot load where it is meant as a local path that does not exist
    (the working folder named for a relative path): not on disk and not of a hub id's form
    (`name` or `owner/name`), e.g. `/models/x`, `./x`, `~/x`, or `runs/sft/model` (more than
    one `/`). None where it exists, or may be a hub id (an `owner/name` that is no local folder
    is the hub's to find)."""
    path = os.path.expanduser(source)
    if not source or os.path.exists(path):
        return None
    if _HUB_ID.fullmatch(source) and ".." not in source and "--" not in source:
        return None
    where = "" if os.path.isabs(path) else f" in {os.getcwd()}"
    return f"not a local folder{where}, and not a hub id"
