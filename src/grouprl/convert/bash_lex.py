"""A launch script's text as bash parses it: words (quotes, `$(...)`, `${...}`, `$((...))`,
backticks, arrays kept whole inside their word) and the commands they make (simple commands,
pipelines, `&&`/`||` lists, if, case, for, while/until, functions, groups, `[[ ]]`, `(( ))`).

Nothing here runs: `parse(text)` returns the tree `bash_run` walks. One pass over the text:
every scan moves forward from where the last one stopped (quotes are found with `str.find`,
nested constructs by a recursion whose depth is capped), so time is linear in the script's
size, and a script too deep, unterminated or otherwise unreadable is one `BashError` line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from grouprl.errors import ConfigError

MAX_DEPTH = 50  # nested constructs ($(...), ${...}, blocks): deeper is refused, not recursed into


class BashError(ConfigError):
    """The script cannot be read as bash (one line, with where)."""


# ----------------------------------------------------------------------------- the tree
@dataclass
class Simple:
    assigns: list[tuple[str, str]]  # (NAME or NAME+, the raw value word; an array as "(...)")
    words: list[str]  # raw words, expanded when run
    line: int


@dataclass
class Pipeline:
    commands: list
    negate: bool = False


@dataclass
class AndOr:
    first: object
    rest: list[tuple[str, object]]  # ("&&" | "||", pipeline)


@dataclass
class Seq:
    items: list = field(default_factory=list)


@dataclass
class If:
    clauses: list[tuple[Seq, Seq]]
    orelse: Seq | None


@dataclass
class Case:
    word: str
    arms: list[tuple[list[str], Seq, str]]  # (patterns, body, ";;" | ";&" | ";;&")
    line: int


@dataclass
class For:
    name: str
    words: list[str] | None  # None: "$@"
    body: Seq
    line: int


@dataclass
class ArithFor:
    init: str
    cond: str
    step: str
    body: Seq
    line: int


@dataclass
class While:
    cond: Seq
    body: Seq
    until: bool


@dataclass
class Function:
    name: str
    body: object


@dataclass
class Group:
    body: Seq
    subshell: bool


@dataclass
class Arith:
    expression: str
    line: int


@dataclass
class Test:
    words: list[str]  # the raw words and operators between [[ and ]]
    line: int


RESERVED = {"if", "then", "elif", "else", "fi", "case", "esac", "for", "while", "until", "do", "done", "{", "}",
            "function", "in", "[[", "!"}  # fmt: skip
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\])?)(\+?)=")
_OPERATORS = ("&&", "||", ";;&", ";;", ";&", "|&", "<<-", "<<<", "<<", ">>", "<&", ">&", "<>", ">|", "&>>", "&>",
              ";", "&", "|", "(", ")", "<", ">", "\n")  # fmt: skip
_METACHARS = frozenset(" \t\n;&|()<>")
_DOUBLE_QUOTED_SPECIAL = re.compile(r'["\\\\$`]')


# ----------------------------------------------------------------------------- words
class Lexer:
    """Tokens from `text`: ("word", raw) or ("op", text), each with its line."""

    def __init__(self, text: str, line: int = 1):
        self.text, self.pos, self.line = text, 0, line
        self.heredocs: list[tuple[str, bool]] = []  # delimiters whose bodies start at the next newline

    def fail(self, what: str) -> BashError:
        return BashError(f"line {self.line}: {what}")

    def _advance(self, to: int) -> None:
        self.line += self.text.count("\n", self.pos, to)
        self.pos = to

    def skip_blanks(self) -> None:
        text, n = self.text, len(self.text)
        while self.pos < n:
            ch = text[self.pos]
            if ch in " \t\r":
                self.pos += 1
            elif ch == "\\" and text.startswith("\\\n", self.pos):
                self._advance(self.pos + 2)
            elif ch == "#":
                end = text.find("\n", self.pos)
                self.pos = n if end < 0 else end
            else:
                return

    def next(self) -> tuple[str, str, int]:
        """The next token: ("word", raw, line), ("op", text, line) or ("end", "", line)."""
        self.skip_blanks()
        if self.pos >= len(self.text):
            return ("end", "", self.line)
        line, text = self.line, self.text
        if text[self.pos] == "\n":
            self._advance(self.pos + 1)
            self._heredoc_bodies()
            return ("op", "\n", line)
        if text[self.pos] in "<>" and text.startswith("(", self.pos + 1):  # <(...) / >(...): a word
            return ("word", self.word(), line)
        for op in _OPERATORS:
            if text.startswith(op, self.pos):
                self.pos += len(op)
                if op in ("<<", "<<-"):
                    self._heredoc_start(op == "<<-")
                return ("op", op, line)
        return ("word", self.word(), line)

    def _heredoc_start(self, strip_tabs: bool) -> None:
        self.skip_blanks()
        raw = self.word()
        self.heredocs.append((raw.replace("'", "").replace('"', "").replace("\\", ""), strip_tabs))

    def _heredoc_bodies(self) -> None:
        """Skip the bodies of the here-documents opened on the line just ended."""
        text = self.text
        for delimiter, strip_tabs in self.heredocs:
            while True:
                if self.pos >= len(text):
                    raise self.fail(f"here-document ends before its delimiter {delimiter!r}")
                end = text.find("\n", self.pos)
                end = len(text) if end < 0 else end
                body_line = text[self.pos : end]
                self._advance(min(end + 1, len(text)))
                if (body_line.lstrip("\t") if strip_tabs else body_line) == delimiter:
                    break
        self.heredocs = []

    def word(self) -> str:
        """One word's raw text (quotes and expansions inside it kept as written)."""
        start, text, n = self.pos, self.text, len(self.text)
        if text.startswith(("<(", ">("), self.pos):
            self._advance(self._parens(self.pos + 2, 0))
        while self.pos < n:
            ch = text[self.pos]
            if ch in "<>" and text.startswith("(", self.pos + 1) and self.pos > start:  # a=<(...): inside the word
                self._advance(self._parens(self.pos + 2, 0))
                continue
            if ch in _METACHARS:
                if ch == "(" and self.pos > start and _ASSIGNMENT.fullmatch(text, start, self.pos):  # NAME=( ... )
                    self._advance(self._parens(self.pos + 1, 0))
                    continue
                break
            self._advance(self.skip_unit(self.pos, 0))
        if self.pos == start:
            raise self.fail(f"unexpected {text[start]!r}")
        return text[start : self.pos]

    def skip_unit(self, i: int, depth: int) -> int:
        """Where the unit of a word starting at `i` ends: a quoted string, an expansion, an
        escaped character or one plain character."""
        text = self.text
        if depth > MAX_DEPTH:
            raise self.fail(f"nested more than {MAX_DEPTH} levels deep")
        ch = text[i]
        if ch == "\\":
            return min(i + 2, len(text))
        if ch == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise self.fail("a single quote is never closed")
            return end + 1
        if ch == '"':
            return self._double_quoted(i + 1, depth + 1)
        if ch == "`":
            return self._backticks(i + 1)
        if ch == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "(":
                return self._parens(i + 2, depth + 1)
            if nxt == "{":
                return self._braces(i + 2, depth + 1)
            if nxt == "'":
                return self._ansi_c(i + 2)
            if nxt == '"':
                return self._double_quoted(i + 2, depth + 1)
        return i + 1

    def _ansi_c(self, i: int) -> int:
        text = self.text
        while i < len(text):
            if text[i] == "\\":
                i += 2
            elif text[i] == "'":
                return i + 1
            else:
                i += 1
        raise self.fail("a $'...' quote is never closed")

    def _backticks(self, i: int) -> int:
        text = self.text
        while i < len(text):
            if text[i] == "\\":
                i += 2
            elif text[i] == "`":
                return i + 1
            else:
                i += 1
        raise self.fail("a backtick is never closed")

    def _double_quoted(self, i: int, depth: int) -> int:
        text = self.text
        while True:
            found = _DOUBLE_QUOTED_SPECIAL.search(text, i)
            if found is None:
                raise self.fail("a double quote is never closed")
            i, ch = found.start(), found.group()
            if ch == '"':
                return i + 1
            if ch == "\\":
                i += 2
            elif ch == "`" or text.startswith(("$(", "${"), i):
                i = self.skip_unit(i, depth)
            else:
                i += 1

    def _parens(self, i: int, depth: int) -> int:
        """The end of `(...)` whose inside starts at `i` (quotes and nested constructs skipped)."""
        text, level = self.text, 1
        while i < len(text):
            ch = text[i]
            if ch == "(":
                level += 1
                i += 1
            elif ch == ")":
                level -= 1
                i += 1
                if level == 0:
                    return i
            elif ch == "#" and (i == 0 or text[i - 1] in " \t\n;"):
                end = text.find("\n", i)
                i = len(text) if end < 0 else end
            elif ch in "\\'\"`$":
                i = self.skip_unit(i, depth)
            else:
                i += 1
        raise self.fail("a parenthesis is never closed")

    def _braces(self, i: int, depth: int) -> int:
        text = self.text
        while i < len(text):
            ch = text[i]
            if ch == "}":
                return i + 1
            i = self.skip_unit(i, depth) if ch in "\\'\"`$" else i + 1
        raise self.fail("a ${ is never closed")


# ----------------------------------------------------------------------------- commands
class Parser:
    """Recursive descent over the lexer's tokens (one token of look-ahead), depth capped."""

    def __init__(self, text: str):
        self.lexer = Lexer(text)
        self.token = self.lexer.next()
        self.depth = 0

    def fail(self, what: str) -> BashError:
        return BashError(f"line {self.token[2]}: {what}")

    def advance(self) -> tuple[str, str, int]:
        token, self.token = self.token, self.lexer.next()
        return token

    def is_word(self, *values: str) -> bool:
        return self.token[0] == "word" and (not values or self.token[1] in values)

    def is_op(self, *values: str) -> bool:
        return self.token[0] == "op" and self.token[1] in values

    def expect_word(self, value: str) -> None:
        if not self.is_word(value):
            shown = "the end" if self.token[0] == "end" else repr(self.token[1])
            raise self.fail(f"expected {value!r}, found {shown}")
        self.advance()

    def skip_newlines(self) -> None:
        while self.is_op("\n"):
            self.advance()

    def program(self) -> Seq:
        seq = self.seq(())
        if self.token[0] != "end":
            raise self.fail(f"unexpected {self.token[1]!r}")
        return seq

    def seq(self, stops: tuple[str, ...]) -> Seq:
        """Commands until a word in `stops` (then, fi, done, ...) or a closing operator."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(f"blocks nested more than {MAX_DEPTH} levels deep")
        items = []
        while True:
            while self.is_op("\n", ";", "&"):
                self.advance()
            if self.token[0] == "end" or self.is_op(")", ";;", ";&", ";;&") or (self.is_word(*stops) and stops):
                break
            items.append(self.and_or())
            if not self.is_op("\n", ";", "&"):
                break
        self.depth -= 1
        return Seq(items)

    def and_or(self):
        first, rest = self.pipeline(), []
        while self.is_op("&&", "||"):
            op = self.advance()[1]
            self.skip_newlines()
            rest.append((op, self.pipeline()))
        return first if not rest else AndOr(first, rest)

    def pipeline(self):
        negate = False
        while self.is_word("!", "time"):
            negate ^= self.advance()[1] == "!"
        commands = [self.command()]
        while self.is_op("|", "|&"):
            self.advance()
            self.skip_newlines()
            commands.append(self.command())
        return commands[0] if len(commands) == 1 and not negate else Pipeline(commands, negate)

    def command(self):
        kind, value, line = self.token
        if kind == "op" and value == "(":
            if self.lexer.text.startswith("(", self.lexer.pos):  # (( arithmetic ))
                return self.arith_command(line)
            self.advance()
            body = self.seq(())
            if not self.is_op(")"):
                raise self.fail("a ( is never closed")
            self.advance()
            self.redirections()
            return Group(body, subshell=True)
        if kind != "word":
            raise self.fail(f"unexpected {value!r}" if kind == "op" else "the script ends inside a command")
        compound = {"if": self.if_clause, "case": self.case_clause, "for": self.for_clause,
                    "while": self.while_clause, "until": self.while_clause, "{": self.brace_group,
                    "function": self.function_keyword, "[[": self.test}.get(value)  # fmt: skip
        if compound is not None:
            node = compound()
            self.redirections()
            return node
        if _NAME.fullmatch(value) and self.lexer.text.startswith("()", self.lexer.pos) or (
            _NAME.fullmatch(value) and re.match(r"[ \t]*\([ \t]*\)", self.lexer.text[self.lexer.pos : self.lexer.pos + 16])
        ):
            self.advance()
            self.advance()  # (
            if not self.is_op(")"):
                raise self.fail(f"function {value}: expected ()")
            self.advance()
            self.skip_newlines()
            return Function(value, self.command())
        return self.simple(line)

    def simple(self, line: int) -> Simple:
        assigns, words = [], []
        while True:
            if self.token[0] == "word":
                raw = self.token[1]
                match = _ASSIGNMENT.match(raw)
                if raw.isdigit() and self.lexer.text.startswith(("<", ">"), self.lexer.pos):  # 2>&1: a descriptor
                    self.advance()
                    self.redirection()
                    continue
                if match and not words:
                    assigns.append((match.group(1) + match.group(2), raw[match.end() :]))
                else:
                    words.append(raw)
                self.advance()
            elif self.is_op("<", ">", ">>", "<&", ">&", "<>", ">|", "&>", "&>>", "<<", "<<-", "<<<"):
                self.redirection()
            else:
                break
        return Simple(assigns, words, line)

    def redirection(self) -> None:
        """A redirection and its target, dropped: convert writes and reads nothing the script names."""
        if self.advance()[1] in ("<<", "<<-"):
            return  # the lexer took the delimiter (and skips the body at the line's end)
        if self.token[0] != "word":
            raise self.fail("a redirection without a target")
        self.advance()

    def redirections(self) -> None:
        while self.is_op("<", ">", ">>", "<&", ">&", "<>", ">|", "&>", "&>>", "<<", "<<-", "<<<"):
            self.redirection()

    def arith_command(self, line: int) -> Arith:
        lexer = self.lexer
        start = lexer.pos + 1  # after "(("
        end = lexer._parens(start, 0)  # the inner ")" closes the second "("
        if not lexer.text.startswith(")", end):
            raise self.fail("(( is not closed by ))")
        expression = lexer.text[start : end - 1]
        lexer._advance(end + 1)
        self.token = lexer.next()
        return Arith(expression, line)

    def if_clause(self) -> If:
        self.advance()
        clauses, orelse = [], None
        while True:
            condition = self.seq(("then",))
            self.expect_word("then")
            body = self.seq(("elif", "else", "fi"))
            clauses.append((condition, body))
            if self.is_word("elif"):
                self.advance()
                continue
            if self.is_word("else"):
                self.advance()
                orelse = self.seq(("fi",))
            self.expect_word("fi")
            return If(clauses, orelse)

    def case_clause(self) -> Case:
        line = self.advance()[2]
        if self.token[0] != "word":
            raise self.fail("case without a word")
        word = self.advance()[1]
        self.skip_newlines()
        self.expect_word("in")
        arms = []
        while True:
            self.skip_newlines()
            if self.is_word("esac"):
                self.advance()
                return Case(word, arms, line)
            if self.is_op("("):
                self.advance()
            patterns = []
            while True:
                if self.token[0] != "word":
                    raise self.fail("a case pattern was expected")
                patterns.append(self.advance()[1])
                if self.is_op("|"):
                    self.advance()
                    continue
                break
            if not self.is_op(")"):
                raise self.fail("a case pattern must end with )")
            self.advance()
            body = self.seq(("esac",))
            end = ";;"
            if self.is_op(";;", ";&", ";;&"):
                end = self.advance()[1]
            elif not self.is_word("esac"):
                raise self.fail("a case arm must end with ;;")
            arms.append((patterns, body, end))

    def for_clause(self):
        line = self.advance()[2]
        if self.is_op("("):  # for (( init; cond; step ))
            lexer = self.lexer
            end = lexer._parens(lexer.pos + 1, 0)
            inner = lexer.text[lexer.pos + 1 : end - 1]
            lexer._advance(end + 1)
            self.token = lexer.next()
            parts = (inner.split(";") + ["", "", ""])[:3]
            while self.is_op(";", "\n"):
                self.advance()
            body = self.do_group()
            return ArithFor(parts[0], parts[1], parts[2], body, line)
        if self.token[0] != "word":
            raise self.fail("for without a name")
        name = self.advance()[1]
        self.skip_newlines()
        words = None
        if self.is_word("in"):
            self.advance()
            words = []
            while self.token[0] == "word":
                words.append(self.advance()[1])
        while self.is_op(";", "\n"):
            self.advance()
        return For(name, words, self.do_group(), line)

    def do_group(self) -> Seq:
        self.skip_newlines()
        if self.is_word("{"):
            return self.brace_group().body
        self.expect_word("do")
        body = self.seq(("done",))
        self.expect_word("done")
        return body

    def while_clause(self) -> While:
        until = self.advance()[1] == "until"
        condition = self.seq(("do",))
        return While(condition, self.do_group(), until)

    def brace_group(self) -> Group:
        self.advance()
        body = self.seq(("}",))
        self.expect_word("}")
        return Group(body, subshell=False)

    def function_keyword(self) -> Function:
        self.advance()
        if self.token[0] != "word":
            raise self.fail("function without a name")
        name = self.advance()[1]
        if self.is_op("("):
            self.advance()
            if not self.is_op(")"):
                raise self.fail(f"function {name}: expected ()")
            self.advance()
        self.skip_newlines()
        return Function(name, self.command())

    def test(self) -> Test:
        line = self.advance()[2]
        words = []
        while not self.is_word("]]"):
            if self.token[0] == "end":
                raise self.fail("[[ is never closed by ]]")
            words.append(self.advance()[1])
        self.advance()
        return Test(words, line)


def parse(text: str) -> Seq:
    """The script's commands (BashError: it cannot be read as bash)."""
    return Parser(text).program()


def split_words(text: str) -> list[str]:
    """The raw words of `text` (an array's inside, `"$*"`-free text): quotes kept, newlines and
    comments skipped."""
    lexer, words = Lexer(text), []
    while True:
        kind, value, _ = lexer.next()
        if kind == "end":
            return words
        if kind == "word":
            words.append(value)
