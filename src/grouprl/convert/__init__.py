"""`grouprl convert`: a verl (or VRAG) launch script, its Hydra file, a file of overrides, a
verl config YAML or a TRL script in; a complete grouprl config and a report out.

    grouprl convert run_qwen2_5_vl-7b.sh -o run.yaml     # then: grouprl train run.yaml --dry-run

Reading: a shell script is walked as bash would walk it, running nothing (`bash_run`); what
its trainer call would receive is what is translated (`script.py`), its Hydra file first
(`hydra.py`). A Python file is read as a TRL script, by its syntax tree (`trl_script.py`).
Translating: config/translate.py, the one translator `grouprl train`'s overrides use too.
The reward: verl's default scorer for the data's `data_source` (`reward.py`), written out.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from grouprl.config import VERL_KEYS, from_dict, to_dict
from grouprl.config.translate import Report, show, translate
from grouprl.config.tree import all_keys
from grouprl.config.verl import GATES, NEAREST, NO_EFFECT
from grouprl.errors import ConfigError

from .reward import choose_reward, data_sources_of
from .script import no_call_error, read_text, trainer_call

__all__ = ["Report", "arguments", "convert", "data_sources_of", "mapping_table", "run", "script_arguments"]


def script_arguments(text: str, script: Path | None = None, cwd: str | None = None) -> list[str] | None:
    """The key=value arguments of the script's trainer call as bash would pass them, its Hydra
    file's settings first (None: no trainer call)."""
    items, _ = _script_items(text, script, cwd)
    return items


def _script_items(text: str, script: Path | None, cwd: str | None) -> tuple[list[str] | None, list[str]]:
    from .hydra import config_items

    call = trainer_call(text, script, cwd=cwd)
    if call is None:
        return None, []
    notes = call.notes
    hydra = config_items(call.config_path, call.config_name, call.cwd, script, notes)
    return hydra + call.items, notes


def arguments(path: str | Path) -> tuple[list[str], list[str]]:
    """The `key=value` items of a launch script, an overrides file or a verl Hydra YAML, and
    the notes on how they were read."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"file not found: {path}")
    text = read_text(path)
    if path.suffix in (".yaml", ".yml"):
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"malformed YAML in {path}: {str(e).splitlines()[0]}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path} holds no mapping of settings")
        from .hydra import _flatten, _own

        return [f"{k}={show(v)}" for k, v in _flatten(_own(tree))], []
    items, notes = _script_items(text, path, None)
    if items is None:
        if path.suffix in (".sh", ".bash") or text.startswith("#!"):
            raise no_call_error(path, text)
        from .bash_lex import split_words
        from .bash_run import Shell

        shell = Shell(env={})  # a file of overrides: its words, quotes removed
        items = [shell.string(w) for w in split_words(text) if "=" in w]
        if not items:
            raise ConfigError(f"{path}: neither a launch script with a trainer call nor key=value overrides")
    return items, notes


def convert(items: list[str], data_sources: list[str] | None = None, notes: list[str] = ()) -> tuple[dict, Report]:
    """The grouprl config tree for verl `items` (key=value) and the report. `data_sources`: the
    training data's data_source values (to choose verl's default scorer), where known."""
    tree, report = translate(items, defaults=True, grouprl_keys=all_keys(), check=from_dict)
    report.notes[:0] = list(notes)
    if report.source == "verl":
        choose_reward(tree, report, data_sources)
    return tree, report


def run(source: str, out: str) -> list[str]:
    """Convert `source` into the YAML `out`; the report's lines."""
    if Path(source).suffix == ".py":
        from .trl_script import convert_trl

        tree, report, extra = convert_trl(Path(source), Path(out))
    else:
        items, notes = arguments(source)
        files = _train_files(items)
        tree, report = convert(items, data_sources_of(files) if files else None, notes)
        extra = []
    if not report.translated:
        raise ConfigError(f"{source}: nothing in it translates to a grouprl setting ({len(report.not_taken)} not taken)")
    cfg = from_dict(tree)  # a complete, valid config (every setting)
    Path(out).write_text(f"# converted by grouprl convert from {source}\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return report.lines() + extra + [f"wrote {out}: check it with grouprl train {out} --dry-run"]


def _train_files(items: list[str]) -> list[str]:
    text = next((i.partition("=")[2] for i in reversed(items) if i.lstrip("+").startswith("data.train_files=")), None)
    if text is None:
        return []
    try:
        files = yaml.safe_load(text)
    except yaml.YAMLError:
        return []
    files = [files] if isinstance(files, str) else files if isinstance(files, list) else []
    return [str(f) for f in files]


def mapping_table() -> list[str]:
    """The docs' table of verl names (docs/verl-trl.md) (made from the translation table; a test keeps them equal)."""
    rows = ["| verl / VRAG key | grouprl setting |", "|---|---|"]
    rows += [f"| `{verl}` | `{ours}` |" for verl, ours in sorted(VERL_KEYS.items())]
    rows += [f"| `{gate}` | gates `{ours}` (false: 0) |" for gate, (_, ours) in sorted(GATES.items())]
    rows += [f"| `{key}` | no effect: {why} |" for key, why in sorted(NO_EFFECT.items())]
    rows += [f"| `{key}` | not taken; nearest: {near} |" for key, near in sorted(NEAREST.items())]
    return rows
