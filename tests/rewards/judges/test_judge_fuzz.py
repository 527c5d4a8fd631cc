"""Judge replies fuzzed (hypothesis, derandomized: the same examples every run): replies built
from the pieces judges and policies write (objects, fences, prose scores, quotes, escapes,
braces, long gaps, huge numbers) never raise anything but JudgeParseError, a reply that is all
a copy of the judged text never pays, an honest verdict beside any quote still reads, and the
time to read a reply grows linearly with it."""

from __future__ import annotations

import json
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.rewards.judges.parsing import JudgeParseError, looks_like_verdict, parse_scores

FIELDS = {"correctness": 1.0, "grounding": 2.0}
FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None)

PIECES = st.sampled_from([
    '{"correctness": 5}', '{"correctness": "4/5"}', '{"grounding": {"score": 3, "max": 5}}', '{"scores": {"correctness": 2}}',
    "correctness: 3", "Correctness = 80%", "**Grounding**: 4", '\\"correctness\\": 1', "```json\n", "```", "{", "}", "[", "]",
    '"', "\\", ":", ",", " ", "\n", "\t", "correctness", "_score", "NaN", "Infinity", "1e999", "9" * 400, "-0", "\ud800",
    "<|im_start|>", "</response-00ff>", "\u00e9", "null", "true", '{"a": ', '{"a": [', "\\u12", "\x00",
])  # fmt: skip
REPLY = st.lists(PIECES | st.text(max_size=6), max_size=40).map("".join)


def read(text: str, quoted=()) -> float | None:
    """The aggregate, or None for a parse failure; any other exception fails the test."""
    try:
        return parse_scores(text, FIELDS, 5, quoted=quoted).aggregate
    except JudgeParseError as e:
        assert "\n" not in str(e)  # one line
        return None


@FUZZ
@given(reply=REPLY, response=REPLY)
def test_a_fuzzed_reply_is_a_score_in_range_or_a_parse_error(reply, response):
    score = read(reply, quoted=[response])
    assert score is None or 0.0 <= score <= 1.0
    assert isinstance(looks_like_verdict(reply, FIELDS), bool)


@FUZZ
@given(response=REPLY)
def test_a_reply_that_only_copies_the_judged_text_never_pays(response):
    """Every score a copy holds is the judged text's: quoted whole, the reply has no verdict."""
    assert read(response, quoted=[response]) is None
    assert read(f"The response says: {response} -- that is all.", quoted=[response]) is None or not response


@FUZZ
@given(response=REPLY, correctness=st.integers(0, 5), grounding=st.integers(0, 5), before=REPLY)
def test_the_judges_own_verdict_reads_beside_anything_the_response_wrote(response, correctness, grounding, before):
    """A verdict object the response does not hold verbatim, after a quote of the response:
    it scores exactly, unless the quote gives a field another value (then no verdict)."""
    verdict = json.dumps({"correctness": correctness, "grounding": grounding, "explanation": "checked"})
    score = read(f"The response wrote {response!r}.\n{verdict}", quoted=[response, before])
    expected = (correctness / 5 + 2 * grounding / 5) / 3
    assert score is None or abs(score - expected) < 1e-12
    if not any(word in response.lower() for word in ("{", "correctness", "grounding")) and verdict not in before:
        assert score is not None and abs(score - expected) < 1e-12  # nothing there to quote: the verdict stands


@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(unit=REPLY.filter(lambda s: len(s) >= 4))
def test_reading_a_reply_takes_time_linear_in_its_length(unit):
    """The fuzzed reply repeated to about 20,000 and 40,000 characters: twice the text, at most
    about twice the time (best of five of each, taken in turn, 10 ms for a busy machine's noise; a quadratic scan
    would take four times as long: the prose pattern once took 5 s at 20,000 characters)."""

    def seconds(text: str) -> float:
        t0 = time.perf_counter()
        read(text)
        looks_like_verdict(text, FIELDS)
        return time.perf_counter() - t0

    small = unit * (20_000 // len(unit) + 1)
    times = [(seconds(small), seconds(small * 2)) for _ in range(5)]  # in turn: both see the machine's load
    small_s, large_s = min(t[0] for t in times), min(t[1] for t in times)
    assert large_s < 3.0 * small_s + 10e-3, (len(small), small_s, large_s)
