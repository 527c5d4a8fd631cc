"""`grouprl convert`: a verl (or VRAG) launch script, a file of overrides, or a verl Hydra YAML
in; a complete grouprl config and a report out.

    grouprl convert run_qwen2_5_vl-7b.sh -o run.yaml     # then: grouprl train run.yaml --dry-run

A script's `key=value` arguments are those of its `main_ppo` call (any `python -m
verl.trainer.main_ppo`, `main_ppo.py` or VRAG's entry), after expanding its variables and arrays
as bash would (`X=1`, `export X=1`, `${X}`, `${X:-default}`, `ARR=(a b)`, `"${ARR[@]}"`, line
continuations); what bash alone could know (`$(...)`, `$1` without a default) stays as written
and is reported. Every key is reported: translated (to what, with its value), no effect in
grouprl (with why), or not taken (with the nearest setting). Every setting the script leaves out
is written at verl's default (config.VERL_DEFAULTS), not the demo recipe's; the reward is verl's
default scorer for the data's `data_source` (rewards/rules.py `verl_scorer`), written out.

The translation table is config/verl.py's (VERL_KEYS, VALUES, NO_EFFECT, GATES, NEAREST,
VERL_DEFAULTS): the same one `grouprl train` uses for verl overrides.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grouprl.config import (
    GATE_DEFAULTS,
    GATES,
    NEAREST,
    NO_EFFECT,
    VERL_DEFAULTS,
    VERL_KEYS,
    apply_override,
    explain,
    from_dict,
    to_dict,
    translate_value,
)
from grouprl.errors import ConfigError

# the trainer's entry point, as a word of the command: `-m verl.trainer.main_ppo`, DAPO's
# `recipe.dapo.main_dapo`, a `main_ppo.py` script
ENTRY_POINTS = re.compile(r"(^|[./])main_(ppo|dapo|grpo|ppo_split)(\.py)?$")
_ASSIGN = re.compile(r"^(?:export\s+|local\s+|declare\s+(?:-\w+\s+)?)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


@dataclass
class Report:
    translated: list[tuple[str, Any, str, Any]] = field(default_factory=list)  # verl key, value, ours, value
    no_effect: list[tuple[str, Any, str]] = field(default_factory=list)  # key, value, why
    not_taken: list[tuple[str, Any, str]] = field(default_factory=list)  # key, value, nearest
    defaults: list[tuple[str, Any]] = field(default_factory=list)  # verl's defaults written
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"translated ({len(self.translated)}):"]
        out += [f"  {k}={_show(v)}  ->  {ours}={_show(ov)}" for k, v, ours, ov in self.translated]
        if self.no_effect:
            out.append(f"no effect in grouprl ({len(self.no_effect)}):")
            out += [f"  {k}={_show(v)}: {why}" for k, v, why in self.no_effect]
        if self.not_taken:
            out.append(f"not taken ({len(self.not_taken)}):")
            out += [f"  {k}={_show(v)}: {why}" for k, v, why in self.not_taken]
        out.append(f"verl's defaults written for what the input leaves out ({len(self.defaults)}):")
        out += [f"  {k}={_show(v)}" for k, v in self.defaults]
        out += [f"note: {n}" for n in self.notes]
        return out


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


# ----------------------------------------------------------------------------- reading the input
def arguments(path: str | Path) -> list[str]:
    """The `key=value` items of a launch script, an overrides file or a verl Hydra YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"file not found: {path}")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        tree = yaml.safe_load(text) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path} holds no mapping of settings")
        return [f"{k}={_show(v)}" for k, v in _flatten(tree)]
    items = script_arguments(text)
    if items is None:  # no entry point: a file of overrides, whitespace- or line-separated
        items = [t for t in shlex.split(text, comments=True) if "=" in t]
    return items


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def script_arguments(text: str) -> list[str] | None:
    """The key=value arguments of the script's trainer call, its variables expanded (None: no
    trainer call in it)."""
    text = re.sub(r"\\\r?\n", " ", text)  # line continuations
    variables: dict[str, str | list[str]] = {}
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True, posix=True)
        except ValueError:
            continue
        if not words:
            continue
        joined = line.strip()
        assignment = _ASSIGN.match(joined)
        is_call = any(ENTRY_POINTS.search(w) for w in words)
        if assignment and not is_call:
            name, raw = assignment.groups()
            raw = raw.strip()
            if raw.startswith("$((") and raw.rstrip(";").endswith("))"):  # arithmetic, spaces and all
                variables[name] = _arithmetic(raw.rstrip(";")[3:-2], variables)
                continue
            if raw.startswith("(") and raw.endswith(")"):  # an array
                variables[name] = [_expand(w, variables) for w in shlex.split(raw[1:-1], comments=True)]
            else:
                expanded = _expand(raw, variables)
                try:
                    parts = shlex.split(expanded, comments=True) if expanded else [""]
                except ValueError:
                    parts = [expanded]
                variables[name] = " ".join(parts) if parts else ""
            continue
        if is_call:  # (an environment prefix, PYTHONUNBUFFERED=1 python3 -m ..., is not an argument)
            expanded = [w.replace("\x00", " ") for w in shlex.split(_kept_whole(_expand_line(line, variables)), comments=True)]
            start = next((i for i, w in enumerate(expanded) if ENTRY_POINTS.search(w)), len(expanded))
            items = [w for w in expanded[start + 1 :] if "=" in w and not w.startswith("-")]
            if items:
                return items
    return None


def _kept_whole(line: str) -> str:
    """`line` with the spaces inside each `$(...)` hidden (\\x00), so that splitting it into
    words keeps a command substitution in its word, as bash does."""
    out, depth, i = [], 0, 0
    while i < len(line):
        if line.startswith("$(", i):
            depth += 1
            out.append("$(")
            i += 2
            continue
        ch = line[i]
        if depth and ch == "(":
            depth += 1
        elif depth and ch == ")":
            depth -= 1
        out.append("\x00" if depth and ch == " " else ch)
        i += 1
    return "".join(out)


def _expand_line(line: str, variables: dict) -> str:
    """`line` with `"${ARR[@]}"` made separate quoted words and the other variables expanded."""

    def array(match: re.Match) -> str:
        value = variables.get(match.group(1))
        if isinstance(value, list):
            return " ".join(shlex.quote(v) for v in value)
        return match.group(0)

    line = re.sub(r'"?\$\{([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]\}"?', array, line)
    return _expand(line, variables)


def _arithmetic(expression: str, variables: dict) -> str:
    """bash's `$(( ... ))` over integers (names are variables, `/` divides to an integer); the
    text as written when it is more than that."""
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return int(str(variables.get(node.id, os.environ.get(node.id, "0"))) or 0)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(node)

    text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expression)
    try:
        return str(value(ast.parse(text.strip(), mode="eval").body))
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError):
        return f"$(({expression}))"


def _expand(text: str, variables: dict) -> str:
    """`text` with `$((...))`, `${...}` (nested ones too) and `$NAME` expanded as bash would,
    where the script or the environment knows them."""
    text = re.sub(r"\$\(\((.*?)\)\)(?!\))", lambda m: _arithmetic(m.group(1), variables), text)
    out, i = [], 0
    while i < len(text):
        if text.startswith("${", i):
            depth = 0
            for j in range(i + 1, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    break
            else:
                out.append(text[i:])
                break
            out.append(_parameter(text[i + 2 : j], variables, text[i : j + 1]))
            i = j + 1
            continue
        plain = re.match(r"\$([A-Za-z_][A-Za-z0-9_]*|[0-9])", text[i:])
        if plain:
            out.append(_parameter(plain.group(1), variables, plain.group(0)))
            i += plain.end()
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def _parameter(inner: str, variables: dict, whole: str) -> str:
    """One `${inner}`: a name, `#name`, `name[i]` / `name[@]`, `name:-default`."""
    match = re.fullmatch(r"(#?)([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(\[[@*0-9]+\])?(?::?-(.*))?", inner, re.S)
    if match is None:
        return whole
    count, name, index, default = match.groups()
    value = variables.get(name)
    if value is None and name in os.environ and not name.isdigit():  # the script inherits this environment
        value = os.environ[name]
    if count:
        return str(len(value) if isinstance(value, list) else len(value or ""))
    if isinstance(value, list):
        if index and index.strip("[]").isdigit():
            i = int(index.strip("[]"))
            return value[i] if i < len(value) else ""
        return " ".join(value)
    if value is not None and (value != "" or default is None):
        return value
    if default is not None:
        return _expand(default.strip().strip('"').strip("'"), variables)
    return whole  # what only bash would know (an argument, $(...)): kept, reported


# ----------------------------------------------------------------------------- translating
def convert(items: list[str], data_sources: list[str] | None = None) -> tuple[dict, Report]:
    """The grouprl config tree for verl `items` (key=value) and the report. `data_sources`: the
    training data's data_source values (to choose verl's default scorer), where known."""
    c = _Conversion(items)
    c.group_size()
    c.gates()
    _overlong(c.given, c.tree, c.report)
    _dynamic_sampling(c.given, c.put, c.report)
    c.special_keys()
    for key, value in list(c.given.items()):
        c.translate(key, value)
    c.defaults()
    _reward(c.tree, c.report, data_sources)
    _drop_invalid(c.tree, c.report)
    return c.tree, c.report


class _Conversion:
    """One input's keys (`given`), the tree written so far and the report."""

    def __init__(self, items: list[str]):
        self.report, self.tree, self.written = Report(), {}, set()
        self.named = {i.partition("=")[0].strip().lstrip("+") for i in items}
        self.given: dict[str, Any] = {}
        for item in items:
            key, _, text = item.partition("=")
            try:
                value = yaml.safe_load(text) if text.strip() else ""
            except yaml.YAMLError:
                value = text
            self.given[key.strip().lstrip("+")] = value

    def put(self, ours: str, value: Any) -> None:
        apply_override(self.tree, f"{ours}={_show(value)}")
        self.written.add(ours)

    def group_size(self) -> None:
        """VRAG: rollout.n is samples per call and n_agent the group; verl: rollout.n is the group."""
        given = self.given
        n, n_agent = given.pop("actor_rollout_ref.rollout.n", None), given.get("actor_rollout_ref.rollout.n_agent")
        if n is not None and n_agent is not None:
            self.report.no_effect.append(("actor_rollout_ref.rollout.n", n, f"VRAG's group size is rollout.n_agent={n_agent}"))
        elif n is not None:
            given["actor_rollout_ref.rollout.n"] = n

    def gates(self) -> None:
        """verl's switches and the settings behind them (closed: the setting is 0)."""
        gates = {g: self.given.pop(g, GATE_DEFAULTS[g]) for g in GATES}
        for gate, (behind, ours) in GATES.items():
            value = self.given.pop(behind, GATE_DEFAULTS[behind])
            if _truthy(gates[gate]):
                self.put(ours, value)
                self.report.translated.append((f"{gate}=true, {behind}", value, ours, value))
                continue
            self.put(ours, 0)
            if behind in self.named:
                self.report.no_effect.append((behind, value, f"{gate} is false (verl's gate): {ours}=0"))
            elif gate in self.named:
                self.report.translated.append((gate, gates[gate], ours, 0))

    def special_keys(self) -> None:
        """Keys whose meaning depends on their value or on another key."""
        given, report = self.given, self.report
        for key in ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor_rollout_ref.ref.ulysses_sequence_parallel_size"):
            if given.get(key) == 1:
                report.no_effect.append((key, given.pop(key), "1: no sequence parallelism, as grouprl"))
        sample = "actor_rollout_ref.rollout.val_kwargs.do_sample"
        if str(given.get(sample, "")).lower() == "false":
            report.translated.append((sample, given.pop(sample), "rollout.val_temperature", 0.0))
            given["actor_rollout_ref.rollout.val_kwargs.temperature"] = 0.0
        elif sample in given:
            report.no_effect.append((sample, given.pop(sample), "evaluation samples at rollout.val_temperature (val_kwargs.temperature)"))
        clip = given.pop("actor_rollout_ref.actor.clip_ratio", None)
        if clip is not None:
            for side in ("low", "high"):
                given.setdefault(f"actor_rollout_ref.actor.clip_ratio_{side}", clip)

    def translate(self, key: str, value: Any) -> None:
        """One key: translated, no effect, or not taken (each reported)."""
        report = self.report
        if isinstance(value, str) and ("$(" in value or re.search(r"\$\{?[0-9A-Za-z_]", value)):
            report.not_taken.append((key, value, "its value needs bash to run the script ($(...) or an argument): set it by hand"))
        elif key in VERL_KEYS:
            self.translate_verl(key, value)
        elif key in NO_EFFECT or key.startswith("actor_rollout_ref.rollout.engine_kwargs."):
            report.no_effect.append((key, value, NO_EFFECT.get(key, "vLLM's engine keyword arguments are vLLM's defaults")))
        elif key in NEAREST:
            report.not_taken.append((key, value, f"nearest: {NEAREST[key]}"))
        elif _ours(key):
            self.write(key, value, key, value)
        else:
            near = difflib.get_close_matches(key, [*VERL_KEYS, *NO_EFFECT, *NEAREST], n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}?" if near else "nothing in grouprl (see grouprl train --explain)"
            report.not_taken.append((key, value, hint))

    def translate_verl(self, key: str, value: Any) -> None:
        report, given = self.report, self.given
        try:
            translated = translate_value(key, value)
            if key in ("trainer.save_freq", "trainer.test_freq") and isinstance(value, int) and value < 0:
                translated = 0  # verl's -1: never (grouprl's 0: at the end only)
        except ValueError as e:
            report.not_taken.append((key, value, f"cannot translate {e}"))
            return
        if key == "actor_rollout_ref.rollout.tensor_model_parallel_size" and translated not in (1, None):
            report.not_taken.append((key, value, "nearest: rollout.tensor_parallel_size=1 (each rank's vLLM holds the "
                                                 "whole model on its GPU; the memory plan says whether it fits)"))  # fmt: skip
        elif key == "algorithm.adv_estimator" and value not in ("grpo", "rloo", "grpo_batch"):
            report.not_taken.append((key, value, "nearest: algorithm.adv_estimator=grpo (no critic: grpo, rloo, grpo_batch)"))
        elif key == "data.truncation" and _truthy(given.get("data.filter_overlong_prompts", False)):
            report.no_effect.append((key, value, "over-long prompts are filtered out first (data.filter_overlong_prompts)"))
        elif key == "data.filter_overlong_prompts" and not _truthy(value) and "data.truncation" in given:
            report.no_effect.append((key, value, "data.truncation decides (filtering is off)"))
        elif self.write(key, value, VERL_KEYS[key], translated):
            if value == "sglang":
                report.notes.append("rollout.engine: vllm in place of sglang (grouprl's serving engine)")
            if key == "actor_rollout_ref.rollout.multi_turn.enable" and _truthy(value):
                report.notes.append("agent.enabled: grouprl's agent speaks its own protocol (<search>, <bbox>, "
                                    "<search_complete>) rather than verl's tool calls; see README, Search agent")  # fmt: skip

    def write(self, key: str, value: Any, ours: str, translated: Any) -> bool:
        """`ours` = `translated`, reported; a value the setting refuses is reported as not taken."""
        try:
            self.put(ours, translated)
        except ConfigError as e:
            self.report.not_taken.append((key, value, str(e)))
            return False
        self.report.translated.append((key, value, ours, translated))
        return True

    def defaults(self) -> None:
        """verl's defaults for every setting the input leaves out."""
        if "algorithm.adv_estimator" not in self.given:
            self.report.notes.append("the input sets no algorithm.adv_estimator: verl's default is gae (a critic), which "
                                     "grouprl does not have; grpo is written")  # fmt: skip
        batch = self.tree.get("data", {}).get("train_batch_size", VERL_DEFAULTS["data.train_batch_size"])
        mini = _mini_batch_default(batch)
        if "actor.mini_batch_size" not in self.written and mini != VERL_DEFAULTS["actor.mini_batch_size"]:
            self.put("actor.mini_batch_size", mini)
            self.report.notes.append(f"actor.mini_batch_size={mini}: verl's default ppo_mini_batch_size (256) does not "
                                     f"divide the batch of {batch}; the largest that does and is no more than 256")  # fmt: skip
        for ours, value in VERL_DEFAULTS.items():
            if ours not in self.written:
                self.put(ours, value)
                self.report.defaults.append((ours, value))


def _drop_invalid(tree: dict, report: Report) -> None:
    """A translated value grouprl's setting refuses (e.g. a KL type it does not have) is moved to
    'not taken', its setting back at verl's default (or grouprl's), until the config is valid."""
    produced = {ours: (key, value) for key, value, ours, _ in report.translated if isinstance(ours, str) and "." in ours}
    for _ in range(len(produced) + 1):
        try:
            from_dict(copy.deepcopy(tree))
            return
        except ConfigError as e:
            found = re.search(r"config key '([^']+)'", str(e))
            ours = found.group(1) if found else None
            if ours not in produced:
                raise
            key, value = produced.pop(ours)
            report.translated = [t for t in report.translated if t[2] != ours]
            report.not_taken.append((key, value, str(e)))
            section, _, leaf = ours.rpartition(".")
            node = tree
            for part in section.split("."):
                node = node.get(part, {})
            node.pop(leaf, None)
            if ours == "actor.mini_batch_size":  # one that divides the batch
                apply_override(tree, f"{ours}={_mini_batch_default(tree.get('data', {}).get('train_batch_size', 1024))}")
            elif ours in VERL_DEFAULTS:
                apply_override(tree, f"{ours}={_show(VERL_DEFAULTS[ours])}")


OVERLONG = ("reward_model.overlong_buffer.", "reward_model.reward_kwargs.overlong_buffer_cfg.")


def _overlong(given: dict, tree: dict, report: Report) -> None:
    """DAPO's overlong buffer (either spelling) -> an overlong_penalty component."""
    full = [k for k in list(given) if k.startswith(OVERLONG) and not k.endswith(".log")]
    found = {k.split(".")[-1]: given.pop(k) for k in full}
    longest = given.pop("reward_model.reward_kwargs.max_resp_len", None)
    if longest is not None:
        full.append("reward_model.reward_kwargs.max_resp_len")
    if not found:
        if longest is not None:
            report.no_effect.append(("reward_model.reward_kwargs.max_resp_len", longest, "no overlong buffer is set"))
        return
    keys = ", ".join(full)
    if not _truthy(found.get("enable", False)):
        report.no_effect.append((keys, found, "the overlong buffer is not enabled"))
        return
    max_length = longest or given.get("data.max_response_length") or VERL_DEFAULTS["rollout.max_response_length"]
    try:
        kwargs = {"max_length": int(max_length), "buffer_len": int(found.get("len", 4096)),
                  "penalty_factor": float(found.get("penalty_factor", 1.0))}  # fmt: skip
    except (TypeError, ValueError):
        report.not_taken.append((keys, found, "its values need bash to run the script: set the overlong_penalty component by hand"))
        return
    tree.setdefault("reward", {})["overlong"] = kwargs
    report.translated.append((keys, found, "reward.components: overlong_penalty", kwargs))


def _dynamic_sampling(given: dict, put, report: Report) -> None:
    """DAPO's dynamic sampling (filter_groups, gen_batch_size) -> the curriculum's dynamic filter."""
    gen = given.pop("data.gen_batch_size", None)
    enabled = _truthy(given.get("algorithm.filter_groups.enable", False))
    if gen is not None and enabled:
        batch = given.get("data.train_batch_size", VERL_DEFAULTS["data.train_batch_size"])
        try:
            ratio = float(gen) / float(batch)
        except (TypeError, ValueError, ZeroDivisionError):
            report.not_taken.append(("data.gen_batch_size", gen, "its value needs bash to run the script: set curriculum.max_oversample by hand"))
        else:
            put("curriculum.max_oversample", ratio)
            report.translated.append(("data.gen_batch_size", gen, "curriculum.max_oversample", ratio))
    elif gen is not None:
        report.no_effect.append(("data.gen_batch_size", gen, "algorithm.filter_groups.enable is false"))
    if enabled:
        put("data.sampler", "curriculum")
        report.notes.append("dynamic sampling (filter_groups) runs on grouprl's curriculum sampler, which draws prompts "
                            "by difficulty bucket rather than uniformly as verl does")  # fmt: skip


def _mini_batch_default(batch: Any) -> int:
    """verl's default mini-batch (256 prompts), or the largest divisor of the batch below it."""
    try:
        batch = int(batch)
    except (TypeError, ValueError):
        return VERL_DEFAULTS["actor.mini_batch_size"]
    return next(m for m in range(min(batch, VERL_DEFAULTS["actor.mini_batch_size"]), 0, -1) if batch % m == 0)


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


def _ours(key: str) -> bool:
    """`key` is a grouprl setting already."""
    return any(line.startswith(f"{key} = ") for line in _explained())


_EXPLAINED: list[str] = []


def _explained() -> list[str]:
    if not _EXPLAINED:
        _EXPLAINED.extend(explain())
    return _EXPLAINED


def _reward(tree: dict, report: Report, data_sources: list[str] | None) -> None:
    """verl's default scorer by data_source: one rule when the data names one source it knows,
    else verl_default (chosen per sample)."""
    from grouprl.rewards.rules import verl_scorer

    sources = sorted(set(data_sources or []))
    rules = {verl_scorer(s) for s in sources}
    if len(rules) == 1 and None not in rules:
        rule = rules.pop()
        why = f"verl's default scorer for data_source {', '.join(sources)}"
    else:
        rule = "verl_default"
        why = "verl's default scorer, chosen per sample by its data_source"
        if None in rules:
            report.notes.append(f"no verl default scorer for data_source {', '.join(s for s in sources if verl_scorer(s) is None)}: "
                                "set reward.components for it")  # fmt: skip
    components = [{"name": "score", "function": rule, "weight": 1.0}]
    overlong = tree.get("reward", {}).pop("overlong", None)
    if overlong is not None:  # DAPO adds it to the score
        components.append({"name": "overlong", "function": "overlong_penalty", "weight": 1.0, "kwargs": overlong})
    tree.setdefault("reward", {})["components"] = components
    tree["reward"]["val_metric"] = "score"
    report.notes.append(f"reward: {rule} ({why})")


def data_sources_of(files: list[str]) -> list[str] | None:
    """The data_source values of the first rows of the readable training files, or None."""
    import json

    found: list[str] = []
    for f in files:
        path = Path(f).expanduser()
        if not path.is_file():
            return None
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            if "data_source" not in parquet.schema_arrow.names or not parquet.metadata.num_rows:
                continue
            column = parquet.read_row_group(0, columns=["data_source"]).column("data_source").to_pylist()
            found += [str(v) for v in column if v]
        else:
            with path.open() as lines:
                for line, _ in zip(lines, range(100)):
                    record = json.loads(line) if line.strip().startswith("{") else {}
                    if record.get("data_source"):
                        found.append(str(record["data_source"]))
    return found or None


def run(source: str, out: str) -> list[str]:
    """Convert `source` into the YAML `out`; the report's lines."""
    items = arguments(source)
    trainfiles = next((i.partition("=")[2] for i in items if i.startswith("data.train_files=")), None)
    files = yaml.safe_load(trainfiles) if trainfiles else None
    files = [files] if isinstance(files, str) else files or []
    tree, report = convert(items, data_sources_of([str(f) for f in files]) if files else None)
    cfg = from_dict(tree)  # a complete, valid config (every setting)
    Path(out).write_text(f"# converted by grouprl convert from {source}\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return report.lines() + [f"wrote {out}: check it with grouprl train {out} --dry-run"]


def mapping_table() -> list[str]:
    """README's table of verl names (made from the translation table; a test keeps them equal)."""
    rows = ["| verl / VRAG key | grouprl setting |", "|---|---|"]
    rows += [f"| `{verl}` | `{ours}` |" for verl, ours in sorted(VERL_KEYS.items())]
    rows += [f"| `{gate}` | gates `{ours}` (false: 0) |" for gate, (_, ours) in sorted(GATES.items())]
    rows += [f"| `{key}` | no effect: {why} |" for key, why in sorted(NO_EFFECT.items())]
    rows += [f"| `{key}` | not taken; nearest: {near} |" for key, near in sorted(NEAREST.items())]
    return rows
