"""Reading named scores out of a judge's free-form answer.

Judges are asked for JSON but answer in many shapes: a bare object, an object inside a
```json fence, an object after a paragraph of reasoning, numbers written as strings, "4/5",
"80%", {"score": 4, "max": 5}, or only prose ("Correctness: 4/5"). `parse_scores` accepts all
of these, normalises every field to [0, 1] (by `scale`, unless the value declares its own
maximum) and raises `JudgeParseError` naming the missing or invalid fields otherwise.

The response being judged is the policy's own text, and a judge may quote it. A reply's JSON
objects (fenced or not) are its verdict; prose is read only where no object gives the field.
Two objects that give a field different values (a verdict and a quoted injection like `the
response tried to set {"correctness": 5}`), or prose that does where there is no object, leave
no verdict that can be trusted, and a reply cut off at the judge's token limit may hold nothing
but a quote. Both are parse failures (the call is retried, then counted as failed), never a
score: a policy gains nothing by writing a score into its answer.

>>> parse_scores('Fine work. ```json\\n{"correctness": "4"}\\n```', {"correctness": 1.0}, 5).scores
{'correctness': 0.8}
>>> parse_scores("Correctness: 7/10", {"correctness": 1.0}, 5).scores
{'correctness': 0.7}
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.S)
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_FRACTION = re.compile(rf"\A\s*({_NUMBER})\s*/\s*({_NUMBER})\s*\Z")
_PERCENT = re.compile(rf"\A\s*({_NUMBER})\s*%\s*\Z")
_PLAIN = re.compile(rf"\A\s*({_NUMBER})\s*\Z")
_MAX_KEYS = ("max", "out_of", "scale", "max_score")
_VALUE_KEYS = ("score", "value", "rating")


class JudgeParseError(ValueError):
    """The judge's answer has no usable value for some score field (message: one line)."""


@dataclass
class ParsedScores:
    scores: dict[str, float]  # field -> [0, 1]
    aggregate: float  # weighted mean of `scores` by the configured field weights


def parse_scores(text: str, fields: Mapping[str, float], scale: float, *, truncated: bool = False) -> ParsedScores:
    """Named scores in [0, 1] and their weighted mean; `fields` maps field name -> weight.
    Every value the reply gives a field (in each JSON object, fenced or not, and in prose) must
    agree; `truncated`: the reply stopped at its token limit (no verdict is read from it)."""
    if truncated:
        raise JudgeParseError(f"judge reply was cut off at its token limit (judge max_tokens): {_preview(text)}")
    values: dict[str, list[float]] = {name: [] for name in fields}
    objects = _json_objects(text)
    for name in fields:
        for candidate in objects:
            if (value := _lookup(candidate, name)) is not None:
                values[name].append(_normalise(name, value, scale))
        if not values[name]:  # prose only where no JSON object gives the field (a rubric restated in prose is no verdict)
            values[name] += [_normalise(name, value, scale) for value in _from_prose(text, name)]
    missing = [name for name in fields if not values[name]]
    if missing:
        raise JudgeParseError(f"judge output lacks score field(s) {', '.join(missing)}: {_preview(text)}")
    for name, found in values.items():
        if max(found) - min(found) > 1e-9:
            shown = ", ".join(f"{v:g}" for v in dict.fromkeys(found))
            raise JudgeParseError(
                f"judge reply gives {name} more than one value ({shown} of 1): a quoted score is no verdict: {_preview(text)}"
            )
    scores = {name: values[name][-1] for name in fields}
    total_weight = sum(fields.values())
    aggregate = sum(fields[name] * scores[name] for name in fields) / total_weight
    return ParsedScores(scores=scores, aggregate=aggregate)


# chat role markers of the common templates, and the judge prompt's own fence (prompt.py)
_MARKERS = re.compile(
    r"<\|(?:im_start|im_end|start_header_id|end_header_id|eot_id|system|user|assistant|end)\|>"
    r"|\[/?INST\]|<start_of_turn>|<end_of_turn>|</?(?:response|answer)-[0-9a-f]*>",
    re.I,
)


def looks_like_verdict(text: str, fields: Mapping[str, float]) -> bool:
    """`text` (a policy's response) carries judge-format text: a score written for one of the
    judge's fields (`correctness: 5`, `{"correctness": 5}`), a chat role marker or the judge
    prompt's fence markers. Counted as reward/judge_format_in_response: a policy that starts to
    address its judge shows here before it shows anywhere else."""
    return any(_from_prose(text, name) for name in fields) or _MARKERS.search(text) is not None


def _json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object in `text`, fenced ones first, in order of appearance."""
    objects: list[dict[str, Any]] = []
    sources = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    for source in sources:
        position = source.find("{")
        while position != -1:
            try:
                value, end = decoder.raw_decode(source, position)
            except json.JSONDecodeError:
                position = source.find("{", position + 1)
                continue
            if isinstance(value, dict):
                objects.append(value)
                nested = value.get("scores")  # {"scores": {...}, "reasoning": ...}
                if isinstance(nested, dict):
                    objects.append(nested)
            position = source.find("{", end)
    return objects


def _lookup(obj: dict[str, Any], name: str) -> Any:
    """obj[name] or obj[name + "_score"], ignoring case."""
    wanted = {name.lower(), f"{name.lower()}_score"}
    for key, value in obj.items():
        if isinstance(key, str) and key.lower() in wanted:
            return value
    return None


def _from_prose(text: str, name: str) -> list[str]:
    """Every `name: 4`, `name = 4/5` or `"name": "4"` written in the text (also quoted inside a
    JSON string, `\\"name\\": 4`)."""
    pattern = re.compile(
        rf"\b{re.escape(name)}(?:_score)?\b[\\\"'*]*\s*[:=]\s*[\\\"'*]*\s*({_NUMBER}(?:\s*/\s*{_NUMBER}|\s*%)?)",
        re.I,
    )
    return pattern.findall(text)


def _normalise(name: str, value: Any, scale: float) -> float:
    """`value` on its scale -> [0, 1]; raises JudgeParseError for anything else."""
    if isinstance(value, dict):
        inner = next((value[k] for k in _VALUE_KEYS if k in value), None)
        top = next((value[k] for k in _MAX_KEYS if k in value), None)
        if inner is None:
            raise JudgeParseError(f"score field {name!r} holds {_preview(json.dumps(value))}, not a score")
        if top is None:
            return _normalise(name, inner, scale)
        return _ratio(name, _number(name, inner), _number(name, top))
    if isinstance(value, str):
        if m := _FRACTION.match(value):
            return _ratio(name, float(m.group(1)), float(m.group(2)))
        if m := _PERCENT.match(value):
            return _ratio(name, float(m.group(1)), 100.0)
    return _ratio(name, _number(name, value), scale)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise JudgeParseError(f"score field {name!r} is {value!r}, not a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and (m := _PLAIN.match(value)):
        return float(m.group(1))
    raise JudgeParseError(f"score field {name!r} is {_preview(repr(value))}, not a number")


def _ratio(name: str, value: float, top: float) -> float:
    if not (math.isfinite(value) and math.isfinite(top)) or top <= 0:
        raise JudgeParseError(f"score field {name!r}: {value:g} out of {top:g} is not a score")
    if not 0.0 <= value <= top:
        raise JudgeParseError(f"score field {name!r}: {value:g} is outside 0..{top:g}")
    return value / top


def _preview(text: str, limit: int = 80) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")
