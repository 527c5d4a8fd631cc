r"""verl's default scorers (`verl.utils.reward_score.default_compute_score`), chosen by a
sample's `data_source` as verl chooses them, with verl's values:

- `openai/gsm8k`: `gsm8k`: the last `#### n` of the last 300 characters, 1 or 0.
- `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`:
  `math_verl`: the last `\boxed{}` (or `\boxed x`), equal to the truth after the Hendrycks MATH
  normalisation (fractions, square roots, units, `0.5` as `\frac{1}{2}`, `a/b`), 1 or 0.
- `math_dapo`, `math`, `math_dapo_reasoning`, `aime*`: `math_dapo`: the last `Answer: x` line
  of the last 300 characters, equal to the truth after Minerva's normalisation: +1, else -1
  (DAPO's prompts ask for "Answer:"; a `\boxed{}` answer alone scores -1, as in verl).
- `hiyouga/geometry3k`: `geo3k`: 0.9 x accuracy + 0.1 x format (`<think>...</think>` then a
  `\boxed{}`). verl grades accuracy with mathruler (string normalisation, then sympy); here the
  same normalisation and rules (an integer truth wants an integer answer, unreduced fractions
  must match as written), then a numeric comparison of `\frac`, `\sqrt`, `\pi` and arithmetic in
  place of sympy's symbolic one: answers with letters are compared as text only.
- `searchR1_*` (and the plain names nq, triviaqa, ...): `search_em`: the last
  `<answer>` equal, normalised, to a target: 1; a quarter when the response holds more than 10
  `<answer>` or `</answer>` tags; else 0.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any

_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
SEARCH_R1_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")


def verl_scorer(data_source: str) -> str | None:
    """The built-in rule verl's default scorer uses for `data_source`, or None."""
    if data_source == "openai/gsm8k":
        return "gsm8k"
    if data_source in _MATH_SOURCES:
        return "math_verl"
    if data_source in ("math_dapo", "math", "math_dapo_reasoning") or data_source.startswith("aime"):
        return "math_dapo"
    if data_source == "hiyouga/geometry3k":
        return "geo3k"
    if data_source.startswith("searchR1_") or data_source in SEARCH_R1_SOURCES:
        return "search_em"
    return None


_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k(response: str, ground_truth: Any = None, **kwargs) -> float:
    r"""verl's default scorer for `openai/gsm8k` (strict): the last `#### <number>` in the
    response's last 300 characters, commas and dollar signs removed, equal to the ground truth
    as text: 1.0, else 0.0.

    >>> gsm8k("so 3 + 4 = 7\n#### 7", "7")
    1.0
    >>> gsm8k("#### 1,234", "1234")
    1.0
    >>> gsm8k("the answer is 7", "7")
    0.0
    """
    found = _GSM8K_ANSWER.findall(response[-300:])
    return 1.0 if found and found[-1].replace(",", "").replace("$", "") == str(ground_truth) else 0.0


def _qa_text(text: str) -> str:
    """Search-R1's answer normalisation: lower case, punctuation and articles removed, spaces collapsed."""
    import string

    text = "".join(ch for ch in str(text).lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def search_em(response: str, ground_truth: Any = None, **kwargs) -> float:
    """verl's search-R1 scorer (exact match): the last `<answer>` equal, normalised, to one of
    the ground truth's `target` answers (a dict {"target": [...]}, a list, or one string); a
    quarter of that when the response holds more than 10 `<answer>` or `</answer>` tags.

    >>> search_em("<answer>The Eiffel Tower</answer>", {"target": ["eiffel tower", "tour eiffel"]})
    1.0
    >>> search_em("<answer>Paris</answer>", {"target": ["eiffel tower"]})
    0.0
    """
    matches = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    if not matches:
        return 0.0
    targets = ground_truth.get("target", []) if isinstance(ground_truth, dict) else ground_truth
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    if _qa_text(matches[-1].strip()) not in {_qa_text(t) for t in targets}:
        return 0.0
    return 0.25 if response.count("<answer>") > 10 or response.count("</answer>") > 10 else 1.0  # verl's cap on tag spam


# ----------------------------------------------------------------------------- MATH (Hendrycks)
def _last_boxed_math(text: str) -> str | None:
    r"""The last `\boxed{...}` (or `\fbox{...}`, braces balanced), or `\boxed x` up to a `$`."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if text[end] == "}" and depth == 0:
            return text[start : end + 1]
    return None


def _unbox(boxed: str) -> str:
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError("not a \\boxed{} answer")  # \fbox{...}: verl's scorer fails and gives 0
    return boxed[len("\\boxed{") : -1]


def _hendrycks(text: str) -> str:
    """The MATH answer normalisation (ValueError where verl's raises: the texts are then compared as written)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):  # fmt: skip
        text = text.replace(old, new)
    if "\\text{ " in text:  # units on the right
        parts = text.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError("units written twice")
        text = parts[0]
    text = text.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> "3"
        text = sides[1]
    text = _braced_after(text, "\\sqrt", 1).replace(" ", "")
    text = _fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    halves = text.split("/")
    if len(halves) == 2 and re.fullmatch(r"-?[0-9]+", halves[0]) and re.fullmatch(r"-?[0-9]+", halves[1]):
        if text == f"{int(halves[0])}/{int(halves[1])}":
            text = f"\\frac{{{int(halves[0])}}}{{{int(halves[1])}}}"
    return text


def _braced_after(text: str, command: str, count: int) -> str:
    r"""`\sqrt3` -> `\sqrt{3}`: the character after `command` braced where it is not already."""
    pieces = text.split(command)
    out = pieces[0]
    for piece in pieces[1:]:
        if not piece:
            raise ValueError(f"{command} at the end")
        out += command + (piece if piece[0] == "{" else "{" + piece[:count] + "}" + piece[count:])
    return out


def _fracs(text: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{2}` -> `\frac{1}{2}`."""
    pieces = text.split("\\frac")
    out = pieces[0]
    for piece in pieces[1:]:
        out += "\\frac"
        if piece[:1] == "{":
            out += piece
            continue
        if len(piece) < 2:
            return text
        a, b, rest = piece[0], piece[1], piece[2:]
        out += f"{{{a}}}{{{b}}}{rest}" if b != "{" else f"{{{a}}}{b}{rest}"
    return out


def math_verl(response: str, ground_truth: Any = None, **kwargs) -> float:
    r"""verl's scorer for MATH data: the last `\boxed{}` equal to the truth after the Hendrycks
    normalisation, 1.0, else 0.0.

    >>> math_verl(r"so \boxed{\dfrac{1}{2}}", r"\frac{1}{2}"), math_verl(r"\boxed{0.5}", r"\frac12")
    (1.0, 1.0)
    >>> math_verl("Answer: 2", "2")
    0.0
    """
    boxed = _last_boxed_math(response)
    if boxed is None:
        return 0.0
    try:
        answer = _unbox(boxed)
    except ValueError:
        return 0.0
    truth = str(ground_truth)
    try:
        return 1.0 if _hendrycks(answer) == _hendrycks(truth) else 0.0
    except (ValueError, IndexError):
        return 1.0 if answer == truth else 0.0


# ----------------------------------------------------------------------------- DAPO (Minerva)
_REPLACED = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
             (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]  # fmt: skip
_DROPPED = ("square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits cents "
            "degrees cm gm pounds meters meals edges students childrentickets multiples \\text{s} \\text{.} "
            "\\text{\ns} \\text{}^2 \\text{}^3 \\text{\n} \\text{} \\mathrm{th} ^\\circ ^{\\circ} \\; ,\\! {,} \" \\dots")  # fmt: skip


def minerva_normalise(answer: str) -> str:
    """Minerva's final-answer normalisation (as verl's math_dapo scorer applies it)."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACED:
        answer = answer.replace(old, new)
    for dropped in _DROPPED.split(" "):
        answer = answer.replace(dropped, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(rf"(\\{command}\{{)(.*?)(\}})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer).replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def math_dapo(response: str, ground_truth: Any = None, **kwargs) -> float:
    r"""verl's scorer for DAPO's math and AIME: the last `Answer: x` line of the response's last
    300 characters, equal to the truth after Minerva's normalisation: 1.0, else -1.0.

    >>> math_dapo("... so the total is 42.\nAnswer: 42", "42"), math_dapo(r"\boxed{42}", "42")
    (1.0, -1.0)
    """
    found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", response[-300:])
    predicted = minerva_normalise(found[-1] if found else "[INVALID]")
    return 1.0 if predicted == minerva_normalise(str(ground_truth)) else -1.0


# ----------------------------------------------------------------------------- geo3k
_GEO_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.S)
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard")  # fmt: skip


def boxed_content(text: str) -> str:
    r"""The stripped content of the last `\boxed{` (braces balanced), or "None"."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return "None"
    depth = 0
    for i in range(start + len("\\boxed{"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == -1:
            return text[start + len("\\boxed{") : i].strip()
    return "None"


def _geo_text(answer: str) -> str:
    """mathruler's string normalisation, without its LaTeX-to-text step (done numerically below)."""
    whole = re.fullmatch(r"\\text\{(.+?)\}", answer)
    answer = whole.group(1) if whole else answer
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):  # fmt: skip
        answer = answer.replace(old, new)
    for unit in _UNITS:
        answer = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", answer)
    answer = re.sub(r"\^ *\\circ", "", answer)
    if answer[:1] == "{" and answer[-1:] == "}":
        answer = answer[1:-1]
    answer = re.sub(r",\\! *", "", answer)
    try:
        if float(answer) == round(float(answer)):
            answer = str(int(round(float(answer))))
    except (ValueError, OverflowError):
        pass
    answer = re.sub(r"- *", "-", answer)
    answer = re.sub(r"([0-9]) +([0-9])", r"\1+\2", answer).replace(" ", "").replace("{", "").replace("}", "").lower()
    if re.fullmatch(r"-?[0-9]+(\.0*)?", answer.replace(",", "")):
        answer = str(int(float(answer.replace(",", ""))))
    return answer


_NUMERIC_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
                ast.Pow: operator.pow}  # fmt: skip


def _numeric(latex: str) -> float | None:
    r"""The value of a numeric LaTeX answer (`3\sqrt{3}`, `\frac{40}{3}`, `2\pi`), or None."""
    text = latex.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\left", "").replace("\\right", "")
    text = re.sub(r"\^\s*\{?\\circ\}?", "", text).replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "(pi)")
    for _ in range(8):
        text = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", text)
        text = re.sub(r"\\sqrt\{([^{}]*)\}", r"((\1)**0.5)", text)
    text = re.sub(r"\\sqrt([0-9])", r"((\1)**0.5)", text).replace("^", "**").replace("{", "(").replace("}", ")")
    text = re.sub(r"([0-9)])\s*\(", r"\1*(", text)
    text = re.sub(r"\)\s*([0-9])", r")*\1", text).replace(",", "")
    if len(text) > 200 or re.search(r"[a-oq-z\\]", text.replace("pi", "")):
        return None
    try:
        return _evaluate(ast.parse(text.replace("pi", str(math.pi)), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def _evaluate(node) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _NUMERIC_OPS:
        if isinstance(node.op, ast.Pow) and abs(_evaluate(node.right)) > 64:
            raise ValueError("exponent too large")
        return _NUMERIC_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a number")


def geo3k_accuracy(answer: str, truth: str) -> float:
    if answer == truth or _geo_text(answer) == _geo_text(truth):
        return 1.0
    given, wanted = _geo_text(answer), _geo_text(truth)
    if not given:
        return 0.0
    integer = re.compile(r"-?[0-9]+")
    if re.fullmatch(r"-?[0-9]+/[0-9]+", given) and re.fullmatch(r"-?[0-9]+/[0-9]+", wanted):
        return float(given == wanted)  # unreduced fractions are not accepted
    if bool(integer.fullmatch(wanted)) != bool(integer.fullmatch(given)):
        return 0.0  # an integer truth wants an integer answer
    irrational = [bool(re.search(r"sqrt|pi", x)) for x in (answer, truth)]
    decimal = ["." in x for x in (answer, truth)]
    if (decimal[0] and irrational[1]) or (decimal[1] and irrational[0]):
        return 0.0  # sympy: a decimal is never exactly an irrational number
    a, b = _numeric(answer), _numeric(truth)
    return float(a is not None and b is not None and math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12))


def geo3k(response: str, ground_truth: Any = None, **kwargs) -> float:
    r"""verl's geo3k scorer: 0.9 x accuracy (the last `\boxed{}` graded against the truth) + 0.1 x
    format (`<think>...</think>` then a `\boxed{}`).

    >>> geo3k(r"<think>half of 60</think> \boxed{30}", "30"), geo3k(r"\boxed{30}", "30"), geo3k("<think>x</think> 30", "30")
    (1.0, 0.9, 0.0)
    """
    accuracy = geo3k_accuracy(boxed_content(response), str(ground_truth))
    return 0.9 * accuracy + 0.1 * (1.0 if _GEO_FORMAT.fullmatch(response) else 0.0)


def verl_default(response: str, ground_truth: Any = None, *, sample: Any = None, **kwargs) -> float:
    """verl's default scorer, chosen per sample by its `data_source` (see `verl_scorer`)."""
    source = getattr(sample, "data_source", "") or ""
    name = verl_scorer(source)
    if name is None:
        raise ValueError(f"no verl default scorer for data_source {source!r}: set a reward for it")
    return VERL_RULES[name](response, ground_truth)


VERL_RULES = {"gsm8k": gsm8k, "math_verl": math_verl, "math_dapo": math_dapo, "geo3k": geo3k, "search_em": search_em,
              "verl_default": verl_default}  # fmt: skip
