"""Walking a parsed launch script as bash would, without running anything it names.

The shell keeps variables (scalars, indexed and associative arrays, the environment it was
given), functions, the positional arguments and a working folder of its own (`cd` moves it; no
process changes folder), and follows if / case / for / while / `&&` / `||` / functions / `source`
/ `eval`. Commands are never run: the trainer's call (`python3 -m verl.trainer.main_ppo`, behind
`uv run`, `torchrun`, `ray job submit --`, `env`, `exec`, `nohup`, a function...) is recorded
with the arguments bash would pass it; the probes a script asks a machine (`nvidia-smi`,
`python3 -c 'import torch_npu'`, `hostname`, `date`, `nproc`) are answered as on a GPU machine
with 8 GPUs and no other accelerator, and each answer is noted; a few text tools (`echo`,
`printf`, `dirname`, `basename`, `wc`, `head`, `tail`, `cut`, `tr`, `seq`, `expr`) work on
what they are given; anything else is not run, and what it would print is unknown.

Bounded: at most MAX_STEPS commands and MAX_CALLS nested calls (functions, `$(...)`, `source`,
`eval`), so a loop that never ends or a recursion is one error line, not a hang.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .bash_arith import Arithmetic, ArithmeticProblem
from .bash_builtins import BUILTINS, external
from .bash_expand import MARKS, SECRET_NAME, UNKNOWN, Expansions, plain, unknown
from .bash_lex import (
    AndOr,
    Arith,
    ArithFor,
    BashError,
    Case,
    For,
    Function,
    Group,
    If,
    Pipeline,
    Seq,
    Simple,
    Test,
    While,
    parse,
    split_words,
)  # fmt: skip
from .bash_state import MAX_CALLS, MAX_STEPS, _Break, _Exit, _Return, _Undecided
from .bash_test import evaluate

# the trainer's entry point, as a word of the command: `-m verl.trainer.main_ppo`, DAPO's
# `recipe.dapo.main_dapo`, a `main_ppo.py` script
ENTRY_POINTS = re.compile(r"(^|[./])main_(ppo|dapo|grpo|ppo_split)(\.py)?$")
DECLARATIONS = ("export", "declare", "typeset", "local", "readonly")
_ASSIGN_ARG = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?(\+?)=(.*)", re.S)
_IGNORED = {"set", "shopt", "ulimit", "umask", "trap", "wait", "alias", "unalias", "hash", "true", ":", "getopts",
            "disown", "enable", "history", "bind", "complete", "sleep", "sync", "clear"}  # fmt: skip


@dataclass
class TrainerCall:
    argv: list[str]  # the words bash would pass (marks kept: unknown parts, secrets)
    line: int
    cwd: str


@dataclass
class Shell(Expansions):
    env: dict[str, str]
    positional: list[str] = field(default_factory=list)
    cwd: str = "/"
    script_dir: str = "/"
    variables: dict = field(default_factory=dict)
    functions: dict = field(default_factory=dict)
    calls: list[TrainerCall] = field(default_factory=list)
    notes: dict[str, None] = field(default_factory=dict)  # ordered, each once
    status: int = 0
    line: int = 0
    steps: int = 0
    depth: int = 0
    out: list[str] | None = None  # what echo & co print while a $(...) is captured
    out_unknown: bool = False

    # ------------------------------------------------------------------ variables
    def get(self, name: str):
        if name in self.variables:
            return self.variables[name]
        if name.isdigit():
            n = int(name)
            return self.positional[n - 1] if 0 < n <= len(self.positional) else None
        return self.env.get(name)

    def is_secret(self, name: str) -> bool:
        """A value from the environment whose name says it is a secret (HF_TOKEN, WANDB_API_KEY)."""
        return name not in self.variables and name in self.env and SECRET_NAME.search(name) is not None

    def set_var(self, name: str, value) -> None:
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\[(.*)\]", name, re.S)
        if match:
            base, key = match.group(1), self.string(match.group(2))
            current = self.variables.get(base, self.env.get(base))
            if isinstance(current, dict):
                current[key] = value
                return
            items = list(current) if isinstance(current, list) else ([] if current is None else [current])
            try:
                position = Arithmetic(key, self._arith_get, self.set_var).value()
            except ArithmeticProblem:
                return
            items += [""] * (position + 1 - len(items))
            items[position] = value
            self.variables[base] = items
            return
        self.variables[name] = value

    def note(self, text: str) -> None:
        self.notes.setdefault(f"line {self.line}: {text}", None)

    def assign(self, target: str, raw: str) -> None:
        """NAME=raw, NAME+=raw, NAME=(...), NAME[i]=raw."""
        append = target.endswith("+")
        name = target.rstrip("+")
        if raw.startswith("(") and raw.endswith(")"):
            values = [f for word in split_words(raw[1:-1]) for f in self._array_item(word)]
            current = self.get(name)
            if isinstance(current, dict):
                for word in values:
                    key, _, value = word.partition("=")
                    current[key.strip("[]")] = value
                return
            self.variables[name] = (list(current) if append and isinstance(current, list) else []) + values
            return
        value = self.string(raw)
        if append:
            current = self.get(name)
            if isinstance(current, list):
                self.variables[name] = [*current, value]
                return
            value = (current or "") + value
        self.set_var(name, value)

    def _array_item(self, word: str) -> list[str]:
        return [word[: word.index("]=") + 2] + self.string(word[word.index("]=") + 2 :])] if word.startswith("[") and "]=" in word else self.fields(word)

    # ------------------------------------------------------------------ running
    def run(self, node) -> int:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise BashError(f"line {self.line}: the script runs more than {MAX_STEPS} commands (a loop that never ends?)")
        runner = {Seq: self.run_seq, Simple: self.run_simple, Pipeline: self.run_pipeline, AndOr: self.run_and_or,
                  If: self.run_if, Case: self.run_case, For: self.run_for, ArithFor: self.run_arith_for,
                  While: self.run_while, Function: self.define, Group: self.run_group, Arith: self.run_arith,
                  Test: self.run_test}[type(node)]  # fmt: skip
        self.status = runner(node)
        return self.status

    def run_seq(self, node: Seq) -> int:
        status = 0
        for item in node.items:
            status = self.run(item)
        return status

    def run_and_or(self, node: AndOr) -> int:
        status = self.condition(node.first)
        for op, pipeline in node.rest:
            if (status == 0) == (op == "&&"):
                status = self.condition(pipeline)
        return status

    def condition(self, node) -> int:
        """A command whose status decides: an undecidable test counts as false (noted)."""
        try:
            return self.run(node)
        except _Undecided as e:
            self.note(f"a condition reads {e} , which only bash would know: taken as false")
            return 1

    def run_pipeline(self, node: Pipeline) -> int:
        saved, saved_unknown = self.out, self.out_unknown
        text: str | None = ""
        status = 0
        for i, command in enumerate(node.commands):
            last = i == len(node.commands) - 1
            self.stdin = text
            self.out, self.out_unknown = ([] if not last or saved is not None else None), False
            status = self.condition(command) if node.negate else self.run(command)
            text = None if self.out_unknown else "".join(self.out or [])
            if last and saved is not None:
                saved.append(text if text is not None else "")
                saved_unknown = saved_unknown or self.out_unknown
        self.out, self.out_unknown, self.stdin = saved, saved_unknown, ""
        return int(status == 0) if node.negate else status

    def run_if(self, node: If) -> int:
        for condition, body in node.clauses:
            if self.condition(condition) == 0:
                return self.run(body)
        return self.run(node.orelse) if node.orelse else 0

    def run_case(self, node: Case) -> int:
        self.line = node.line
        word = self.string(node.word)
        if MARKS.search(word):
            self.note(f"case {plain(word)}: the word is only known to bash: no pattern taken")
            return 0
        falling = False
        for patterns, body, end in node.arms:
            if falling or any(re.fullmatch(f"(?s:{self.pattern(p)})", word) for p in patterns):
                status = self.run(body)
                if end == ";;":
                    return status
                falling = end == ";&"
        return 0

    def run_for(self, node: For) -> int:
        self.line = node.line
        values = self.positional if node.words is None else [f for w in node.words for f in self.fields(w)]
        return self._loop(lambda: values, node.name, node.body)

    def _loop(self, values, name, body) -> int:
        status = 0
        for value in values():
            self.variables[name] = value
            status, stop = self._pass(body, status)
            if stop:
                break
        return status

    def run_arith_for(self, node: ArithFor) -> int:
        self.line = node.line
        self.arith(node.init)
        status = 0
        while not node.cond.strip() or self.arith(node.cond) != 0:
            status, stop = self._pass(node.body, status)
            if stop:
                break
            self.arith(node.step)
        return status

    def run_while(self, node: While) -> int:
        status = 0
        while (self.condition(node.cond) == 0) != node.until:
            status, stop = self._pass(node.body, status)
            if stop:
                break
        return status

    def _pass(self, body, status: int) -> tuple[int, bool]:
        """One pass of a loop's body: its status (the last one where `break` cut it short) and
        whether the loop ends here; a `break N` / `continue N` for an outer loop goes up."""
        try:
            return self.run(body), False
        except _Break as b:
            if b.levels > 1:
                raise _Break(b.levels - 1, b.again) from None
            return status, not b.again

    def define(self, node: Function) -> int:
        self.functions[plain(self.string(node.name))] = node.body
        return 0

    def run_group(self, node: Group) -> int:
        if not node.subshell:
            return self.run(node.body)
        return self._subshell(lambda: self.run(node.body))

    def _subshell(self, action) -> int:
        """`action` with variables, folder and functions restored afterwards (a subshell)."""
        saved = ({k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v) for k, v in self.variables.items()},
                 dict(self.functions), self.cwd, list(self.positional), dict(self.env))  # fmt: skip
        try:
            return action()
        except _Exit:
            return self.status
        finally:
            self.variables, self.functions, self.cwd, self.positional, self.env = saved

    def arith(self, text: str) -> int:
        value = self.arithmetic(text, f"(({text}))")
        if MARKS.search(value):
            raise _Undecided(f"(({text.strip()[:60]}))")
        return int(value)

    def run_arith(self, node: Arith) -> int:
        self.line = node.line
        return int(self.arith(node.expression) == 0)

    def run_test(self, node: Test) -> int:
        self.line = node.line
        return int(not evaluate(self, node.words, double=True))

    # ------------------------------------------------------------------ simple commands
    def run_simple(self, node: Simple) -> int:
        self.line = node.line
        if not node.words:
            for target, raw in node.assigns:
                self.assign(target, raw)
            return 0
        first = self.fields(node.words[0])
        if first and plain(first[0]) in DECLARATIONS:
            return self.declare(plain(first[0]), first[1:], node.words[1:])
        argv = first + [f for w in node.words[1:] for f in self.fields(w)]
        if not argv:
            return 0
        return self.command(argv)

    def command(self, argv: list[str]) -> int:
        name = plain(argv[0])
        if any(ENTRY_POINTS.search(plain(w)) for w in argv):
            self.calls.append(TrainerCall(argv, self.line, self.cwd))
            return 0
        if name in self.functions:
            return self.call(self.functions[name], argv[1:])
        if name in BUILTINS:
            return BUILTINS[name](self, argv)
        if name in _IGNORED:
            return 0
        return external(self, argv)

    def call(self, body, arguments: list[str]) -> int:
        self.enter()
        saved = self.positional
        self.positional = arguments
        try:
            return self.run(body)
        except _Return:
            return self.status
        finally:
            self.positional = saved
            self.depth -= 1

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_CALLS:
            raise BashError(f"line {self.line}: calls nested more than {MAX_CALLS} deep (a function that calls itself?)")

    def declare(self, builtin: str, expanded: list[str], raw_words: list[str]) -> int:
        """export / declare / local / readonly: NAME=value words are assignments (not split)."""
        flags = ""
        for raw in raw_words:
            text = plain(self.string(raw)) if raw.startswith("-") else None
            if text is not None and re.fullmatch(r"[-+][a-zA-Z]+", text):
                flags += text
                continue
            match = _ASSIGN_ARG.match(raw)
            if match:
                name, index, append, value = match.groups()
                if "A" in flags and name not in self.variables:
                    self.variables[name] = {}
                self.assign(f"{name}{index or ''}{append}", value)
            else:
                name = plain(self.string(raw))
                if "A" in flags:
                    self.variables.setdefault(name, {})
                elif "a" in flags:
                    self.variables.setdefault(name, [])
                elif builtin == "local":
                    self.variables[name] = ""
        return 0

    # ------------------------------------------------------------------ $(...)
    def substitute(self, script: str) -> str:
        written = f"$({script})"
        try:
            tree = parse(script)
        except BashError:
            return unknown(written)
        saved_out, saved_unknown = self.out, self.out_unknown
        self.out, self.out_unknown = [], False
        self.enter()
        try:
            self._subshell(lambda: self.run(tree))
            text = "".join(self.out)
            lost = self.out_unknown or UNKNOWN in text
        finally:
            self.depth -= 1
            self.out, self.out_unknown = saved_out, saved_unknown
        return unknown(written) if lost else text.rstrip("\n")

    def write(self, text: str | None) -> None:
        """What a command prints: kept while a $(...) is captured; None: only bash would know."""
        if self.out is None:
            return
        if text is None:
            self.out_unknown = True
        else:
            self.out.append(text)

    stdin: str | None = ""


def run_script(text: str, env: dict[str, str], script: Path | None, cwd: str, arguments: list[str]) -> Shell:
    """Walk the script; the shell afterwards holds its trainer calls and notes."""
    tree = parse(text)
    shell = Shell(env=dict(env), positional=list(arguments), cwd=cwd,
                  script_dir=str(script.parent.resolve()) if script else cwd)  # fmt: skip
    shell.variables["0"] = str(script) if script else "bash"
    shell.variables["BASH_SOURCE"] = [str(script) if script else "bash"]
    shell.variables["PWD"] = cwd
    try:
        shell.run(tree)
    except (_Exit, _Return):
        pass
    except _Break:
        pass
    except RecursionError:  # pragma: no cover - the caps above come first
        raise BashError("the script nests too deeply to read") from None
    return shell
