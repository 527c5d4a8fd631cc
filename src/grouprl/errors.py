"""Errors a user can cause. The CLI prints these as one line and exits non-zero;
anything else is an internal bug and keeps its traceback."""


class UserError(Exception):
    """A mistake in input the user controls (files, config, servers, models)."""


class ConfigError(UserError):
    """An unknown key, a wrong type or an impossible combination of settings."""


class DataError(UserError):
    """A dataset that is missing, unreadable, empty or lacks a needed column."""


class ModelLoadError(UserError):
    """A model path or id that cannot be loaded."""
