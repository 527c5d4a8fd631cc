"""A TRL script in (`train_grpo.py`): read by its syntax tree, nothing executed. The keyword
arguments of `GRPOConfig(...)` (literal values; anything computed is reported), the
`GRPOTrainer(...)`'s model, `reward_funcs` and training data (`load_dataset("name")`), then TRL's
defaults for what the script leaves out (config/trl.py), through the same translator as verl's
names. Reward functions the script defines are copied, with the script's imports, into a file
beside the written config (`<out>_rewards.py`), so loading them never runs the script's
training; imported ones (`from trl.rewards import accuracy_reward`) are named by module.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from grouprl.config.translate import Report, show, translate
from grouprl.config.tree import all_keys
from grouprl.errors import ConfigError


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def read_trl(path: Path) -> tuple[ast.Module, str]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start})") from None
    try:
        return ast.parse(text, str(path)), text
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        line = getattr(e, "lineno", None)
        raise ConfigError(f"{path} is not Python convert can read{f' (line {line})' if line else ''}: {getattr(e, 'msg', e)}") from None


def convert_trl(path: Path, out: Path) -> tuple[dict, Report, list[str]]:
    """The config tree, the report and extra report lines for a TRL script."""
    tree, text = read_trl(path)
    calls = {name: [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _call_name(n) == name]
             for name in ("GRPOConfig", "GRPOTrainer", "load_dataset")}  # fmt: skip
    if not calls["GRPOTrainer"] and not calls["GRPOConfig"]:
        raise ConfigError(f"{path}: no GRPOConfig(...) or GRPOTrainer(...) found: convert reads TRL GRPO scripts")
    assigned = _assignments(tree)
    items, computed = [], []
    for keyword in (calls["GRPOConfig"][0].keywords if calls["GRPOConfig"] else []):
        if keyword.arg is None:
            computed.append(("**" + ast.unparse(keyword.value), "keyword arguments unpacked from a mapping"))
            continue
        value = _literal(keyword.value, assigned)
        if value is _COMPUTED:
            computed.append((keyword.arg, ast.unparse(keyword.value)))
        elif keyword.arg != "reward_weights":
            items.append(f"{keyword.arg}={show(value)}")
    trainer = calls["GRPOTrainer"][0] if calls["GRPOTrainer"] else None
    model = _keyword(trainer, "model", 0, assigned) if trainer else None
    if isinstance(model, str):
        items.append(f"model.path={show(model)}")
    from grouprl.config import from_dict

    result, report = translate(items, defaults=True, grouprl_keys=all_keys(), check=from_dict)
    report.source = "TRL"
    report.not_taken += [(k, v, "computed in the script: set it by hand") for k, v in computed]
    if model is _COMPUTED or (trainer is not None and model is None):
        report.notes.append("the trainer's model is not a literal name: set model.path by hand")
    weights = _literal(next((k.value for k in (calls["GRPOConfig"][0].keywords if calls["GRPOConfig"] else [])
                             if k.arg == "reward_weights"), ast.Constant(None)), assigned)  # fmt: skip
    components, rewards_file = _rewards(trainer, tree, text, assigned, out, weights if isinstance(weights, list) else None, report)
    result.setdefault("reward", {})["components"] = components
    result["reward"]["val_metric"] = components[0]["name"]
    extra = _data(calls["load_dataset"], assigned, result, report)
    if rewards_file:
        extra.append(f"wrote {rewards_file}: the reward functions the script defines, with its imports")
    report.notes.append("reward functions are called once per batch of completions, as TRL calls them (reward.streaming=false)")
    return result, report, extra


_COMPUTED = object()


def _assignments(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level NAME = value (the last one wins, as when the script runs top to bottom)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    return found


def _literal(node: ast.AST, assigned: dict[str, ast.AST], depth: int = 0) -> Any:
    if isinstance(node, ast.Name) and node.id in assigned and depth < 8:
        return _literal(assigned[node.id], assigned, depth + 1)
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _COMPUTED


def _keyword(call: ast.Call, name: str, position: int, assigned: dict[str, ast.AST]) -> Any:
    node = next((k.value for k in call.keywords if k.arg == name), call.args[position] if len(call.args) > position else None)
    if node is None:
        return None
    if isinstance(node, ast.Name) and isinstance(assigned.get(node.id), ast.Call) and _call_name(assigned[node.id]) == "from_pretrained":
        node = assigned[node.id].args[0] if assigned[node.id].args else node
    return _literal(node, assigned)


def _rewards(trainer, tree, text, assigned, out: Path, weights, report: Report) -> tuple[list[dict], Path | None]:
    node = next((k.value for k in trainer.keywords if k.arg == "reward_funcs"), None) if trainer is not None else None
    if isinstance(node, ast.Name) and node.id in assigned:
        node = assigned[node.id]
    entries = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node] if node is not None else []
    if not entries:
        raise ConfigError("the script's GRPOTrainer has no reward_funcs convert can read: nothing to score with")
    defined = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    imported = {}
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and n.module:
            for alias in n.names:
                imported[alias.asname or alias.name] = f"{n.module}:{alias.name}"
    components, copied = [], []
    for i, entry in enumerate(entries):
        name = entry.id if isinstance(entry, ast.Name) else entry.attr if isinstance(entry, ast.Attribute) else None
        weight = float(weights[i]) if weights and i < len(weights) else 1.0
        if name in defined:
            copied.append(defined[name])
            components.append({"name": name, "function": f"{_rewards_path(out)}:{name}", "weight": weight})
        elif name in imported:
            components.append({"name": name, "function": imported[name], "weight": weight})
        elif isinstance(entry, ast.Attribute):
            components.append({"name": name, "function": f"{ast.unparse(entry.value)}:{name}", "weight": weight})
        else:
            report.not_taken.append((f"reward_funcs[{i}]", ast.unparse(entry), "not a function the script defines or "
                                     "imports (a reward model's name: use reward.models)"))  # fmt: skip
    if not components:
        raise ConfigError("none of the script's reward_funcs is a function convert can name")
    if not copied:
        return components, None
    used = {n.id for f in copied for n in ast.walk(f) if isinstance(n, ast.Name)}
    used |= {n.value.id for f in copied for n in ast.walk(f) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}

    def binds(node) -> set[str]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return {(a.asname or a.name).split(".")[0] for a in node.names}
        return {t.id for t in node.targets if isinstance(t, ast.Name)} if isinstance(node, ast.Assign) else set()

    kept = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.Assign)) and binds(n) & used]
    imports = [ast.get_source_segment(text, n) for n in kept if not isinstance(n, ast.Assign)]
    constants = [ast.get_source_segment(text, n) for n in kept if isinstance(n, ast.Assign)]
    body = [ast.get_source_segment(text, f) for f in copied]
    path = _rewards_path(out)
    path.write_text("# reward functions copied by grouprl convert from the TRL script\n"
                    + "\n".join(i for i in imports if i) + "\n\n" + "\n".join(c for c in constants if c) + "\n\n\n"
                    + "\n\n\n".join(b for b in body if b) + "\n")  # fmt: skip
    return components, path


def _rewards_path(out: Path) -> Path:
    return out.with_name(out.stem + "_rewards.py").resolve()


def _data(calls: list[ast.Call], assigned, result: dict, report: Report) -> list[str]:
    if not calls:
        report.notes.append("no load_dataset(...) found: set data.train_files")
        return []
    name = _literal(calls[0].args[0], assigned) if calls[0].args else None
    if not isinstance(name, str):
        report.notes.append("the dataset's name is computed in the script: set data.train_files")
        return []
    if Path(name).is_file():
        result.setdefault("data", {})["train_files"] = [name]
        report.translated.append(("load_dataset", name, "data.train_files", [name]))
        return []
    result.setdefault("data", {})["train_files"] = [name]
    report.notes.append(f"the dataset {name} is a hub name: data.train_files holds it until you point it at its "
                        "parquet/jsonl files (grouprl reads files; TRL's columns are read as they are)")  # fmt: skip
    return []
