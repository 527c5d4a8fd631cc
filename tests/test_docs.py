"""The manual (README.md and the site under docs/): the site builds in strict mode (a broken link
or anchor, a page left out of the navigation fails), and every `grouprl` command the pages show
parses with the real argument parser and names only settings that exist; those that need
nothing but this checkout (the shipped recipes, the built-in tasks) also pass `--dry-run`."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from grouprl.cli import DEFAULT_RECIPE, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LAUNCHERS = ("torchrun", "python", "python3")  # `torchrun ... -m grouprl ...`


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each command in the page's ```bash blocks, continuation lines
    (a trailing backslash) joined."""
    out, block, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        if not pending:
            start = number
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            out.append((start, pending.strip()))
        pending = ""
    return out


def grouprl_argv(command: str) -> list[str] | None:
    """The arguments `grouprl` receives in `command` (after its environment assignments, behind
    torchrun / `python -m`), or None where the command is not grouprl's."""
    words = shlex.split(command, comments=True)
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]  # VAR=value before the command
    if not words:
        return None
    if Path(words[0]).name == "grouprl":
        return words[1:]
    if Path(words[0]).name in LAUNCHERS and "-m" in words and words[words.index("-m") + 1 :][:1] == ["grouprl"]:
        return words[words.index("-m") + 2 :]
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for number, command in shell_lines(page.read_text(encoding="utf-8")):
            argv = grouprl_argv(command)
            if argv is not None:
                found.append((f"{page.relative_to(ROOT)}:{number}", argv))
    return found


COMMANDS = documented_commands()


def test_the_pages_show_commands_to_check():
    verbs = {argv[0] for _, argv in COMMANDS if argv}
    assert {"train", "eval", "sft", "convert", "view", "retriever", "curriculum"} <= verbs, verbs


def config_items(argv: list[str]) -> tuple[Path | None, list[str]]:
    """A train/eval/sft command's YAML file (None: one of the user's own, or none) and overrides."""
    items = [a for a in argv[1:] if not a.startswith("--")]
    if items and "=" not in items[0]:
        path = ROOT / items[0]
        return (path if path.is_file() else None), items[1:]
    return DEFAULT_RECIPE, items


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_each_command_parses_and_names_settings_that_exist(where, argv, monkeypatch):
    """The parser takes it (argparse exits on an unknown flag), and a train/eval/sft command's
    overrides load onto its recipe (the default recipe where the YAML is the user's own)."""
    from grouprl.config import load_config

    build_parser().parse_args(argv)
    if argv[0] in ("train", "eval", "sft") and "--explain" not in argv:
        path, overrides = config_items(argv)
        load_config(path or DEFAULT_RECIPE, overrides)


def runnable_here(argv: list[str]) -> bool:
    """A train or sft command on a recipe of this checkout, every file it names present."""
    if argv[0] not in ("train", "sft") or "--explain" in argv:
        return False
    path, overrides = config_items(argv)
    if path is None:
        return False
    files = [v for o in overrides for v in o.partition("=")[2].strip("[]").split(",") if "/" in v]
    return all((ROOT / f).exists() for f in files)


DRY = [(w, a) for w, a in COMMANDS if runnable_here(a)]


@pytest.mark.slow
@pytest.mark.parametrize("where,argv", DRY, ids=[w for w, _ in DRY])
def test_each_runnable_command_passes_its_dry_run(where, argv, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main([argv[0], "--dry-run", *[a for a in argv[1:] if a != "--dry-run"]])
    out, err = capsys.readouterr()
    assert code in (0, 1) and "config is valid" in out, (where, out, err)  # 1: a plan that does not fit here


@pytest.mark.slow
def test_the_site_builds_in_strict_mode(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],  # not -q: it hides the warnings strict counts
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_settings_page_is_made_from_the_settings():
    """docs/reference/settings.md is `python -m grouprl.config.docs`'s output (`make docs` writes
    it); a setting added, renamed or documented anew shows here until the page is made again."""
    from grouprl.config.docs import settings_page

    page = (ROOT / "docs" / "reference" / "settings.md").read_text(encoding="utf-8")
    assert page.splitlines() == settings_page()
    assert "| `actor.clip_low` | `0.0003` | Lower clip: ratio >= 1 - clip_low. |" in page


def test_the_readmes_links_reach_files_of_this_checkout():
    """README is read on the code host, outside the site: each relative link names a file here."""
    import re

    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert len(local) >= 20, local
    assert [link for link in local if not (ROOT / link).is_file()] == []
