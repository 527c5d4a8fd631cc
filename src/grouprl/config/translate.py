"""The one translator of verl's (and TRL's) names: `key=value` items in, grouprl settings and a
report out. `grouprl train`'s overrides (loading.py) and `grouprl convert` (a script, a Hydra
file, a TRL script) both call `translate`, so a key means the same wherever it is written.

Every key is reported: translated (to what, with its value), no effect in grouprl (with why),
or not taken (with the nearest setting, or a close verl name that exists). With `defaults`
(convert, or a run given verl's names and no config file) every setting the items leave out is
written at the source's default (verl's VERL_DEFAULTS, TRL's TRL_DEFAULTS), never grouprl's
demo recipe; where grouprl cannot keep the source's meaning the item is refused in one line
(`gae`'s critic, groups of one).
"""

from __future__ import annotations

import copy
import difflib
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from grouprl.errors import ConfigError

from .overrides import apply_override
from .trl import TRL_DEFAULTS, TRL_KEYS, trl_values
from .verl import (
    GATE_DEFAULTS,
    GATES,
    NEAREST,
    NO_EFFECT,
    OVERLONG,
    VERL_DEFAULTS,
    VERL_KEYS,
    translate_value,
)

GROUP_ESTIMATORS = "grpo, rloo or grpo_batch"


@dataclass
class Report:
    translated: list[tuple[str, Any, str, Any]] = field(default_factory=list)  # source key, value, ours, value
    no_effect: list[tuple[str, Any, str]] = field(default_factory=list)  # key, value, why
    not_taken: list[tuple[str, Any, str]] = field(default_factory=list)  # key, value, nearest
    defaults: list[tuple[str, Any]] = field(default_factory=list)  # the source's defaults written
    notes: list[str] = field(default_factory=list)
    source: str = "verl"
    overlong: dict | None = None  # DAPO's overlong buffer: an overlong_penalty component's kwargs

    def lines(self) -> list[str]:
        out = [f"translated ({len(self.translated)}):"]
        out += [f"  {k}={show(v)}  ->  {ours}={show(ov)}" for k, v, ours, ov in self.translated]
        if self.no_effect:
            out.append(f"no effect in grouprl ({len(self.no_effect)}):")
            out += [f"  {k}={show(v)}: {why}" for k, v, why in self.no_effect]
        if self.not_taken:
            out.append(f"not taken ({len(self.not_taken)}):")
            out += [f"  {k}={show(v)}: {why}" for k, v, why in self.not_taken]
        if self.defaults:
            out.append(f"{self.source}'s defaults written for what the input leaves out ({len(self.defaults)}):")
            out += [f"  {k}={show(v)}" for k, v in self.defaults]
        out += [f"note: {n}" for n in self.notes]
        return out


def show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


def parse_items(items: list[str]) -> dict[str, Any]:
    """key=value items as a mapping (values read as YAML, Hydra's + and ++ prefixes dropped)."""
    given: dict[str, Any] = {}
    for item in items:
        key, _, text = item.partition("=")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        given[key.strip().lstrip("+")] = value
    return given


def is_verl_only(item: str) -> bool:
    """A `key=value` override whose key is verl's (or TRL's) name and not also grouprl's."""
    from .tree import all_keys

    return is_source_key(item.partition("=")[0], all_keys())


def is_source_key(key: str, grouprl_keys: set[str]) -> bool:
    """A key that is verl's or TRL's name and not also grouprl's."""
    key = key.strip().lstrip("+")
    if key in grouprl_keys:
        return False
    return key in VERL_KEYS or key in NO_EFFECT or key in GATES or key in NEAREST or key in TRL_KEYS or key.startswith(
        ("actor_rollout_ref.", "reward_model.", "critic.", "custom_reward_function.")
    ) or key == "actor_rollout_ref.actor.clip_ratio"


def translate(items: list[str], *, defaults: bool = False, named_ours: set[str] = frozenset(),
              grouprl_keys: set[str] = frozenset(), tree: dict | None = None, check=None) -> tuple[dict, Report]:  # fmt: skip
    """The grouprl tree and the report for verl / TRL `items`. `named_ours`: grouprl keys set
    by other overrides (an open gate then leaves them be); `grouprl_keys`: every grouprl key (an
    item already in grouprl's names passes through); `check`: builds the config from a tree (with
    `defaults`: a translated value the config refuses goes back to the default, reported)."""
    t = _Translation(parse_items(items), apply_override, grouprl_keys)
    t.check = check
    if tree is not None:  # written into an existing tree (a config file's, with its overrides)
        t.tree = tree
    trl = any(k in TRL_KEYS for k in t.given) and not any("." in k for k in t.given if k not in grouprl_keys)
    if trl:
        t.report.source = "TRL"
        t.trl()
    else:
        t.refuse_critic(defaults)
        t.group_size()
        t.gates(named_ours)
        t.special_keys()
        t.overlong()
        t.dynamic_sampling()
    for key, value in list(t.given.items()):
        t.translate(key, value)
    if defaults:
        t.defaults(TRL_DEFAULTS if trl else VERL_DEFAULTS)
        if check is not None:
            t.drop_invalid()
    return t.tree, t.report


class _Translation:
    """One input's keys (`given`), the tree written so far and the report."""

    def __init__(self, given: dict[str, Any], apply_override, grouprl_keys: set[str]):
        self.given, self.apply, self.grouprl_keys = given, apply_override, grouprl_keys
        self.report, self.tree, self.written = Report(), {}, set()

    def put(self, ours: str, value: Any) -> None:
        self.apply(self.tree, f"{ours}={show(value)}")
        self.written.add(ours)

    def refuse_critic(self, defaults: bool) -> None:
        """verl's gae (its default) trains a critic; a group estimator with groups of one has no baseline."""
        estimator = self.given.get("algorithm.adv_estimator")
        n = self.given.get("actor_rollout_ref.rollout.n_agent", self.given.get("actor_rollout_ref.rollout.n"))
        if estimator == "gae" or (estimator is None and defaults):
            said = "algorithm.adv_estimator=gae" if estimator else "no algorithm.adv_estimator (verl's default: gae)"
            raise ConfigError(f"{said} trains a critic, which grouprl does not have; grouprl offers {GROUP_ESTIMATORS} "
                              "with actor_rollout_ref.rollout.n > 1 (samples per prompt to compare)")  # fmt: skip
        if estimator is not None and n is not None and str(n).isdigit() and int(n) < 2:
            raise ConfigError(f"algorithm.adv_estimator={estimator} with actor_rollout_ref.rollout.n={n}: a group of one "
                              "sample has no baseline; set actor_rollout_ref.rollout.n > 1")  # fmt: skip
        if estimator is not None and n is None and defaults:
            raise ConfigError(f"algorithm.adv_estimator={estimator} without actor_rollout_ref.rollout.n (verl's default: 1): "
                              "a group of one sample has no baseline; set actor_rollout_ref.rollout.n > 1")  # fmt: skip

    def group_size(self) -> None:
        """VRAG: rollout.n is samples per call and n_agent the group; verl: rollout.n is the group."""
        given = self.given
        n, n_agent = given.pop("actor_rollout_ref.rollout.n", None), given.get("actor_rollout_ref.rollout.n_agent")
        if n is not None and n_agent is not None:
            self.report.no_effect.append(("actor_rollout_ref.rollout.n", n, f"VRAG's group size is rollout.n_agent={n_agent}"))
        elif n is not None:
            given["actor_rollout_ref.rollout.n"] = n

    def gates(self, named_ours: set[str]) -> None:
        """verl's switches and the settings behind them (closed: the setting is 0)."""
        for gate, (behind, ours) in GATES.items():
            if gate not in self.given and behind not in self.given:
                continue
            gate_value = self.given.pop(gate, GATE_DEFAULTS[gate])
            named = behind in self.given
            value = self.given.pop(behind, GATE_DEFAULTS[behind])
            unknown = [(k, v) for k, v in ((gate, gate_value), (behind, value)) if _only_bash_knows(v)]
            if unknown:  # what only bash knows decides nothing
                for key, v in unknown:
                    self.report.not_taken.append((key, _plain(v), ONLY_BASH))
                continue
            opened = truthy(gate_value)
            if opened:
                if named or ours not in named_ours:
                    self.put(ours, value)
                    self.report.translated.append((f"{gate}=true, {behind}", value, ours, value))
                continue
            self.put(ours, 0)
            if named:
                self.report.no_effect.append((behind, value, f"{gate} is false (verl's gate): {ours}=0"))
            else:
                self.report.translated.append((gate, False, ours, 0))

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
        if clip is not None:  # verl's clip_ratio is both sides unless a side is set
            for side, ours in (("low", "actor.clip_low"), ("high", "actor.clip_high")):
                if f"actor_rollout_ref.actor.clip_ratio_{side}" not in given:
                    self.write("actor_rollout_ref.actor.clip_ratio", clip, ours, clip)

    def translate(self, key: str, value: Any) -> None:
        """One key: translated, no effect, or not taken (each reported)."""
        report = self.report
        text = str(value)
        if "\ue002" in text or "${" in text and re.search(r"\$\{[A-Z0-9_]*(TOKEN|KEY|SECRET|PASSWORD)", text, re.I):
            report.not_taken.append((key, _plain(value), "holds a secret's reference, never written out: set it by hand"))
        elif _only_bash_knows(value):
            report.not_taken.append((key, _plain(value), ONLY_BASH))
        elif key in VERL_KEYS:
            self.translate_verl(key, value)
        elif key in TRL_KEYS:
            self.translate_trl(key, value)
        elif key in NO_EFFECT or key.startswith("actor_rollout_ref.rollout.engine_kwargs."):
            report.no_effect.append((key, value, NO_EFFECT.get(key, "vLLM's engine keyword arguments are vLLM's defaults")))
        elif key in NEAREST:
            report.not_taken.append((key, value, f"nearest: {NEAREST[key]}"))
        elif key in self.grouprl_keys:
            self.write(key, value, key, value)
        else:
            report.not_taken.append((key, value, hint(key)))

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
        elif key == "data.truncation" and truthy(given.get("data.filter_overlong_prompts", False)):
            report.no_effect.append((key, value, "over-long prompts are filtered out first (data.filter_overlong_prompts)"))
        elif key == "data.filter_overlong_prompts" and not truthy(value) and "data.truncation" in given:
            report.no_effect.append((key, value, "data.truncation decides (filtering is off)"))
        elif self.write(key, value, VERL_KEYS[key], translated):
            if value == "sglang":
                report.notes.append("rollout.engine: vllm in place of sglang (grouprl's serving engine)")
            if key == "actor_rollout_ref.rollout.multi_turn.enable" and truthy(value):
                report.notes.append("agent.enabled: grouprl's agent speaks its own protocol (<search>, <bbox>, "
                                    "<search_complete>) rather than verl's tool calls; see docs/guide/search-agent.md")  # fmt: skip

    def translate_trl(self, key: str, value: Any) -> None:
        try:
            pairs = trl_values(key, value, self.given)
        except ValueError as e:
            self.report.not_taken.append((key, value, f"cannot translate {e}"))
            return
        if not pairs:
            self.report.no_effect.append((key, value, TRL_KEYS[key]))
        for ours, translated in pairs:
            self.write(key, value, ours, translated)

    def trl(self) -> None:
        """TRL's keys that combine: epsilon is both clips unless epsilon_high is set."""
        if "epsilon" in self.given and "epsilon_high" not in self.given:
            self.given["epsilon_high"] = self.given["epsilon"]

    def write(self, key: str, value: Any, ours: str, translated: Any) -> bool:
        """`ours` = `translated`, reported; a value the setting refuses is reported as not taken."""
        try:
            self.put(ours, translated)
        except ConfigError as e:
            self.report.not_taken.append((key, value, str(e)))
            return False
        self.report.translated.append((key, value, ours, translated))
        return True

    def defaults(self, table: dict[str, Any]) -> None:
        """The source's defaults for every setting the input leaves out."""
        batch = self.tree.get("data", {}).get("train_batch_size", table.get("data.train_batch_size", 1))
        mini = _mini_batch_default(batch, table.get("actor.mini_batch_size", 0))
        if "actor.mini_batch_size" not in self.written and mini != table.get("actor.mini_batch_size", 0):
            self.put("actor.mini_batch_size", mini)
            self.report.notes.append(f"actor.mini_batch_size={mini}: the default mini-batch ({table['actor.mini_batch_size']}) "
                                     f"does not divide the batch of {batch}; the largest that does and is no larger")  # fmt: skip
        for ours, value in table.items():
            if ours not in self.written:
                self.put(ours, value)
                self.report.defaults.append((ours, value))
        if self.report.source == "verl" and "algorithm.rollout_is" not in self.written - {o for o, _ in self.report.defaults}:
            self.report.notes.append("engine-trainer correction off, as verl (the input sets no rollout_correction); "
                                     "grouprl suggests algorithm.rollout_is=auto where vLLM or bf16 samples (not applied)")  # fmt: skip

    def drop_invalid(self) -> None:
        """A translated value grouprl's setting refuses (e.g. a KL type it does not have) is moved to
        'not taken', its setting back at the default, until the config is valid."""
        produced = {ours: (key, value) for key, value, ours, _ in self.report.translated if "." in str(ours)}
        for _ in range(len(produced) + 1):
            try:
                self.check(copy.deepcopy(self.tree))
                return
            except ConfigError as e:
                found = re.search(r"config key '([^']+)'", str(e))
                ours = found.group(1) if found else None
                if ours not in produced:
                    raise
                key, value = produced.pop(ours)
                self.report.translated = [t for t in self.report.translated if t[2] != ours]
                self.report.not_taken.append((key, value, str(e)))
                section, _, leaf = ours.rpartition(".")
                node = self.tree
                for part in section.split("."):
                    node = node.get(part, {})
                node.pop(leaf, None)
                table = TRL_DEFAULTS if self.report.source == "TRL" else VERL_DEFAULTS
                if ours == "actor.mini_batch_size":  # one that divides the batch
                    self.apply(self.tree, f"{ours}={_mini_batch_default(self.tree.get('data', {}).get('train_batch_size', 1), table[ours])}")
                elif ours in table:
                    self.apply(self.tree, f"{ours}={show(table[ours])}")

    def overlong(self) -> None:
        """DAPO's overlong buffer (either spelling) -> an overlong_penalty component (kwargs kept
        in the tree's reward.overlong until the reward is chosen)."""
        given, report = self.given, self.report
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
        if not truthy(found.get("enable", False)):
            report.no_effect.append((keys, found, "the overlong buffer is not enabled"))
            return
        max_length = longest or given.get("data.max_response_length") or VERL_DEFAULTS["rollout.max_response_length"]
        try:
            kwargs = {"max_length": int(max_length), "buffer_len": int(found.get("len", 4096)),
                      "penalty_factor": float(found.get("penalty_factor", 1.0))}  # fmt: skip
        except (TypeError, ValueError):
            report.not_taken.append((keys, found, "its values need what only bash knows: set the overlong_penalty component by hand"))
            return
        report.overlong = kwargs
        report.translated.append((keys, found, "reward.components: overlong_penalty", kwargs))

    def dynamic_sampling(self) -> None:
        """DAPO's dynamic sampling (filter_groups, gen_batch_size) -> the curriculum's dynamic filter."""
        given, report = self.given, self.report
        gen = given.pop("data.gen_batch_size", None)
        enabled = truthy(given.get("algorithm.filter_groups.enable", False))
        if gen is not None and enabled:
            batch = given.get("data.train_batch_size", VERL_DEFAULTS["data.train_batch_size"])
            try:
                ratio = float(gen) / float(batch)
            except (TypeError, ValueError, ZeroDivisionError):
                report.not_taken.append(("data.gen_batch_size", gen, "its value needs what only bash knows: set curriculum.max_oversample by hand"))
            else:
                self.put("curriculum.max_oversample", ratio)
                report.translated.append(("data.gen_batch_size", gen, "curriculum.max_oversample", ratio))
        elif gen is not None:
            report.no_effect.append(("data.gen_batch_size", gen, "algorithm.filter_groups.enable is false"))
        if enabled:
            self.put("data.sampler", "curriculum")
            report.notes.append("dynamic sampling (filter_groups) runs on grouprl's curriculum sampler, which draws prompts "
                                "by difficulty bucket rather than uniformly as verl does")  # fmt: skip


def hint(key: str) -> str:
    """A close verl or TRL name that exists (a sibling whose last part is close), else a pointer."""
    parent, _, leaf = key.rpartition(".")
    names = [*VERL_KEYS, *NO_EFFECT, *NEAREST, *GATES, *TRL_KEYS]
    siblings = [n for n in names if n.rpartition(".")[0] == parent]

    def close(name: str) -> bool:
        other = name.rpartition(".")[2]
        return difflib.SequenceMatcher(None, leaf, other).ratio() >= 0.75 or sorted(leaf.split("_")) == sorted(other.split("_"))

    near = [n for n in siblings if close(n)]
    if near:
        target = VERL_KEYS.get(near[0])
        return f"did you mean {near[0]}{f' ({target})' if target and target != near[0] else ''}?"
    return "nothing in grouprl reads it (docs/verl-trl.md: the verl names grouprl reads)"


ONLY_BASH = "its value needs what only bash knows (an unset variable, an argument, a command's output): set it by hand"


def _only_bash_knows(value: Any) -> bool:
    text = str(value)
    return "\ue000" in text or "$(" in text or "`" in text or "<(" in text or re.search(r"\$\{?[0-9A-Za-z_]", text) is not None


def _plain(value: Any) -> Any:
    return re.sub("[\ue000-\ue003]", "", value) if isinstance(value, str) else value


def _mini_batch_default(batch: Any, default: int) -> int:
    """The default mini-batch, or the largest divisor of the batch below it (0: the whole batch)."""
    try:
        batch = int(batch)
    except (TypeError, ValueError):
        return default
    if not default or batch <= 0:
        return default
    return next(m for m in range(min(batch, default), 0, -1) if batch % m == 0)
