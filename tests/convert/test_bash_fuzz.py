"""The bash reader against text it was not written for: a seeded generator of script-like text
(fragments of bash, broken on purpose, with random bytes of every kind mixed in). Whatever it
is given, the reader returns or raises its own one-line error, never anything else; and its
time grows linearly with the input (doubling the input at most about doubles the time)."""

import random
import time

import pytest

from grouprl.convert.bash_lex import BashError
from grouprl.convert.bash_run import run_script

FRAGMENTS = [
    "X=1", "A=(a 'b c' \"$X\")", "${A[@]}", '"${A[@]}"', "${#A[@]}", "$((X*2))", "$((9**9**9))", "$(( (1+", "${X:-",
    "${X:-${Y:-z}}", "${X//a/b}", "${X%%.*}", "${X^^}", "${X:1:2}", "${!X}", "$(echo hi)", "`date`", "<(cat)", "'",
    '"', "\\", "\\\n", "\n", ";", ";;", "&&", "||", "|", "&", "(", ")", "{", "}", "[[", "]]", "[", "]", "if", "then",
    "elif", "else", "fi", "case", "in", "esac", "for", "do", "done", "while", "until", "function", "f()", "<<EOF",
    "EOF", "<<-", "2>&1", ">", ">>", "<", "#", "$", "$'\\n'", "python3 -m verl.trainer.main_ppo", "a.b=$X",
    "export", "local", "declare -A M", "M[k]=v", "shift", "set --", "eval", "source", "exit", "return", "break",
    "$@", "$*", "$#", "$1", "~/x", "é", "\x00", "\ue000", "\ud800", "\t", "  ",
]  # fmt: skip


def random_script(rng: random.Random, size: int) -> str:
    parts = []
    while sum(map(len, parts)) < size:
        if rng.random() < 0.15:
            parts.append("".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(1, 6))))
        else:
            parts.append(rng.choice(FRAGMENTS))
        parts.append(rng.choice([" ", " ", "", "\n"]))
    return "".join(parts)


def test_no_exception_escapes_but_the_readers_own():
    rng = random.Random(20260301)
    outcomes = {"read": 0, "refused": 0}
    for _ in range(400):
        text = random_script(rng, rng.randrange(1, 300))
        try:
            run_script(text, {"HOME": "/h"}, None, "/", ["arg1"])
            outcomes["read"] += 1
        except BashError as e:
            assert "\n" not in str(e), repr(text)
            outcomes["refused"] += 1
    assert outcomes["read"] > 20 and outcomes["refused"] > 20  # the generator reaches both ends


SHAPES = {
    "one joined line of arguments": lambda n: "X=v\npython3 -m verl.trainer.main_ppo " + 'a.b_${X}=$((1+2))"q $X" ' * (n // 24),
    "a continued line": lambda n: "python3 -m verl.trainer.main_ppo " + "k.v=$HOME \\\n " * (n // 14),
    "one long quoted word": lambda n: "A='" + "x" * n + "'\nB=\"" + "y$A" * (n // 4) + '"\n',
    "a long sum": lambda n: "A=$((" + "+".join(["1"] * (n // 2)) + "))\n",
    "many lines": lambda n: 'if [[ "$X" == a* ]]; then Y=${X:-z}; fi\n' * (n // 38),
    "unclosed at the end": lambda n: "python3 -m verl.trainer.main_ppo " + "a=b " * (n // 4) + '"',
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_time_grows_linearly_with_the_input(shape):
    make = SHAPES[shape]

    texts = {n: make(n) for n in (20_000, 40_000)}
    best = {n: float("inf") for n in texts}
    for _ in range(5):  # the two sizes alternate, so a busy machine slows both alike; the fastest of each counts
        for n, text in texts.items():
            start = time.perf_counter()
            try:
                run_script(text, {"HOME": "/h"}, None, "/", [])
            except BashError:
                pass
            best[n] = min(best[n], time.perf_counter() - start)
    small, large = best[20_000], best[40_000]
    assert large / small < 3.0, f"{shape}: {small:.4f}s for 20 kB, {large:.4f}s for 40 kB"
