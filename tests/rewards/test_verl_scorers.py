"""verl's default scorers as grouprl reproduces them, held against verl's own values.

EXPECTED's last column was obtained by running verl's scorers themselves
(verl/utils/reward_score/{gsm8k,math_reward,math_dapo,geo3k,search_r1_like_qa_em}.py at verl's
main of 2026-01-29, geo3k with mathruler 0.1 and pylatexenc) on these same strings, outside this
repository; the strings were written for this test. verl's scorer is chosen by data_source as
verl chooses it (`default_compute_score`)."""

import pytest

from grouprl.rewards import rules, verl_scorers

EXPECTED = [
    (rules.gsm8k, "so 3 + 4 = 7\n#### 7", "7", 1.0),
    (rules.gsm8k, "#### 1,234", "1234", 1.0),
    (rules.gsm8k, "#### $12", "12", 0.0),
    (rules.gsm8k, "the answer is 7", "7", 0.0),
    (rules.gsm8k, "#### 7.0", "7", 0.0),
    (rules.gsm8k, "#### -3", "-3", 1.0),
    (verl_scorers.math_verl, "so \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    (verl_scorers.math_verl, "\\boxed{0.5}", "\\frac12", 1.0),
    (verl_scorers.math_verl, "\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    (verl_scorers.math_verl, "\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    (verl_scorers.math_verl, "\\boxed{30^\\circ}", "30", 1.0),
    (verl_scorers.math_verl, "\\boxed{x = 5}", "5", 1.0),
    (verl_scorers.math_verl, "\\boxed 7$", "7", 1.0),
    (verl_scorers.math_verl, "\\fbox{3}", "3", 0.0),
    (verl_scorers.math_verl, "\\boxed{5\\text{ cm}}", "5", 1.0),
    (verl_scorers.math_verl, "\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
    (verl_scorers.math_verl, "Answer: 2", "2", 0.0),
    (verl_scorers.math_verl, "\\boxed{10\\%}", "10", 1.0),
    (verl_scorers.math_verl, "\\boxed{.5}", "0.5", 1.0),
    (verl_scorers.math_verl, "\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    (verl_scorers.math_verl, "\\boxed{3}", "4", 0.0),
    (verl_scorers.math_dapo, "... so the total is 42.\nAnswer: 42", "42", 1.0),
    (verl_scorers.math_dapo, "\\boxed{42}", "42", -1.0),
    (verl_scorers.math_dapo, "answer : 1,000", "1000", 1.0),
    (verl_scorers.math_dapo, "Answer: $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
    (verl_scorers.math_dapo, "Answer: \\text{5 inches}", "5", 1.0),
    (verl_scorers.math_dapo, "Answer: x = 7", "7", 1.0),
    (verl_scorers.math_dapo, "Answer: 3\nAnswer: 4", "4", 1.0),
    (verl_scorers.math_dapo, "Answer: \\boxed{9}", "9", 1.0),
    (verl_scorers.math_dapo, "Answer: 10 degrees", "10", 1.0),
    (verl_scorers.math_dapo, "Answer: 41", "42", -1.0),
    (verl_scorers.math_dapo, "Answer: \\frac12", "\\frac{1}{2}", 1.0),
    (verl_scorers.geo3k, "<think>half of 60</think> \\boxed{30}", "30", 1.0),
    (verl_scorers.geo3k, "\\boxed{30}", "30", 0.9),
    (verl_scorers.geo3k, "<think>x</think> 30", "30", 0.0),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{3\\sqrt{3}}", "3\\sqrt{3}", 1.0),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{5.196152422706632}", "3\\sqrt{3}", 0.1),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{\\frac{40}{3}}", "\\frac{40}{3}", 1.0),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{30^\\circ}", "30", 1.0),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{4.0}", "4", 1.0),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{\\frac{8}{2}}", "4", 0.1),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{2/4}", "1/2", 0.1),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{12 cm}", "12", 1.0),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{2\\pi}", "2\\pi", 1.0),
    (verl_scorers.geo3k, "<think>r</think>\\boxed{31}", "30", 0.1),
    (rules.search_em, "<answer>The Eiffel Tower</answer>", {"target": ["eiffel tower", "tour eiffel"]}, 1.0),
    (rules.search_em, "<answer>Paris</answer>", {"target": ["eiffel tower"]}, 0.0),
    (rules.search_em, "no tags", {"target": ["x"]}, 0.0),
    (rules.search_em, "<answer>a</answer><answer>b</answer>", {"target": ["b"]}, 1.0),
    (rules.search_em, "<answer>x</answer>", {"target": "x"}, 1.0),
    (
        rules.search_em,
        "<answer>no</answer><answer>no</answer><answer>no</answer><answer>no</answer><answer>no</answer><answer>no</answer><answer>no</answer><answer>no</answer><answer>no</answer><answer>no</answer><answer>yes</answer>",
        {"target": ["yes"]},
        0.25,
    ),
]


@pytest.mark.parametrize("scorer, response, truth, verls_value", EXPECTED)
def test_the_same_value_as_verls_own_scorer(scorer, response, truth, verls_value):
    assert scorer(response, truth) == pytest.approx(verls_value, abs=1e-12)


@pytest.mark.parametrize(
    "source, rule",
    [
        ("openai/gsm8k", "gsm8k"), ("lighteval/MATH", "math_verl"), ("HuggingFaceH4/MATH-500", "math_verl"),
        ("math_dapo", "math_dapo"), ("math", "math_dapo"), ("aime_2024", "math_dapo"), ("hiyouga/geometry3k", "geo3k"),
        ("searchR1_nq", "search_em"), ("gsm8k", None), ("numina_olympiads", None),
    ],
)  # fmt: skip
def test_the_scorer_is_chosen_by_data_source_as_verl_chooses(source, rule):
    assert verl_scorers.verl_scorer(source) == rule


def test_verl_default_per_sample_and_its_doctests():
    import doctest
    from types import SimpleNamespace

    assert verl_scorers.verl_default("Answer: 3", "3", sample=SimpleNamespace(data_source="aime_2025")) == 1.0
    with pytest.raises(ValueError, match="no verl default scorer"):
        verl_scorers.verl_default("x", "3", sample=SimpleNamespace(data_source="mine"))
    assert doctest.testmod(verl_scorers).failed == 0
