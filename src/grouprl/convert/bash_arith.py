"""bash's `$(( ... ))` over 64-bit integers, bounded: what would leave 64 bits (`2**64`,
`9**9**9`), a division by zero or a negative exponent is an `ArithmeticProblem`, and the caller
keeps the text as written and reports it (bash would wrap around or stop). Chains of one
precedence (`1+1+...+1`) are evaluated in a loop, and nesting is capped, so no expression can
recurse deeply or take more than time linear in its length.
"""

from __future__ import annotations

import re
from collections.abc import Callable

LIMIT = 2**63  # bash's integers are signed 64-bit
MAX_NESTING = 32


class ArithmeticProblem(ValueError):
    """The expression has no value convert will stand behind (said in the report)."""


_TOKEN = re.compile(
    r"\s*(?:(?P<num>0[xX][0-9a-fA-F]+|[0-9]+#[0-9a-zA-Z@_]+|[0-9]+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>\*\*=|<<=|>>=|\*\*|<<|>>|<=|>=|==|!=|&&|\|\||\+\+|--|[-+*/%&|^]=|[-+*/%<>=!~&|^?:(),]))"
)
_LEVELS = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="), ("<<", ">>"),
           ("+", "-"), ("*", "/", "%")]  # fmt: skip
_ASSIGN_OPS = ("=", "+=", "-=", "*=", "/=", "%=", "<<=", ">>=", "&=", "|=", "^=", "**=")


def _check(value: int) -> int:
    if not -LIMIT <= value < LIMIT:
        raise ArithmeticProblem("beyond 64-bit integers (bash would wrap it around)")
    return value


def _number(text: str) -> int:
    try:
        if "#" in text:
            base, digits = text.split("#", 1)
            if not 2 <= int(base) <= 36:
                raise ArithmeticProblem(f"base {base} (convert reads bases 2 to 36)")
            return _check(int(digits, int(base)))
        if text.lower().startswith("0x"):
            return _check(int(text, 16))
        if len(text) > 1 and text.startswith("0"):
            return _check(int(text, 8))
        if len(text) > 20:
            raise ArithmeticProblem("beyond 64-bit integers (bash would wrap it around)")
        return _check(int(text))
    except ValueError as e:
        if isinstance(e, ArithmeticProblem):
            raise
        raise ArithmeticProblem(f"{text!r} is not a number") from None


def _divide(a: int, b: int, op: str) -> int:
    if b == 0:
        raise ArithmeticProblem("division by zero")
    quotient = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # C's: toward zero
    return _check(quotient if op == "/" else a - b * quotient)


def _power(a: int, b: int) -> int:
    if b < 0:
        raise ArithmeticProblem("exponent less than 0")
    if abs(a) > 1 and b >= 64:
        raise ArithmeticProblem("beyond 64-bit integers (bash would wrap it around)")
    return _check(a**b)


_BINARY: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: _check(a + b), "-": lambda a, b: _check(a - b), "*": lambda a, b: _check(a * b),
    "/": lambda a, b: _divide(a, b, "/"), "%": lambda a, b: _divide(a, b, "%"), "**": _power,
    "<<": lambda a, b: _check(a << b) if 0 <= b < 64 else _check(a * 2**64 if a else 0),
    ">>": lambda a, b: a >> min(max(b, 0), 63), "&": lambda a, b: a & b, "|": lambda a, b: a | b,
    "^": lambda a, b: a ^ b, "<": lambda a, b: int(a < b), ">": lambda a, b: int(a > b),
    "<=": lambda a, b: int(a <= b), ">=": lambda a, b: int(a >= b), "==": lambda a, b: int(a == b),
    "!=": lambda a, b: int(a != b),
}  # fmt: skip


class Arithmetic:
    """One expression's evaluation. `lookup(name)` gives a variable's text (None: unset; it may
    raise to say the value is unknown), `assign(name, text)` sets one."""

    def __init__(self, text: str, lookup: Callable[[str], str | None], assign: Callable[[str, str], None], depth: int = 0):
        self.tokens = self._tokens(text)
        self.i, self.nesting = 0, 0
        self.lookup, self.assign, self.depth = lookup, assign, depth

    @staticmethod
    def _tokens(text: str) -> list[tuple[str, str]]:
        tokens, pos = [], 0
        text = text.rstrip()
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                raise ArithmeticProblem(f"cannot read {text[pos:pos + 20]!r}")
            kind = match.lastgroup or "op"
            tokens.append((kind, match.group(kind)))
            pos = match.end()
        return tokens

    def value(self) -> int:
        if not self.tokens:
            return 0
        result = self.comma()
        if self.i < len(self.tokens):
            raise ArithmeticProblem(f"unexpected {self.tokens[self.i][1]!r}")
        return result

    # ------------------------------------------------------------------ parsing and evaluating
    def peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.i >= len(self.tokens):
            raise ArithmeticProblem("the expression ends too soon")
        self.i += 1
        return self.tokens[self.i - 1]

    def nest(self) -> None:
        self.nesting += 1
        if self.nesting > MAX_NESTING:
            raise ArithmeticProblem(f"nested more than {MAX_NESTING} levels deep")

    def comma(self) -> int:
        result = self.assignment()
        while self.peek() == ",":
            self.take()
            result = self.assignment()
        return result

    def assignment(self) -> int:
        if self.i + 1 < len(self.tokens) and self.tokens[self.i][0] == "name" and self.tokens[self.i + 1][1] in _ASSIGN_OPS:
            name, op = self.take()[1], self.take()[1]
            self.nest()
            right = self.assignment()
            self.nesting -= 1
            value = right if op == "=" else _BINARY[op[:-1]](self.variable(name), right)
            self.assign(name, str(value))
            return value
        return self.conditional()

    def conditional(self) -> int:
        condition = self.binary(0)
        if self.peek() != "?":
            return condition
        self.take()
        self.nest()
        yes = self.assignment()
        if self.take()[1] != ":":
            raise ArithmeticProblem("?: without its :")
        no = self.assignment()
        self.nesting -= 1
        return yes if condition else no

    def binary(self, level: int) -> int:
        """A chain of one precedence level, left to right (a loop, not a recursion per term)."""
        if level == len(_LEVELS):
            return self.power()
        ops = _LEVELS[level]
        result = self.binary(level + 1)
        while self.peek() in ops:
            op = self.take()[1]
            if op in ("&&", "||"):  # both sides are read; bash skips the right one's side effects
                right = self.binary(level + 1)
                result = int(bool(result) and bool(right)) if op == "&&" else int(bool(result) or bool(right))
            else:
                result = _BINARY[op](result, self.binary(level + 1))
        return result

    def power(self) -> int:
        base = self.unary()
        if self.peek() != "**":
            return base
        self.take()
        self.nest()
        exponent = self.power()
        self.nesting -= 1
        return _power(base, exponent)

    def unary(self) -> int:
        op = self.peek()
        if op in ("-", "+", "!", "~", "++", "--"):
            self.take()
            self.nest()
            if op in ("++", "--"):
                name = self.take()
                if name[0] != "name":
                    raise ArithmeticProblem(f"{op} needs a variable")
                value = _check(self.variable(name[1]) + (1 if op == "++" else -1))
                self.assign(name[1], str(value))
            else:
                operand = self.unary()
                value = {"-": lambda v: _check(-v), "+": lambda v: v, "!": lambda v: int(not v), "~": lambda v: ~v}[op](operand)
            self.nesting -= 1
            return value
        return self.postfix()

    def postfix(self) -> int:
        kind, text = self.take()
        if kind == "num":
            return _number(text)
        if kind == "name":
            value = self.variable(text)
            if self.peek() in ("++", "--"):
                self.assign(text, str(_check(value + (1 if self.take()[1] == "++" else -1))))
            return value
        if text == "(":
            self.nest()
            value = self.comma()
            self.nesting -= 1
            if self.take()[1] != ")":
                raise ArithmeticProblem("( without its )")
            return value
        raise ArithmeticProblem(f"unexpected {text!r}")

    def variable(self, name: str) -> int:
        """A variable's value as a number: empty or unset is 0; other text is an expression."""
        text = (self.lookup(name) or "").strip()
        if not text:
            return 0
        if re.fullmatch(r"-?[0-9]+", text):
            return _check(int(text)) if len(text) < 21 else _check(LIMIT)
        if self.depth >= 10:
            raise ArithmeticProblem(f"{name} refers to itself")
        return Arithmetic(text, self.lookup, self.assign, self.depth + 1).value()
