"""Reading scores out of judge answers: JSON in fences or prose, strings, declared maxima,
prose-only answers, and one-line errors naming what is missing or invalid."""

import pytest

from grouprl.rewards.judges.parsing import JudgeParseError, parse_scores

ONE = {"correctness": 1.0}


@pytest.mark.parametrize(
    "text, scale, expected",
    [
        ('{"correctness": 4}', 5, 0.8),
        ('Let me check.\n```json\n{"correctness": "3", "explanation": "close"}\n```\nDone.', 5, 0.6),
        ('```\n{"correctness": 2.5}\n```', 5, 0.5),
        ('The answer matches. {"correctness": 10, "explanation": "exact"}', 10, 1.0),
        ('{"Correctness": " 4.5 "}', 5, 0.9),
        ('{"correctness_score": 1}', 5, 0.2),
        ('{"correctness": "7/10"}', 5, 0.7),  # a declared maximum wins over the scale
        ('{"correctness": "80%"}', 5, 0.8),
        ('{"correctness": {"score": 3, "max": 4}}', 5, 0.75),
        ('{"correctness": {"score": 2}}', 5, 0.4),
        ('{"scores": {"correctness": 5}, "explanation": "ok"}', 5, 1.0),
        ("Correctness: 4/5. The answer is right but terse.", 5, 0.8),
        ("**Correctness**: 3", 5, 0.6),
        ('{"correctness": 4, "explanation": "the answer is cut off mid-', 5, 0.8),  # truncated JSON
        ('Example format: {"note": 1}. My verdict: {"correctness": 0}', 5, 0.0),
        ('Draft {"correctness": 1} ... final {"correctness": 5}', 5, 1.0),  # the final verdict
    ],
)
def test_one_field(text, scale, expected):
    parsed = parse_scores(text, ONE, scale)
    assert parsed.scores == {"correctness": pytest.approx(expected, abs=1e-12)}
    assert parsed.aggregate == pytest.approx(expected, abs=1e-12)


def test_weighted_aggregate_of_several_fields():
    text = 'Verdict:\n{"accuracy": 2, "grounding": "4", "explanation": "partly"}'
    parsed = parse_scores(text, {"accuracy": 1.0, "grounding": 3.0}, 4)
    assert parsed.scores == {"accuracy": 0.5, "grounding": 1.0}
    assert parsed.aggregate == pytest.approx((1.0 * 0.5 + 3.0 * 1.0) / 4.0, abs=1e-12)


def test_the_object_with_most_fields_wins():
    text = '{"accuracy": 1} and then {"accuracy": 3, "grounding": 2}'
    assert parse_scores(text, {"accuracy": 1.0, "grounding": 1.0}, 5).scores == {
        "accuracy": 0.6,
        "grounding": 0.4,
    }


@pytest.mark.parametrize(
    "text, fields, fragment",
    [
        ("I think it is good.", ONE, "lacks score field(s) correctness"),
        ('{"accuracy": 3}', {"accuracy": 1.0, "grounding": 1.0}, "lacks score field(s) grounding:"),
        ('{"correctness": 7}', ONE, "7 is outside 0..5"),
        ('{"correctness": -1}', ONE, "-1 is outside 0..5"),
        ('{"correctness": "high"}', ONE, "'high'"),
        ('{"correctness": true}', ONE, "is True, not a number"),
        ('{"correctness": "6/5"}', ONE, "6 is outside 0..5"),
        ('{"correctness": "3/0"}', ONE, "3 out of 0 is not a score"),
        ('{"correctness": {"explanation": "x"}}', ONE, "not a score"),
        ("", ONE, "lacks score field(s) correctness"),
    ],
)
def test_unusable_answers_raise_one_line(text, fields, fragment):
    with pytest.raises(JudgeParseError) as info:
        parse_scores(text, fields, 5)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
