"""Rule rewards for `<think>...</think>\\n<answer>...</answer>` responses (the GSM8K recipe).

Every reward is a plain function `fn(response, ground_truth=None, **kwargs) -> float`;
`CompositeReward` passes `prompt`, `extra_info`, `sample` and `trajectory` to functions
that take `**kwargs`. The recipe (willccbb's GRPO GSM8K demo, adapted by AtomicGPT) used
`<reasoning>`/`<answer>` tags with newlines inside them; here the tags are `<think>` and
`<answer>`, and no newline is required inside a tag, because that is the shape our prompts
show the model (`<think>7 + 5 = 12</think>\\n<answer>12</answer>`).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from typing import Any

from .verl_scorers import VERL_RULES, gsm8k, search_em  # noqa: F401  (gsm8k, search_em: named here too)

# The content of one <answer> block that holds no further <answer> opening, so that
# "<answer>a<answer>b</answer>" yields "b", not "a<answer>b".
_ANSWER_BLOCK = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.S)

# A number inside free text. A minus is a sign only when it does not follow a word
# character or a closing bracket, so "7-2" reads as 7 and 2, not 7 and -2. Thousands
# separators must come in groups of three ("1,234"), so "1, 2, 3" stays three numbers.
_NUMBER_IN_TEXT = re.compile(
    r"(?P<sign>(?<![\w)\]])-)?\$?(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?"
)
# A whole string that is one number: "42", "-3", "1,234", "4.50", "$12", "12%".
_NUMBER_LITERAL = re.compile(r"(?P<sign>[-+])?\$?(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?%?")
_INTEGER_LITERAL = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)")

_STRICT_WITH_THINK = re.compile(r"\A\s*<think>.*?</think>\n<answer>(?P<answer>.*?)</answer>\s*\Z", re.S)
_STRICT_THINK_OPTIONAL = re.compile(
    r"\A\s*(?:<think>.*?</think>\n)?<answer>(?P<answer>.*?)</answer>\s*\Z", re.S
)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _as_float(match: re.Match[str]) -> float:
    sign = -1.0 if match.group("sign") == "-" else 1.0
    return sign * float(match.group("int").replace(",", "") + (match.group("frac") or ""))


def extract_answer(text: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` block, or None.

    >>> extract_answer("<think>7 + 5</think>\\n<answer> 12 </answer>")
    '12'
    >>> extract_answer("<answer>1</answer> then <answer>2</answer>")
    '2'
    >>> extract_answer("<answer>a<answer>b</answer>")
    'b'
    >>> extract_answer("the answer is 12") is None
    True
    """
    blocks = _ANSWER_BLOCK.findall(text)
    return blocks[-1].strip() if blocks else None


def extract_number(text: str) -> float | None:
    """The last number in `text`, or None. Understands "1,234", "-3", "4.50", "$12", "12%".

    >>> extract_number("costs $1,234.50 in total")
    1234.5
    >>> extract_number("from -3 to 12%")
    12.0
    >>> extract_number("it is -3.")
    -3.0
    >>> extract_number("7-2")
    2.0
    >>> extract_number("1, 2, 3")
    3.0
    >>> extract_number("no digits") is None
    True
    """
    numbers_found = list(_NUMBER_IN_TEXT.finditer(text))
    return _as_float(numbers_found[-1]) if numbers_found else None


def _parse_literal(text: str) -> float | None:
    match = _NUMBER_LITERAL.fullmatch(text.strip())
    return _as_float(match) if match else None


def _normalise(text: str) -> str:
    return " ".join(text.split()).lower()


def _matches(predicted: str, truth: Any) -> bool:
    if isinstance(truth, (list, tuple)):  # several acceptable answers
        return any(_matches(predicted, t) for t in truth)
    if isinstance(truth, numbers.Real) and not isinstance(truth, bool):
        expected: float | None = float(truth)
    else:
        truth = str(truth)
        if "####" in truth:  # GSM8K solutions end with "#### <answer>"
            truth = truth.rsplit("####", 1)[1]
        expected = _parse_literal(truth)
    if expected is None:
        return _normalise(predicted) == _normalise(str(truth))
    value = extract_number(predicted)
    return value is not None and math.isclose(value, expected, rel_tol=1e-6, abs_tol=1e-9)


def correctness(
    response: str, ground_truth: Any = None, *, allow_last_number: bool = False, **kwargs
) -> float:
    """1.0 when the answer equals the ground truth, else 0.0.

    The answer is the last `<answer>` block; with `allow_last_number=True` a response with
    no `<answer>` block is judged by its last number instead (a textual ground truth must
    then equal the whole response). Numeric ground truths (int,
    float, "42", "1,234", "#### 42") are compared with the last number inside the answer,
    relative tolerance 1e-6; any other ground truth must equal the answer after collapsing
    whitespace and lower-casing. A list of ground truths accepts any of them. A missing
    ground truth raises (the composite counts it as an error, so it shows in the logs).

    >>> correctness("<think>7 + 5</think>\\n<answer>12</answer>", 12)
    1.0
    >>> correctness("<answer>$1,234.00</answer>", "#### 1234")
    1.0
    >>> correctness("<answer>13</answer>", "12")
    0.0
    >>> correctness("so 7 + 5 = 12", "12")
    0.0
    >>> correctness("so 7 + 5 = 12", "12", allow_last_number=True)
    1.0
    >>> correctness("<answer> New  York </answer>", "new york")
    1.0
    """
    if ground_truth is None:
        raise ValueError("correctness needs a ground truth; the sample has none")
    answer = extract_answer(response)
    if answer is None:
        if not allow_last_number:
            return 0.0
        answer = response  # _matches reads its last number
    return 1.0 if _matches(answer, ground_truth) else 0.0


def strict_format(response: str, ground_truth: Any = None, *, require_think: bool = True, **kwargs) -> float:
    """1.0 when the whole response is `<think>...</think>\\n<answer>...</answer>`, else 0.0.

    Rules: whitespace may surround the response; exactly one newline separates
    `</think>` from `<answer>`; each tag occurs exactly once; the answer is not blank;
    nothing but whitespace follows `</answer>`. With `require_think=False` the think block
    (with its newline) may be left out, but if present it must have the same shape.

    >>> strict_format("<think>7 + 5 = 12</think>\\n<answer>12</answer>\\n")
    1.0
    >>> strict_format("<think>7 + 5 = 12</think> <answer>12</answer>")
    0.0
    >>> strict_format("<think>ok</think>\\n<answer>12</answer> done")
    0.0
    >>> strict_format("<think>ok</think>\\n<answer> </answer>")
    0.0
    >>> strict_format("<answer>12</answer>")
    0.0
    >>> strict_format("<answer>12</answer>", require_think=False)
    1.0
    """
    pattern = _STRICT_WITH_THINK if require_think else _STRICT_THINK_OPTIONAL
    match = pattern.match(response)
    if match is None or not match.group("answer").strip():
        return 0.0
    # The pattern's lazy bodies could still swallow extra tags ("<think>a</think>\n<answer>..."
    # inside the think block); counting rules them out.
    think_blocks = 1 if response.lstrip().startswith("<think>") else 0
    for tag in _TAGS:
        if response.count(tag) != (think_blocks if "think" in tag else 1):
            return 0.0
    return 1.0


def soft_format(response: str, ground_truth: Any = None, *, eos_token: str | None = None, **kwargs) -> float:
    """1.0 when one `<answer>...</answer>` block appears and only whitespace follows it.

    The lenient format check: the block may sit anywhere and need not follow a think block.
    `eos_token` (e.g. "<|im_end|>"), when given, may also trail the block.

    >>> soft_format("Let me see. 7 + 5 = 12 <answer>12</answer>  ")
    1.0
    >>> soft_format("<answer>12</answer><|im_end|>", eos_token="<|im_end|>")
    1.0
    >>> soft_format("<answer>12</answer> is my answer")
    0.0
    >>> soft_format("<answer>1</answer><answer>2</answer>")
    0.0
    """
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return 0.0
    start, end = response.index("<answer>"), response.index("</answer>")
    if end < start:
        return 0.0
    trailing = response[end + len("</answer>") :]
    if eos_token:
        trailing = trailing.replace(eos_token, "")
    return 1.0 if not trailing.strip() else 0.0


def xml_count(response: str, ground_truth: Any = None, **kwargs) -> float:
    """Partial credit for the tags, 0.125 each, so a model learns the shape tag by tag.

    The tags are taken in the order `<think>`, `</think>`, `<answer>`, `</answer>`. A tag
    earns 0.125 when it occurs exactly once and after every earlier tag in that order that
    also occurs exactly once. When `</answer>` earns its 0.125, it loses 0.001 per character
    of the text after it, surrounding whitespace excluded (at most the 0.125 it earned), so the value
    stays in [0, 0.5]. The recipe counted "<reasoning>\\n"-style tags with newlines and
    penalised trailing text twice, without a floor; here newlines are not required and the
    penalty is counted once.

    >>> xml_count("<think>7 + 5 = 12</think>\\n<answer>12</answer>\\n")
    0.5
    >>> xml_count("<answer>12</answer>")
    0.25
    >>> xml_count("<think>x</think>\\n<answer>12</answer> ok")
    0.498
    >>> xml_count("</think><think>")
    0.125
    >>> xml_count("no tags")
    0.0
    """
    score = 0.0
    placed_until = -1  # end of the last tag that earned credit
    for tag in _TAGS:
        if response.count(tag) != 1:
            continue
        position = response.index(tag)
        if position < placed_until:
            continue
        score += 0.125
        placed_until = position + len(tag)
        if tag == "</answer>":
            trailing = response[placed_until:].strip()
            score -= min(0.125, 0.001 * len(trailing))
    return round(score, 6)  # keeps 0.5 - 0.002 printing as 0.498


def contains_integer(response: str, ground_truth: Any = None, **kwargs) -> float:
    """1.0 when the `<answer>` content is an integer literal ("12", "-3", "1,234"), else 0.0.

    >>> contains_integer("<answer>12</answer>")
    1.0
    >>> contains_integer("<answer>-1,234</answer>")
    1.0
    >>> contains_integer("<answer>12.5</answer>")
    0.0
    >>> contains_integer("<answer>twelve</answer>")
    0.0
    >>> contains_integer("12")
    0.0
    """
    answer = extract_answer(response)
    return 1.0 if answer is not None and _INTEGER_LITERAL.fullmatch(answer) else 0.0


def overlong_penalty(
    trajectory: Any, *, max_length: int, buffer_len: int, penalty_factor: float = 1.0, **kwargs
) -> float:
    """DAPO's overlong reward shaping (arXiv 2503.14476; verl's `reward_model.overlong_buffer`):
    0 up to `max_length - buffer_len` response tokens, then falling linearly to `-penalty_factor`
    at `max_length` (a response the length limit cut off gets the whole penalty):

        penalty = min(-(L - (max_length - buffer_len)) / buffer_len * penalty_factor, 0)

    Add it as a component of weight 1 beside the task reward (DAPO adds it to the score);
    `max_length` is the run's rollout.max_response_length.

    >>> from types import SimpleNamespace as T
    >>> [overlong_penalty(T(response_ids=[0] * n), max_length=10, buffer_len=4) for n in (5, 6, 8, 10)]
    [0.0, 0.0, -0.5, -1.0]
    """
    if not 0 < buffer_len <= max_length:
        raise ValueError(f"overlong_penalty needs 0 < buffer_len <= max_length, got {buffer_len} and {max_length}")
    exceed = len(trajectory.response_ids) - (max_length - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (braces balanced), or None.

    >>> last_boxed(r"so \boxed{\frac{1}{2}} and then \boxed{3}")
    '3'
    >>> last_boxed(r"\boxed{\frac{1}{2}}")
    '\\frac{1}{2}'
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def _math_text(text: str) -> str:
    r"""A light normalisation of a math answer: spaces, \left / \right, \! and \, , dfrac and
    tfrac, a trailing period, surrounding $ and a degree sign dropped."""
    text = str(text).strip().strip("$").rstrip(".")
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("dfrac", "frac"),
                     ("tfrac", "frac"), ("^{\\circ}", ""), ("^\\circ", ""), ("\\%", ""), ("%", "")):  # fmt: skip
        text = text.replace(old, new)
    return "".join(text.split())


def boxed(response: str, ground_truth: Any = None, **kwargs) -> float:
    r"""verl's scorers for MATH-style data (`lighteval/MATH`, `geo3k`, `math_dapo`, ...), with a
    light normalisation: 1.0 when the last `\boxed{}` content equals the ground truth after
    `_math_text` (verl's own graders accept more equivalent forms: sympy, mathruler).

    >>> boxed(r"thus \boxed{\dfrac{1}{2}}.", r"\frac{1}{2}")
    1.0
    >>> boxed(r"\boxed{ 30^\circ }", "30")
    1.0
    >>> boxed("1/2", "1/2")
    0.0
    """
    answer = last_boxed(response)
    return 1.0 if answer is not None and _math_text(answer) == _math_text(ground_truth) else 0.0


RULES: dict[str, Callable[..., float]] = {
    "boxed": boxed,
    "overlong_penalty": overlong_penalty,
    "correctness": correctness,
    "strict_format": strict_format,
    "soft_format": soft_format,
    "xml_count": xml_count,
    "contains_integer": contains_integer,
}

RULES.update(VERL_RULES)
