"""The shape the code keeps (DEVELOPERS.md, Structure): files and functions that fit on a few
screens, and callers that ask an engine or a sampler through its interface, never what class it is."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "grouprl"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100
ENGINE_CLASSES = {"HFEngine", "VLLMEngine", "EngineProcess", "EngineService"}
SAMPLER_CLASSES = {"PromptSampler", "OnlineCurriculum"}
OWN_ROOMS = {"sampler": [("data",), ("curriculum",)]}  # where a sampler is made and may be named


def sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(encoding="utf-8"))) for path in sorted(SRC.rglob("*.py"))]


def test_no_file_or_function_is_too_long():
    too_long = []
    for path, tree in sources():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(SRC)}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long


def engine_class_checks(tree: ast.Module, classes=ENGINE_CLASSES, word: str = "engine") -> list[int]:
    """Lines of isinstance(x, <engine class>) and hasattr/getattr(<...engine...>, ...) (or a
    sampler's, with `classes` and `word`)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        if node.func.id == "isinstance" and len(node.args) == 2:
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if names & classes:
                found.append(node.lineno)
        if node.func.id in ("hasattr", "getattr") and word in ast.unparse(node.args[0]).lower():
            found.append(node.lineno)
    return found


def test_only_the_engines_room_asks_an_engine_what_it_is():
    outside = {
        f"{path.relative_to(SRC)}:{line}"
        for path, tree in sources()
        if path.relative_to(SRC).parts[:2] != ("rollout", "engines")
        for line in engine_class_checks(tree)
    }
    assert not outside, sorted(outside)


def test_only_the_samplers_rooms_ask_a_sampler_what_it_is():
    outside = {
        f"{path.relative_to(SRC)}:{line}"
        for path, tree in sources()
        if not any(path.relative_to(SRC).parts[: len(room)] == room for room in OWN_ROOMS["sampler"])
        for line in engine_class_checks(tree, SAMPLER_CLASSES, "sampler")
    }
    assert not outside, sorted(outside)


def test_the_checks_see_what_they_look_for():
    """The two checks above can fail: each finds its pattern in code written for it."""
    code = ast.parse(
        "if isinstance(p.engine, HFEngine): pass\n"
        "x = getattr(self.engine, 'push_seconds', None)\n"
        "y = isinstance(engine, engines.VLLMEngine)\n"
        "z = isinstance(value, dict)\n"
    )
    assert engine_class_checks(code) == [1, 2, 3]
    code = ast.parse(
        "if isinstance(p.sampler, OnlineCurriculum): pass\n"
        "x = p.sampler.draw(3) if hasattr(p.sampler, 'draw') else None\n"
        "z = isinstance(value, PromptSampler)\n"
    )
    assert sorted(engine_class_checks(code, SAMPLER_CLASSES, "sampler")) == [1, 2, 3]


BUILT_IN_ENGINES = {"HFEngine", "VLLMEngine"}  # made by build_engine; EngineProcess hosts one of them


def engine_constructions(tree: ast.AST) -> list[int]:
    """Lines that construct a rollout engine class directly."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in BUILT_IN_ENGINES
    ]


def test_engines_are_made_by_build_engine():
    outside = {
        f"{path.relative_to(SRC)}:{line}"
        for path, tree in sources()
        if path.relative_to(SRC).parts[:2] != ("rollout", "engines")
        for line in engine_constructions(tree)
    }
    assert not outside, sorted(outside)
    assert engine_constructions(ast.parse("e = HFEngine(m, t)\nv = engines.VLLMEngine(m)\nb = build_engine(None, m, t)\n")) == [1, 2]
