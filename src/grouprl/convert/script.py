"""A launch script's trainer call: the script walked as bash would (`bash_run`), its first
call of verl's trainer found, and its arguments split into Hydra's options (`--config-path`,
`--config-name`, read by `hydra.py`) and the `key=value` overrides it passes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from grouprl.errors import ConfigError

from .bash_expand import MARKS, SECRET, plain
from .bash_lex import BashError, Simple, parse
from .bash_run import ENTRY_POINTS, run_script


@dataclass
class Call:
    items: list[str]  # key=value overrides, as bash passes them (marks kept on unknown parts)
    config_path: str | None
    config_name: str | None
    line: int
    cwd: str
    notes: list[str] = field(default_factory=list)


def read_text(path: Path) -> str:
    """The script's text (one line if it is not UTF-8 text)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): convert reads launch scripts, YAML and Python") from None
    return MARKS.sub("", text).replace("\r\n", "\n")


def trainer_call(text: str, script: Path | None = None, arguments: list[str] = (), cwd: str | None = None) -> Call | None:
    """The first call of verl's trainer bash would make (None: the script makes none)."""
    cwd = cwd or os.getcwd()
    shell = run_script(text, dict(os.environ), script, cwd, list(arguments))
    notes = list(shell.notes)
    if not shell.calls:
        return None
    call = shell.calls[0]
    if len(shell.calls) > 1:
        notes.append(f"the script calls the trainer {len(shell.calls)} times (lines {', '.join(str(c.line) for c in shell.calls)}): "
                     f"the first, at line {call.line}, is converted")  # fmt: skip
    start = next(i for i, w in enumerate(call.argv) if ENTRY_POINTS.search(plain(w)))
    items, config_path, config_name = [], None, None
    words = call.argv[start + 1 :]
    i = 0
    while i < len(words):
        word = plain(words[i]) if SECRET not in words[i] else words[i]
        option = re.fullmatch(r"(--config-path|--config-name|-cp|-cn|--config-dir|-cd)(?:=(.*))?", word, re.S)
        if option:
            value = option.group(2)
            if value is None and i + 1 < len(words):
                i += 1
                value = plain(words[i])
            if option.group(1) in ("--config-path", "-cp"):
                config_path = value
            elif option.group(1) in ("--config-name", "-cn"):
                config_name = value
            else:
                notes.append(f"{option.group(1)} {value}: an extra Hydra search folder (not read)")
        elif "=" in word and not word.startswith("-"):
            items.append(words[i])
        elif word.startswith("-"):
            notes.append(f"{word}: a Hydra option convert does not read")
        i += 1
    return Call(items, config_path, config_name, call.line, call.cwd, notes)


def unreached_calls(text: str) -> list[int]:
    """Lines of the script's text that call the trainer (found in the tree, run or not)."""
    found: list[int] = []

    def walk(node) -> None:
        if isinstance(node, Simple):
            if any(ENTRY_POINTS.search(re.sub(r"[\"']", "", w)) for w in node.words):
                found.append(node.line)
            return
        for value in vars(node).values():
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, tuple):
                    for part in child:
                        if hasattr(part, "__dict__"):
                            walk(part)
                elif hasattr(child, "__dict__") and not isinstance(child, str):
                    walk(child)

    try:
        walk(parse(text))
    except BashError:
        pass
    return found


def no_call_error(path: Path, text: str) -> ConfigError:
    lines = unreached_calls(text)
    if lines:
        return ConfigError(f"{path}: the trainer call at line {lines[0]} is never reached when the script runs here "
                           "(a branch not taken, a function never called): convert reads what bash would run")  # fmt: skip
    return ConfigError(f"{path}: no call of verl's trainer (python3 -m verl.trainer.main_ppo, main_dapo, ...) found: "
                       "nothing to convert")  # fmt: skip
