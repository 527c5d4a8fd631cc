"""`[[ ... ]]`, `[ ... ]` and `test`: string, number, pattern, regex and file tests, `!`,
`&&`/`||` (`-a`/`-o`) and parentheses. An operand only bash would know makes the test
undecidable (the shell counts it false and says so). File tests look at the disk read-only."""

from __future__ import annotations

import os
import re

from .bash_expand import MARKS, plain
from .bash_lex import BashError
from .bash_state import _Undecided

_UNARY = {"-z", "-n", "-f", "-d", "-e", "-x", "-r", "-w", "-s", "-L", "-h", "-v", "-a"}
_BINARY = {"==", "=", "!=", "=~", "<", ">", "-eq", "-ne", "-lt", "-le", "-gt", "-ge", "-nt", "-ot", "-ef"}
_NUMBERS = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__, "-gt": int.__gt__, "-ge": int.__ge__}


def evaluate(shell, words: list[str], double: bool) -> bool:
    """`words`: raw words of [[ ]] (double) or the expanded arguments of [ / test."""
    return _Test(shell, words, double).run()


class _Test:
    def __init__(self, shell, words: list[str], double: bool):
        self.shell, self.words, self.double, self.i = shell, words, double, 0
        self.depth = 0

    def run(self) -> bool:
        if not self.words:
            return False
        result = self.disjunction()
        if self.i < len(self.words):
            raise BashError(f"line {self.shell.line}: a test has more than it reads: {' '.join(self.words[self.i:])[:80]}")
        return result

    def peek(self) -> str | None:
        return self.words[self.i] if self.i < len(self.words) else None

    def take(self) -> str:
        self.i += 1
        return self.words[self.i - 1]

    def disjunction(self) -> bool:
        result = self.conjunction()
        while self.peek() in (("||",) if self.double else ("-o",)):
            self.take()
            right = self.conjunction()
            result = result or right
        return result

    def conjunction(self) -> bool:
        result = self.negation()
        while self.peek() in (("&&",) if self.double else ("-a",)):
            self.take()
            right = self.negation()
            result = result and right
        return result

    def negation(self) -> bool:
        if self.peek() == "!" and self.i + 1 < len(self.words):
            self.take()
            self.depth += 1
            if self.depth > 100:
                    raise BashError(f"line {self.shell.line}: a test nested too deeply")
            result = not self.negation()
            self.depth -= 1
            return result
        return self.primary()

    def operand(self, raw: str) -> str:
        value = self.shell.string(raw) if self.double else raw
        if MARKS.search(value):
            raise _Undecided(plain(value)[:80])
        return value

    def primary(self) -> bool:
        word = self.peek()
        if word == "(":
            self.take()
            self.depth += 1
            if self.depth > 100:
                    raise BashError(f"line {self.shell.line}: a test nested too deeply")
            result = self.disjunction()
            self.depth -= 1
            if self.peek() == ")":
                self.take()
            return result
        if word in _UNARY and self.i + 1 < len(self.words) and self.words[self.i + 1] not in _BINARY:
            op = self.take()
            return self.unary(op, self.operand(self.take()))
        left = self.take()
        if self.peek() in _BINARY and self.i + 1 < len(self.words):
            op = self.take()
            right = self.take()
            return self.binary(self.operand(left), op, right)
        return self.operand(left) != ""

    def unary(self, op: str, value: str) -> bool:
        if op == "-z":
            return value == ""
        if op == "-n":
            return value != ""
        if op == "-v":
            return self.shell.get(value) is not None
        path = value if value.startswith("/") else os.path.join(self.shell.cwd, value)
        checks = {"-f": os.path.isfile, "-d": os.path.isdir, "-e": os.path.exists, "-a": os.path.exists,
                  "-L": os.path.islink, "-h": os.path.islink, "-s": lambda p: os.path.isfile(p) and os.path.getsize(p) > 0,
                  "-x": lambda p: os.access(p, os.X_OK), "-r": lambda p: os.access(p, os.R_OK), "-w": lambda p: os.access(p, os.W_OK)}  # fmt: skip
        return bool(checks[op](path))

    def binary(self, left: str, op: str, right_raw: str) -> bool:
        if op in ("==", "=", "!=") and self.double:
            regex = self.shell.pattern(right_raw)
            if MARKS.search(regex):
                self.operand(right_raw)
            matched = re.fullmatch(f"(?s:{regex})", left) is not None
            return matched if op != "!=" else not matched
        right = self.operand(right_raw)
        if op in ("==", "="):
            return left == right
        if op == "!=":
            return left != right
        if op == "=~":
            try:
                return re.search(right, left) is not None
            except re.error:
                return False
        if op in ("<", ">"):
            return left < right if op == "<" else left > right
        if op in _NUMBERS:
            try:
                return _NUMBERS[op](int(left.strip() or 0), int(right.strip() or 0))
            except ValueError:
                    raise BashError(f"line {self.shell.line}: {op} compares numbers, got {left!r} and {right!r}") from None
        return False  # -nt, -ot, -ef: file times, not looked at
