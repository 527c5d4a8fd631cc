"""The commands the shell answers itself: bash's builtins that change its state (cd, shift,
set --, unset, source, eval, exit, return, break, read, let, printf -v), the text tools a
`$(...)` pipes values through, and the probes a launch script asks its machine, answered as on
a GPU machine with `GPUS` GPUs (each answer noted). Nothing here starts a process, writes a
file or opens a connection; a command not named here is not run and what it prints is unknown.
"""

from __future__ import annotations

import os
import posixpath
import re
import time
from pathlib import Path

from .bash_arith import Arithmetic, ArithmeticProblem
from .bash_expand import MARKS, plain
from .bash_lex import BashError, parse
from .bash_state import GPUS, _Break, _Exit, _Return, normalise, os_user

MAX_SOURCE_BYTES = 1 << 20
GPU_NAME = "NVIDIA H100 80GB HBM3"


def _echo(shell, argv: list[str]) -> int:
    args, newline, escapes = argv[1:], True, False
    while args and re.fullmatch(r"-[neE]+", plain(args[0])):
        newline = newline and "n" not in args[0]
        escapes = "e" in args[0]
        args = args[1:]
    text = " ".join(args)
    if escapes:
        text = text.replace("\\n", "\n").replace("\\t", "\t")
    shell.write(text + ("\n" if newline else ""))
    return 0


def _printf(shell, argv: list[str]) -> int:
    args = argv[1:]
    target = None
    if len(args) >= 2 and args[0] == "-v":
        target, args = args[1], args[2:]
    if not args:
        return 1
    form, values = args[0].replace("\\n", "\n").replace("\\t", "\t"), args[1:]
    conversions = re.findall(r"%[-+ 0#]*[0-9]*(?:\.[0-9]+)?[sdifxXoc%]", form)
    count = len([c for c in conversions if c != "%%"])
    pieces, i = [], 0
    while True:
        chunk = values[i : i + count] if count else []
        filled = [_convert(c, chunk.pop(0) if chunk and c != "%%" else "") for c in conversions]
        parts = re.split(r"%[-+ 0#]*[0-9]*(?:\.[0-9]+)?[sdifxXoc%]", form)
        pieces.append(parts[0] + "".join(f + p for f, p in zip(filled, parts[1:])))
        i += count
        if not count or i >= len(values):
            break
    text = "".join(pieces)
    if target is not None:
        shell.set_var(target, text)
    else:
        shell.write(text)
    return 0


def _convert(conversion: str, value: str) -> str:
    if conversion == "%%":
        return "%"
    if MARKS.search(value):
        return value
    kind = conversion[-1]
    try:
        if kind in "dixXoc":
            return (conversion[:-1] + ("d" if kind == "i" else kind)) % int(value or 0)
        if kind == "f":
            return conversion % float(value or 0)
    except ValueError:
        return value
    return conversion % value


def _cd(shell, argv: list[str]) -> int:
    args = [a for a in argv[1:] if a not in ("--", "-P", "-L")]
    target = plain(args[0]) if args else (shell.get("HOME") or "/")
    shell.cwd = normalise(shell.cwd, target)
    shell.variables["PWD"] = shell.cwd
    return 0


def _shift(shell, argv: list[str]) -> int:
    n = int(plain(argv[1])) if len(argv) > 1 and plain(argv[1]).isdigit() else 1
    shell.positional = shell.positional[n:]
    return 0


def _set(shell, argv: list[str]) -> int:
    if "--" in argv:
        shell.positional = argv[argv.index("--") + 1 :]
    return 0


def _unset(shell, argv: list[str]) -> int:
    functions = "-f" in argv
    for name in argv[1:]:
        if not name.startswith("-"):
            (shell.functions if functions else shell.variables).pop(plain(name), None)
            shell.env.pop(plain(name), None)
    return 0


def _source(shell, argv: list[str]) -> int:
    if len(argv) < 2:
        return 1
    name = plain(argv[1])
    candidates = [Path(name)] if name.startswith("/") else [Path(shell.script_dir) / name, Path(normalise(shell.cwd, name))]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None or path.stat().st_size > MAX_SOURCE_BYTES:
        shell.note(f"source {name}: {'not found here' if path is None else 'over 1 MB'} (not read)")
        return 1
    try:
        tree = parse(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, BashError) as e:
        shell.note(f"source {name}: not read ({e})")
        return 1
    shell.enter()
    try:
        return shell.run(tree)
    except _Return:
        return shell.status
    finally:
        shell.depth -= 1


def _eval(shell, argv: list[str]) -> int:
    text = " ".join(argv[1:])
    if MARKS.search(text):
        shell.note(f"eval {plain(text)[:60]}: holds what only bash would know (not run)")
        return 0
    shell.enter()
    try:
        return shell.run(parse(text))
    finally:
        shell.depth -= 1


def _exit(shell, argv: list[str]) -> int:
    shell.status = int(plain(argv[1])) if len(argv) > 1 and plain(argv[1]).isdigit() else shell.status
    raise _Exit()


def _return(shell, argv: list[str]) -> int:
    shell.status = int(plain(argv[1])) if len(argv) > 1 and plain(argv[1]).isdigit() else shell.status
    raise _Return()


def _break(again: bool):
    def run(shell, argv: list[str]) -> int:
        raise _Break(int(plain(argv[1])) if len(argv) > 1 and plain(argv[1]).isdigit() else 1, again)

    return run


def _read(shell, argv: list[str]) -> int:
    for name in argv[1:]:
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            shell.variables[name] = f"\ue000$({' '.join(plain(a) for a in argv)})\ue001"
    return 1  # nothing to read: a `while read` loop ends


def _let(shell, argv: list[str]) -> int:
    value = 0
    for expression in argv[1:]:
        value = shell.arith(expression)
    return int(value == 0)


def _test(shell, argv: list[str]) -> int:
    from .bash_test import evaluate

    args = argv[1:-1] if plain(argv[0]) == "[" and argv[-1] == "]" else argv[1:]
    return int(not evaluate(shell, args, double=False))


def _wrapper(shell, argv: list[str]) -> int:
    """exec, command, builtin, nohup, time, env A=B, nice, stdbuf, timeout N: the command they run."""
    rest = argv[1:]
    while rest and (plain(rest[0]).startswith("-") or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", plain(rest[0]), re.S)
                    or (plain(argv[0]) == "timeout" and re.fullmatch(r"[0-9.]+[smhd]?", plain(rest[0])))):  # fmt: skip
        rest = rest[1:]
    if plain(argv[0]) == "command" and "-v" in argv[1:3]:
        return _which(shell, ["which", *[a for a in argv[1:] if a != "-v"]])
    return shell.command(rest) if rest else 0


def _pwd(shell, argv: list[str]) -> int:
    shell.write(shell.cwd + "\n")
    return 0


ABSENT_ON_GPU_MACHINE = {"npu-smi", "rocm-smi", "hl-smi", "xpu-smi", "cnmon"}


def _which(shell, argv: list[str]) -> int:
    found = 0
    for name in argv[1:]:
        if plain(name) in ABSENT_ON_GPU_MACHINE:
            found = 1
        else:
            shell.write(f"/usr/bin/{plain(name)}\n")
    return found


BUILTINS = {
    "echo": _echo, "printf": _printf, "cd": _cd, "pushd": _cd, "popd": lambda s, a: 0, "shift": _shift, "set": _set,
    "unset": _unset, "source": _source, ".": _source, "eval": _eval, "exit": _exit, "return": _return,
    "break": _break(False), "continue": _break(True), "read": _read, "let": _let, "test": _test, "[": _test,
    "exec": _wrapper, "command": _wrapper, "builtin": _wrapper, "nohup": _wrapper, "time": _wrapper, "env": _wrapper,
    "nice": _wrapper, "stdbuf": _wrapper, "timeout": _wrapper, "pwd": _pwd, "false": lambda s, a: 1,
    "which": _which, "type": _which,
}  # fmt: skip


# ----------------------------------------------------------------------------- probes and tools
def _probe(shell, what: str, answer: str) -> None:
    shell.note(f"`{what}` answered as on a GPU machine with {GPUS} GPUs: {answer}")


def _python(shell, argv: list[str]) -> int:
    code = next((plain(argv[i + 1]) for i, a in enumerate(argv[:-1]) if plain(a) == "-c"), None)
    if code is None:
        shell.note(f"{' '.join(plain(a) for a in argv)[:80]}: not run")
        shell.write(None)
        return 0
    short = " ".join(code.split())[:60]
    if re.search(r"torch_npu|torch_mlu|mindspore|habana|intel_extension_for_pytorch|torch_musa", code):
        _probe(shell, f"python -c '{short}'", "not installed (status 1)")
        return 1
    if "device_count" in code:
        _probe(shell, f"python -c '{short}'", str(GPUS))
        shell.write(f"{GPUS}\n")
        return 0
    if "is_available" in code:
        _probe(shell, f"python -c '{short}'", "True")
        shell.write("True\n")
        return 0
    if re.fullmatch(r"\s*(?:(?:import\s+[\w.]+(?:\s*,\s*[\w.]+)*|from\s+[\w.]+\s+import\s+[\w, ]+)\s*;?\s*)+", code):
        _probe(shell, f"python -c '{short}'", "imports (status 0)")
        return 0
    shell.note(f"python -c '{short}': not run (what it prints is unknown)")
    shell.write(None)
    return 0


def _nvidia_smi(shell, argv: list[str]) -> int:
    args = [plain(a) for a in argv[1:]]
    if "-L" in args or "--list-gpus" in args:
        _probe(shell, "nvidia-smi -L", f"{GPUS} GPUs")
        shell.write("".join(f"GPU {i}: {GPU_NAME} (UUID: GPU-{i:08d})\n" for i in range(GPUS)))
        return 0
    query = next((a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")), None)
    if query is not None:
        fields = {"name": GPU_NAME, "index": None, "memory.total": "81559 MiB", "count": str(GPUS), "memory.used": "0 MiB",
                  "memory.free": "81559 MiB", "uuid": None}  # fmt: skip
        if all(f.strip() in fields for f in query.split(",")):
            _probe(shell, f"nvidia-smi --query-gpu={query}", f"{GPUS} rows")
            rows = [", ".join(fields[f.strip()] or (str(i) if f.strip() == "index" else f"GPU-{i:08d}") for f in query.split(","))
                    for i in range(GPUS)]  # fmt: skip
            shell.write("".join(r + "\n" for r in rows))
            return 0
    _probe(shell, "nvidia-smi", "status 0")
    shell.write(None)
    return 0


def _date(shell, argv: list[str]) -> int:
    form = next((plain(a)[1:] for a in argv[1:] if plain(a).startswith("+")), "%a %b %d %H:%M:%S UTC %Y")
    shell.note(f"`date` answered with this machine's clock: {time.strftime(form.replace('%N', '000000000'))}")
    shell.write(time.strftime(form.replace("%N", "000000000")) + "\n")
    return 0


def _lines_tool(shell, argv: list[str]) -> int:
    """wc, head, tail, cut, tr, cat, sort, uniq over what was piped in (None: unknown)."""
    name, args, text = plain(argv[0]), [plain(a) for a in argv[1:]], shell.stdin
    if text is None or any(not a.startswith("-") and name in ("wc", "head", "tail", "cat", "sort", "uniq") for a in args):
        shell.write(None)  # unknown input, or a file to read: not looked at
        return 0
    lines = text.splitlines()
    if name == "wc":
        shell.write(f"{len(lines) if '-l' in args else len(text.split()) if '-w' in args else len(text)}\n")
    elif name in ("head", "tail"):
        count = next((int(a.lstrip("-n") or 10) for a in args if re.fullmatch(r"-n?[0-9]+", a)), None)
        if count is None and "-n" in args and args.index("-n") + 1 < len(args):
            count = int(args[args.index("-n") + 1])
        count = 10 if count is None else count
        chosen = lines[:count] if name == "head" else lines[-count:] if count else []
        shell.write("".join(line + "\n" for line in chosen))
    elif name == "cut":
        delimiter = next((a[2:] or "\t" for a in args if a.startswith("-d")), "\t")
        spec = next((a[2:] for a in args if a.startswith("-f")), "1")
        keep = {int(x) for x in re.findall(r"[0-9]+", spec)}
        shell.write("".join(delimiter.join(p for i, p in enumerate(line.split(delimiter), 1) if i in keep) + "\n" for line in lines))
    elif name == "tr":
        sets = [a for a in args if not a.startswith("-")]
        if "-d" in args and sets:
            shell.write("".join(ch for ch in text if ch not in sets[0]))
        elif len(sets) == 2 and len(sets[0]) == len(sets[1]):
            shell.write(text.translate(str.maketrans(sets[0], sets[1])))
        else:
            shell.write(None)
    elif name == "sort":
        shell.write("".join(line + "\n" for line in sorted(lines)))
    elif name == "uniq":
        shell.write("".join(line + "\n" for i, line in enumerate(lines) if not i or lines[i - 1] != line))
    else:
        shell.write(text)
    return 0


def _path_tool(shell, argv: list[str]) -> int:
    name, args = plain(argv[0]), [plain(a) for a in argv[1:] if not plain(a).startswith("-")]
    if not args:
        shell.write(None)
        return 0
    if name == "dirname":
        shell.write(posixpath.dirname(args[0].rstrip("/")) or ".")
    elif name == "basename":
        base = posixpath.basename(args[0].rstrip("/"))
        shell.write(base[: -len(args[1])] if len(args) > 1 and base.endswith(args[1]) else base)
    else:  # realpath, readlink -f
        shell.write(normalise(shell.cwd, args[0]))
    shell.write("\n")
    return 0


def _seq(shell, argv: list[str]) -> int:
    try:
        numbers = [int(plain(a)) for a in argv[1:]]
    except ValueError:
        shell.write(None)
        return 0
    first, step, last = (1, 1, numbers[0]) if len(numbers) == 1 else (numbers[0], 1, numbers[1]) if len(numbers) == 2 else numbers[:3]
    values = range(first, last + (1 if step > 0 else -1), step or 1)
    if len(values) > 100_000:
        shell.write(None)
        return 0
    shell.write("".join(f"{v}\n" for v in values))
    return 0


def _expr(shell, argv: list[str]) -> int:
    text = " ".join(plain(a) for a in argv[1:]).replace("\\*", "*")
    try:
        value = Arithmetic(text, shell._arith_get, shell.set_var).value()
    except ArithmeticProblem:
        shell.write(None)
        return 0
    shell.write(f"{value}\n")
    return int(value == 0)


def _fixed(answer: str, what: str):
    def run(shell, argv: list[str]) -> int:
        value = answer() if callable(answer) else answer
        shell.note(f"`{plain(argv[0])}` answered as {what}: {value}")
        shell.write(value + "\n")
        return 0

    return run


def _hostname(shell, argv: list[str]) -> int:
    address = any(plain(a) in ("-I", "-i", "--ip-address", "--all-ip-addresses") for a in argv[1:])
    shell.note(f"`hostname` answered as this machine: {'127.0.0.1' if address else 'localhost'}")
    shell.write(("127.0.0.1" if address else "localhost") + "\n")
    return 0


def _absent(shell, argv: list[str]) -> int:
    shell.note(f"`{plain(argv[0])}` answered as on a GPU machine: not found (status 127)")
    return 127


TOOLS = {
    "python": _python, "python3": _python, "nvidia-smi": _nvidia_smi, "date": _date, "hostname": _hostname,
    "whoami": _fixed(os_user, "this user"), "nproc": _fixed(lambda: str(os.cpu_count() or 1), "this machine's CPU count"),
    "uname": _fixed("Linux", "a Linux machine"), "dirname": _path_tool, "basename": _path_tool, "realpath": _path_tool,
    "readlink": _path_tool, "seq": _seq, "expr": _expr, **{n: _absent for n in ABSENT_ON_GPU_MACHINE},
    **{n: _lines_tool for n in ("wc", "head", "tail", "cut", "tr", "cat", "sort", "uniq")},
}  # fmt: skip


def external(shell, argv: list[str]) -> int:
    """A command that is not a builtin or function: answered if it is a probe or a text tool,
    else not run (its output unknown)."""
    name = plain(argv[0])
    tool = TOOLS.get(name) or (_python if re.fullmatch(r"python[0-9.]*", posixpath.basename(name)) else None)
    if tool is not None:
        return tool(shell, argv)
    shell.write(None)
    return 0
