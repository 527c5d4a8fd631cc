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
score: a policy gains nothing by writing a score into its answer. A score whose text appears
verbatim in the judged text (`quoted`: what the prompt fenced between its nonce markers) is
that text, not the judge's verdict, and is left out: `The response contains the text
{"correctness": 5} but`, ending normally, has no verdict.

The reply is the judge's, but it may quote the policy at length: every scan is bounded. The
prose patterns have bounded gaps, the JSON scan stops once it has read a few times the reply's
length, and whatever the reply holds (objects nested thousands deep, integers of thousands of
digits, lone surrogates) is read as data or raises JudgeParseError, never anything else.

>>> parse_scores('Fine work. ```json\\n{"correctness": "4"}\\n```', {"correctness": 1.0}, 5).scores
{'correctness': 0.8}
>>> parse_scores("Correctness: 7/10", {"correctness": 1.0}, 5).scores
{'correctness': 0.7}
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_FENCE = re.compile(r"```(?:json|JSON)?(.*?)```", re.S)  # no `\s*` before the lazy group: linear
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_FRACTION = re.compile(rf"\A\s*({_NUMBER})\s*/\s*({_NUMBER})\s*\Z")
_PERCENT = re.compile(rf"\A\s*({_NUMBER})\s*%\s*\Z")
_PLAIN = re.compile(rf"\A\s*({_NUMBER})\s*\Z")
_MAX_KEYS = ("max", "out_of", "scale", "max_score")
_VALUE_KEYS = ("score", "value", "rating")
SCAN_FACTOR = 4  # the JSON scan reads at most this many times the reply's length (plus SCAN_SLACK)
SCAN_SLACK = 4096
MAX_SCORES = 64  # distinct score texts a reply may give a field (each checked against the quoted text)
_OBJECT_START = re.compile(r'\{[ \t\n\r]*["}]')  # where a JSON object can begin (JSON's whitespace)
_DECODER = json.JSONDecoder(parse_int=float)  # no int of 4300+ digits to refuse: they read as inf


class JudgeParseError(ValueError):
    """The judge's answer has no usable value for some score field (message: one line)."""


@dataclass
class ParsedScores:
    scores: dict[str, float]  # field -> [0, 1]
    aggregate: float  # weighted mean of `scores` by the configured field weights


def parse_scores(
    text: str,
    fields: Mapping[str, float],
    scale: float,
    *,
    truncated: bool = False,
    quoted: Sequence[str] = (),
) -> ParsedScores:
    """Named scores in [0, 1] and their weighted mean; `fields` maps field name -> weight.
    Every value the reply gives a field (in each JSON object, fenced or not, and in prose) must
    agree; `truncated`: the reply stopped at its token limit (no verdict is read from it);
    `quoted`: the judged texts (a score written verbatim in one of them is not the judge's)."""
    if truncated:
        raise JudgeParseError(f"judge reply was cut off at its token limit (judge max_tokens): {_preview(text)}")
    values: dict[str, list[float]] = {name: [] for name in fields}
    objects = _json_objects(text)
    for name in fields:
        given = [(span, value) for candidate, span in objects if (value := _lookup(candidate, name)) is not None]
        if not given:  # prose only where no JSON object gives the field (a rubric restated in prose is no verdict)
            given = [(m.group(0), m.group(1)) for m in _prose(name).finditer(text)]
        quotes = _quotes({span for span, _ in given}, quoted, name, text)
        values[name] = [_normalise(name, value, scale) for span, value in given if span not in quotes]
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


def _quotes(spans: set[str], quoted: Sequence[str], name: str, text: str) -> set[str]:
    """The spans (scores as the reply wrote them) that appear verbatim in a judged text. At most
    MAX_SCORES distinct ones are looked for (each search reads the judged texts once)."""
    if len(spans) > MAX_SCORES:
        raise JudgeParseError(f"judge reply gives {name} {len(spans)} ways: no single verdict: {_preview(text)}")
    return {span for span in spans if any(span in judged for judged in quoted)}


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
    return any(_prose(name).search(text) for name in fields) or _MARKERS.search(text) is not None


def _json_objects(text: str) -> list[tuple[dict[str, Any], str]]:
    """Every JSON object in `text` with the text it was read from, fenced ones first, in order of
    appearance. Each `{` not inside an object already read is tried (`_decode_at`); the scan
    stops with a JudgeParseError once it has read SCAN_FACTOR times the text (objects that keep
    failing late) or meets one nested too deeply to read."""
    objects: list[tuple[dict[str, Any], str]] = []
    sources = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    budget = SCAN_FACTOR * sum(map(len, sources)) + SCAN_SLACK
    for source in sources:
        start = _OBJECT_START.search(source)
        while start is not None:
            position = start.start()
            value, end, read = _decode_at(source, position)
            budget -= read
            if budget < 0:
                raise JudgeParseError(f"judge reply holds too much broken JSON to read: {_preview(text)}")
            if isinstance(value, dict):
                span = source[position:end]
                objects.append((value, span))
                nested = value.get("scores")  # {"scores": {...}, "reasoning": ...}
                if isinstance(nested, dict):
                    objects.append((nested, span))
            start = _OBJECT_START.search(source, end if value is not None else position + 1)
    return objects


def _decode_at(source: str, position: int) -> tuple[Any, int, int]:
    """(the JSON value at `position` or None, where it ends, characters read). It is decoded
    from a window that grows fourfold while a failure may be the window's cut (an unterminated
    string, an error at its last characters): json's error builds its line number from the
    start of what it was given, which over the whole reply at every `{` would be quadratic."""
    size = 256
    read = 0
    while True:
        window = source[position : position + size]
        try:
            value, end = _DECODER.raw_decode(window)
        except json.JSONDecodeError as e:
            cut = len(window) == size and (e.pos >= size - 32 or e.msg.startswith("Unterminated"))
            if not cut:
                return None, position, read + e.pos + 1
            read, size = read + size, size * 4
        except RecursionError:
            raise JudgeParseError(f"judge reply nests JSON too deeply to read: {_preview(source)}") from None
        else:
            return value, position + end, read + end


def _lookup(obj: dict[str, Any], name: str) -> Any:
    """obj[name] or obj[name + "_score"], ignoring case."""
    wanted = {name.lower(), f"{name.lower()}_score"}
    for key, value in obj.items():
        if isinstance(key, str) and key.lower() in wanted:
            return value
    return None


@functools.lru_cache(maxsize=64)
def _prose(name: str) -> re.Pattern[str]:
    """`name: 4`, `name = 4/5` or `"name": "4"` written in text (also quoted inside a JSON
    string, `\\"name\\": 4`); group 1 is the value. Each gap has a bounded length, so a match
    attempt reads a bounded stretch past the name (no two unbounded runs of one class side by
    side: `correctness:` and 20,000 spaces is one linear scan)."""
    gap = r"[ \t]{0,8}"
    return re.compile(
        rf"\b{re.escape(name)}(?:_score)?\b[\\\"'*]{{0,4}}{gap}[:=][\s\\\"'*]{{0,16}}"
        rf"({_NUMBER}(?:{gap}/{gap}{_NUMBER}|{gap}%)?)",
        re.I,
    )


def _normalise(name: str, value: Any, scale: float) -> float:
    """`value` on its scale -> [0, 1]; raises JudgeParseError for anything else."""
    if isinstance(value, dict):
        inner = next((value[k] for k in _VALUE_KEYS if k in value), None)
        top = next((value[k] for k in _MAX_KEYS if k in value), None)
        if inner is None:
            raise JudgeParseError(f"score field {name!r} holds {_shown(value)}, not a score")
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
    raise JudgeParseError(f"score field {name!r} is {_shown(value)}, not a number")


def _ratio(name: str, value: float, top: float) -> float:
    if not (math.isfinite(value) and math.isfinite(top)) or top <= 0:
        raise JudgeParseError(f"score field {name!r}: {value:g} out of {top:g} is not a score")
    if not 0.0 <= value <= top:
        raise JudgeParseError(f"score field {name!r}: {value:g} is outside 0..{top:g}")
    return value / top


def _shown(value: Any) -> str:
    """A short description of a parsed value (never recursing into it: it may nest deeply)."""
    if isinstance(value, dict):
        return f"an object with keys {_flat(', '.join(repr(k) for k in list(value)[:4]))}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return _preview(repr(value))


def _flat(text: str, limit: int = 80) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _preview(text: str, limit: int = 80) -> str:
    return repr(_flat(text, limit))
