"""Word expansion as bash does it: quotes, `$NAME`, `${...}` (defaults, lengths, arrays,
`#`/`%` trimming, `/` substitution, case changes, slices, indirection), `$((...))`, `$(...)`
and backticks, then field splitting of what was unquoted and `"$@"` / `"${A[@]}"` as one field
per element. No pathname expansion (nothing is looked up on disk).

What bash alone could know (an unset variable, a command convert does not answer, `<(...)`) is
carried through as its text between UNKNOWN marks, so a value built from it is known to be
unknown wherever it lands; a secret's value (a name with TOKEN, KEY, SECRET or PASSWORD in it)
is never expanded: it stays `${NAME}` between SECRET marks.
"""

from __future__ import annotations

import re

from .bash_arith import Arithmetic, ArithmeticProblem
from .bash_lex import Lexer

UNKNOWN, UNKNOWN_END, SECRET, SECRET_END = "\ue000", "\ue001", "\ue002", "\ue003"
MARKS = re.compile("[\ue000-\ue003]")
SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|CREDENTIAL|(?:^|_)(?:API_?KEYS?|KEYS?|TOKENS?)$", re.I)
_PARAMETER = re.compile(r"([#!]?)([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!0-])(\[[^\]]*\])?")
_OPERATOR = re.compile(r":?[-=+?]|##?|%%?|//?|/#|/%|\^\^?|,,?|:|@[QEPAaUuLk]")
_IFS_SPLIT = re.compile(r"[ \t\n]+")
_NAME_AFTER_DOLLAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9@*#?$!-]")


def unknown(text: str) -> str:
    return f"{UNKNOWN}{text}{UNKNOWN_END}"


def plain(text: str) -> str:
    """`text` with the marks taken out (unknown parts as written, secrets as ${NAME})."""
    return MARKS.sub("", text)


def glob_regex(pattern_parts: list[tuple[str, bool]], greedy: bool = True) -> str:
    """A regex for a bash pattern, from (text, quoted) parts: quoted text is literal."""
    out = []
    for text, quoted in pattern_parts:
        if quoted:
            out.append(re.escape(text))
            continue
        i = 0
        while i < len(text):
            ch = text[i]
            if ch == "*":
                out.append(".*" if greedy else ".*?")
            elif ch == "?":
                out.append(".")
            elif ch == "[":
                end = text.find("]", i + 2)
                if end < 0:
                    out.append(re.escape(ch))
                else:
                    inner = text[i + 1 : end]
                    inner = "^" + inner[1:] if inner[:1] in "!^" else inner
                    out.append("[" + inner.replace("\\", "\\\\") + "]")
                    i = end
            elif ch == "\\" and i + 1 < len(text):
                i += 1
                out.append(re.escape(text[i]))
            else:
                out.append(re.escape(ch))
            i += 1
    return "".join(out)


class Expansions:
    """The expansion half of the shell (`bash_run.Shell` keeps the variables and runs commands)."""

    # provided by the shell
    def get(self, name: str): ...
    def is_secret(self, name: str) -> bool: ...
    def set_var(self, name: str, value) -> None: ...
    def substitute(self, script: str) -> str: ...
    def note(self, text: str) -> None: ...
    positional: list[str]
    status: int

    # ------------------------------------------------------------------ words
    def fields(self, raw: str) -> list[str]:
        """The fields `raw` becomes (split, "$@" spread)."""
        return self._split(self.segments(raw))

    def string(self, raw: str) -> str:
        """`raw` expanded to one string (assignments, case words, [[ ]] operands): no splitting."""
        return "".join(text for kind, text in self.segments(raw) if kind != "b")

    def pattern(self, raw: str, greedy: bool = True) -> str:
        """`raw` as a regex for bash's pattern matching (quoted parts literal)."""
        parts = [(text, kind == "q") for kind, text in self.segments(raw) if kind != "b"]
        return glob_regex(parts, greedy)

    def segments(self, raw: str, quoted: bool = False) -> list[tuple[str, str]]:
        """(kind, text) parts of a word: "q" quoted, "u" unquoted literal, "x" unquoted
        expansion (split later), "b" a field break ("$@")."""
        lexer, out, i, n = Lexer(raw), [], 0, len(raw)
        if not quoted and raw.startswith("~") and (n == 1 or raw[1] == "/"):
            out.append(("q", self.string("$HOME") if self.get("HOME") is not None else "~"))
            i = 1
        while i < n:
            ch = raw[i]
            if ch == "\\":
                if i + 1 < n and raw[i + 1] != "\n" and (not quoted or raw[i + 1] in '$`"\\'):
                    out.append(("q", raw[i + 1]))
                elif quoted and i + 1 < n:
                    out.append(("q", raw[i : i + 2]))
                i += 2
            elif ch == "'" and not quoted:
                end = lexer.skip_unit(i, 0)
                out.append(("q", raw[i + 1 : end - 1]))
                i = end
            elif ch == '"' and not quoted:
                end = lexer.skip_unit(i, 0)
                inner = self.segments(raw[i + 1 : end - 1], quoted=True)
                out += inner if inner else [("q", "")]
                i = end
            elif ch == "$" and raw.startswith("$'", i) and not quoted:
                end = lexer.skip_unit(i, 0)
                out.append(("q", _ansi_c(raw[i + 2 : end - 1])))
                i = end
            elif ch == "$" or ch == "`" or (raw.startswith(("<(", ">("), i) and not quoted):
                name = _NAME_AFTER_DOLLAR.match(raw, i + 1) if ch == "$" else None
                end = name.end() if name else lexer.skip_unit(i + 1, 0) if ch in "<>" else lexer.skip_unit(i, 0)
                out += self.expansion(raw[i:end], quoted)
                i = max(end, i + 1)
            else:
                stop = i + 1
                while stop < n and raw[stop] not in "\\'\"$`<>":
                    stop += 1
                out.append(("q" if quoted else "u", raw[i:stop]))
                i = stop
        return out

    def expansion(self, text: str, quoted: bool) -> list[tuple[str, str]]:
        kind = "q" if quoted else "x"
        if text.startswith(("<(", ">(")):
            self.note(f"{text}: process substitution is not run (kept as written)")
            return [(kind, unknown(text))]
        if text.startswith("$(("):
            return [(kind, self.arithmetic(text[3:-2], text))]
        if text.startswith("$("):
            return [(kind, self.substitute(text[2:-1]))]
        if text.startswith("`"):
            inner = re.sub(r"\\([`$\\])", r"\1", text[1:-1])
            return [(kind, self.substitute(inner))]
        if text.startswith("${"):
            return self.parameter(text[2:-1], text, quoted)
        if text == "$":
            return [(kind, "$")]
        name = text[1:]
        if name in ("@", "*"):
            return self._spread(self.positional, name, quoted)
        return [(kind, self.scalar(name, text))]

    def _spread(self, values: list[str], how: str, quoted: bool) -> list[tuple[str, str]]:
        """"$@" / "${A[@]}": one field each; "$*": one field joined by spaces; unquoted: split."""
        kind = "q" if quoted else "x"
        if how == "*" and quoted:
            return [("q", " ".join(values))]
        out: list[tuple[str, str]] = []
        for i, value in enumerate(values):
            if i:
                out.append(("b", ""))
            out.append((kind, value))
        return out or [("x", "")]

    # ------------------------------------------------------------------ parameters
    def scalar(self, name: str, written: str) -> str:
        """A variable's value as one string ($NAME, ${NAME}, $1, $#, ...)."""
        special = {"#": lambda: str(len(self.positional)), "?": lambda: str(self.status),
                   "$": lambda: "4242", "!": lambda: "", "-": lambda: "hB", "0": lambda: self.get("0") or "bash"}  # fmt: skip
        if name in special:
            return special[name]()
        if self.is_secret(name):
            value = self.get(name)
            if value is None or value == "":
                return ""
            self.note(f"${{{name}}} is a secret's name: kept as the reference ${{{name}}}, never its value")
            return f"{SECRET}${{{name}}}{SECRET_END}"
        value = self.get(name)
        if isinstance(value, list):
            return value[0] if value else ""
        if isinstance(value, dict):
            return value.get("0", "")
        if value is None:
            self.note(f"{written}: {'argument' if name.isdigit() else 'variable'} not set here (kept as written)")
            return unknown(written)
        return value

    def elements(self, name: str) -> list[str]:
        value = self.get(name)
        if isinstance(value, dict):
            return list(value.values())
        if isinstance(value, list):
            return list(value)
        return [] if value is None else [self.scalar(name, "$" + name)]

    def parameter(self, inner: str, written: str, quoted: bool) -> list[tuple[str, str]]:
        kind = "q" if quoted else "x"
        match = _PARAMETER.match(inner)
        if match is None:
            self.note(f"{written}: not an expansion convert reads (kept as written)")
            return [(kind, unknown(written))]
        prefix, name, index = match.groups()
        rest = inner[match.end() :]
        if prefix == "#" and name and not rest:  # ${#X}, ${#A[@]}
            if index in ("[@]", "[*]"):
                return [(kind, str(len(self.elements(name))))]
            return [(kind, str(len(plain(self.lookup(name, index, written)))))]
        if prefix == "!":  # ${!X}: the variable named by X's value
            target = plain(self.lookup(name, index, written))
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", target):
                return [(kind, unknown(written))]
            name, index = target, None
        if index in ("[@]", "[*]") and not rest:
            return self._spread(self.elements(name), index[1], quoted)
        if name in ("@", "*") and not rest:
            return self._spread(self.positional, name, quoted)
        value = self.lookup(name, index, written, quiet=bool(rest))
        if not rest:
            return [(kind, value)]
        op = _OPERATOR.match(rest)
        if op is None:
            self.note(f"{written}: not an expansion convert reads (kept as written)")
            return [(kind, unknown(written))]
        return [(kind, self.operate(name, value, op.group(), rest[op.end() :], written))]

    def lookup(self, name: str, index: str | None, written: str, quiet: bool = False) -> str:
        """A scalar or an element's value; None-like unset values become "" when `quiet`
        (an operator such as :- follows and decides), else they are unknown."""
        set_value = self.get(name)
        if index and set_value is not None and not isinstance(set_value, str):
            key = self.string(index[1:-1])
            if isinstance(set_value, list):
                try:
                    position = Arithmetic(key, self._arith_get, self.set_var).value()
                    return set_value[position] if -len(set_value) <= position < len(set_value) else ""
                except ArithmeticProblem:
                    return unknown(written)
            return set_value.get(key, "")
        if set_value is None and quiet:
            return _UNSET
        return self.scalar(name, written)

    def operate(self, name: str, value: str, op: str, word: str, written: str) -> str:
        unset = value is _UNSET
        value = "" if unset else value
        if op in (":-", "-", ":=", "=", ":+", "+", ":?", "?"):
            empty = unset or (op.startswith(":") and value == "")
            if op[-1] in "-=":
                if not empty:
                    return value
                chosen = self.string(word)
                if op[-1] == "=":
                    self.set_var(name, chosen)
                return chosen
            if op[-1] == "+":
                return "" if empty else self.string(word)
            return unknown(written) if empty else value  # ${X:?message}: bash stops when unset
        if unset:
            self.note(f"{written}: ${{{name}}} is not set here (kept as written)")
            return unknown(written)
        if MARKS.search(value):
            return unknown(written)
        if len(value) > 65536 and op in ("#", "%", "##", "%%", "/", "//", "/#", "/%"):
            self.note(f"{written}: a pattern over a value of {len(value)} characters is not matched (kept as written)")
            return unknown(written)
        if op in ("#", "##"):
            found = re.match(f"(?s:{self.pattern(word, op == '##')})", value)
            return value[found.end() :] if found else value
        if op in ("%", "%%"):
            regex = re.compile(f"(?s:{self.pattern(word, True)})")
            starts = range(len(value) + 1) if op == "%%" else range(len(value), -1, -1)
            return next((value[:s] for s in starts if regex.fullmatch(value, s)), value)
        if op in ("/", "//", "/#", "/%"):
            pattern_raw, _, replacement = _split_unquoted(word, "/")
            regex = self.pattern(pattern_raw)
            if not regex:
                return value
            replacement = self.string(replacement).replace("\\", "\\\\")
            anchored = {"/#": f"^(?:{regex})", "/%": f"(?:{regex})$"}.get(op, regex)
            return re.sub(f"(?s){anchored}", lambda _: replacement, value, count=0 if op == "//" else 1)
        if op in ("^^", "^", ",,", ","):
            changed = value.upper() if op[0] == "^" else value.lower()
            return changed if len(op) == 2 else changed[:1] + value[1:]
        if op == ":":
            return self.slice(value, word, written)
        return value  # ${X@Q} and friends: the value itself

    def slice(self, value: str, word: str, written: str) -> str:
        offset_text, _, length_text = _split_unquoted(word, ":")
        try:
            offset = Arithmetic(self.string(offset_text), self._arith_get, self.set_var).value()
            length = Arithmetic(self.string(length_text), self._arith_get, self.set_var).value() if length_text else None
        except ArithmeticProblem:
            return unknown(written)
        offset = max(0, len(value) + offset) if offset < 0 else offset
        if length is None:
            return value[offset:]
        end = len(value) + length if length < 0 else offset + length
        return value[offset:end]

    # ------------------------------------------------------------------ arithmetic
    def _arith_get(self, name: str) -> str | None:
        value = self.get(name)
        if isinstance(value, list):
            value = value[0] if value else ""
        if isinstance(value, dict):
            value = value.get("0", "")
        if value is not None and MARKS.search(value):
            raise ArithmeticProblem(f"{name} holds a value only bash would know")
        return value

    def arithmetic(self, expression: str, written: str) -> str:
        text = self.string(expression.replace('"', ""))
        if MARKS.search(text):
            return unknown(written)
        try:
            return str(Arithmetic(text, self._arith_get, self.set_var).value())
        except ArithmeticProblem as e:
            self.note(f"{written[:80]}: {e} (kept as written)")
            return unknown(written)

    # ------------------------------------------------------------------ splitting
    @staticmethod
    def _split(segments: list[tuple[str, str]]) -> list[str]:
        fields: list[str] = []
        current: str | None = None
        for kind, text in segments:
            if kind == "b":
                if current is not None:
                    fields.append(current)
                current = None
            elif kind == "x":
                if not text:
                    continue
                parts = _split_outside_marks(text)
                if parts[0] == "":  # leading blanks end the field so far
                    if current is not None:
                        fields.append(current)
                    current = None
                    parts = parts[1:]
                for j, part in enumerate(parts):
                    if j:
                        if current is not None:
                            fields.append(current)
                        current = None
                    if part:
                        current = (current or "") + part
            else:
                current = (current or "") + text
        if current is not None:
            fields.append(current)
        return fields


def _split_outside_marks(text: str) -> list[str]:
    """`text` split at blanks, except inside an unknown or secret part (kept as one piece)."""
    if not MARKS.search(text):
        return _IFS_SPLIT.split(text)
    parts, depth = [""], 0
    for piece in re.split("([\ue000-\ue003])", text):
        if piece in (UNKNOWN, SECRET):
            depth += 1
        elif piece in (UNKNOWN_END, SECRET_END):
            depth -= 1
        elif depth == 0:
            pieces = _IFS_SPLIT.split(piece)
            parts[-1] += pieces[0]
            parts += pieces[1:]
            continue
        parts[-1] += piece
    return parts


class _Unset(str):
    """The value of an unset variable where an operator decides what it becomes."""


_UNSET = _Unset("")


def _split_unquoted(word: str, separator: str) -> tuple[str, str, str]:
    """`word` split at its first `separator` outside quotes and expansions."""
    lexer, i = Lexer(word), 0
    while i < len(word):
        if word[i] == separator:
            return word[:i], separator, word[i + 1 :]
        i = lexer.skip_unit(i, 0)
    return word, "", ""


def _ansi_c(text: str) -> str:
    escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "e": "\x1b", "a": "\a", "0": "\0"}
    return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), "\\" + m.group(1)), text)
