"""Retrieval rewards against hand-computed values and reference loops, alone and in the composite."""

import doctest
import itertools
import math
import random
from functools import cache

import numpy as np
import pytest

from grouprl.data.sample import Sample
from grouprl.rewards import retrieval
from grouprl.rewards.composite import CompositeReward, RewardComponent
from grouprl.rewards.retrieval import (
    RETRIEVAL_REWARDS,
    anls,
    exact_match,
    final_answer,
    gold_doc_ids,
    levenshtein,
    ndcg,
    recall,
)
from grouprl.rollout.trajectory import Trajectory


def trajectory(retrieved, response="", extra_info=None, ground_truth=None):
    sample = Sample(
        uid="u",
        messages=[{"role": "user", "content": "q"}],
        ground_truth=ground_truth,
        extra_info=extra_info or {},
    )
    return Trajectory(
        sample=sample, index=0, prompt_ids=[1], response_text=response, retrieved=list(retrieved)
    )


def test_doctests_pass():
    result = doctest.testmod(retrieval)
    assert result.failed == 0 and result.attempted >= 15


def test_registry_names():
    assert RETRIEVAL_REWARDS == {
        "agent_format": retrieval.agent_format,
        "ndcg": ndcg,
        "recall": recall,
        "anls": anls,
        "exact_match": exact_match,
    }


@pytest.mark.parametrize(
    ("errors", "unfinished", "finish_reason", "expected"),
    [
        ([None, None, None], None, "stop", 1.0),
        ([None, "unclosed_tag", None, None], None, "stop", 0.75),
        (["no_action", "unclosed_tag"], None, "stop", 0.0),
        ([None, None], "max_turns", "length", 0.0),  # never finished: 0 whatever its turns
        ([None], "length", "length", 0.0),
        ([], None, "eos", 1.0),  # not an agent: only the length cut counts
        ([], None, "length", 0.0),
    ],
)
def test_agent_format_by_hand(errors, unfinished, finish_reason, expected):
    t = trajectory([])
    t.finish_reason = finish_reason
    t.turns = [{"turn": i, "error": e} for i, e in enumerate(errors)]
    if unfinished:
        t.turns[-1]["unfinished"] = unfinished
    assert retrieval.agent_format(t) == expected


def test_ndcg_by_hand():
    gold = {"gold_docs": ["a", "c"]}
    # gold {a, c}, retrieved [a, b, c] at k=3: DCG = 1 + 1/log2(4) = 1.5, IDCG = 1 + 1/log2(3)
    assert ndcg(trajectory(["a", "b", "c"]), gold, k=3) == pytest.approx(
        1.5 / (1 + 1 / math.log2(3)), abs=1e-12
    )
    assert ndcg(trajectory(["a", "b", "c"]), gold, k=3) == pytest.approx(0.9197207891481876, abs=1e-12)
    assert ndcg(trajectory(["c", "a", "b"]), gold, k=3) == 1.0
    assert ndcg(trajectory(["b", "d"]), gold) == 0.0
    # k=1: only rank 1 counts and the ideal has min(2, 1) = 1 hit
    assert ndcg(trajectory(["b", "a"]), gold, k=1) == 0.0
    assert ndcg(trajectory(["c", "b"]), gold, k=1) == 1.0
    # no cut-off: the ideal has |gold| = 2 hits even though only one was retrieved
    assert ndcg(trajectory(["a"]), gold) == pytest.approx(1 / (1 + 1 / math.log2(3)), abs=1e-12)


def test_ndcg_counts_a_document_once_at_its_first_rank():
    # the source scored [a, a, c] as 1 + 1/log2(3) + 1/log2(4) over IDCG 1 + 1/log2(3): above 1
    assert ndcg(trajectory(["a", "a", "c"]), {"gold_docs": ["a", "c"]}) == 1.0
    assert ndcg(trajectory(["b", "b", "a"]), {"gold_docs": ["a"]}, k=2) == pytest.approx(
        1 / math.log2(3), abs=1e-12
    )


def test_ndcg_against_a_reference_loop():
    rng = random.Random(0)
    pool = list("abcdefgh")
    for _ in range(200):
        gold = rng.sample(pool, rng.randint(1, 4))
        retrieved = rng.sample(pool, rng.randint(0, 8))
        k = rng.choice([None, 1, 2, 3, 5, 10])
        cut = retrieved if k is None else retrieved[:k]
        gains = np.array([1.0 if d in gold else 0.0 for d in cut])
        dcg = float((gains / np.log2(np.arange(2, len(cut) + 2))).sum())
        ideal = len(gold) if k is None else min(len(gold), k)
        idcg = float((1 / np.log2(np.arange(2, ideal + 2))).sum())
        assert ndcg(trajectory(retrieved), {"gold_docs": gold}, k=k) == pytest.approx(dcg / idcg, abs=1e-12)
        expected_recall = len(set(cut) & set(gold)) / len(gold)
        assert recall(trajectory(retrieved), {"gold_docs": gold}, k=k) == pytest.approx(
            expected_recall, abs=1e-12
        )


def test_recall_by_hand():
    gold = {"gold_docs": ["a", "c", "e"]}
    assert recall(trajectory(["a", "b", "c"]), gold) == pytest.approx(2 / 3)
    assert recall(trajectory(["a", "b", "c"]), gold, k=2) == pytest.approx(1 / 3)
    assert recall(trajectory([]), gold) == 0.0


def test_gold_pages_from_every_layout():
    assert gold_doc_ids({"gold_docs": "a"}) == ["a"]
    assert gold_doc_ids({"gold_docs": np.array(["a", "b", "a"])}) == ["a", "b"]
    assert gold_doc_ids({"reference_images": np.array(["./data/images/deck_3.jpg", "x/deck_12.jpeg/"])}) == [
        "deck_3",
        "deck_12",
    ]
    assert gold_doc_ids({"file_name": "reports/deck.pdf", "reference_page": np.array([3, 12])}) == [
        "deck_3",
        "deck_12",
    ]
    assert gold_doc_ids({"file_name": "deck.pdf", "reference_pages": [3.0]}) == ["deck_3"]
    assert gold_doc_ids({"reference_page": 4}) == ["4"]
    # the first key present wins
    assert gold_doc_ids({"gold_docs": ["x"], "reference_images": ["y.jpg"]}) == ["x"]
    assert gold_doc_ids({"gold_docs": [], "reference_images": ["y.jpg"]}) == ["y"]
    assert gold_doc_ids({}) == [] and gold_doc_ids(None) == []


def test_missing_gold_or_bad_k_raise():
    with pytest.raises(ValueError, match="no gold pages in extra_info"):
        ndcg(trajectory(["a"]), {})
    with pytest.raises(ValueError, match="k must be >= 1 or None"):
        recall(trajectory(["a"]), {"gold_docs": ["a"]}, k=0)
    with pytest.raises(ValueError, match="needs a ground truth"):
        anls("<answer>x</answer>", None)


@cache
def reference_distance(a: str, b: str) -> int:
    """Edit distance by its recursive definition."""
    if not a or not b:
        return len(a) + len(b)
    return min(
        reference_distance(a[1:], b) + 1,
        reference_distance(a, b[1:]) + 1,
        reference_distance(a[1:], b[1:]) + (a[0] != b[0]),
    )


def test_levenshtein_against_the_recursive_definition():
    rng = random.Random(1)
    for _ in range(300):
        a = "".join(rng.choices("abc", k=rng.randint(0, 7)))
        b = "".join(rng.choices("abc", k=rng.randint(0, 7)))
        assert levenshtein(a, b) == reference_distance(a, b)
    for a, b in itertools.product(["", "x", "abc"], repeat=2):
        assert levenshtein(a, b) == reference_distance(a, b)


def test_anls_by_hand():
    assert anls("<answer>Paris</answer>", "paris") == 1.0
    assert anls("<answer>  New\nYork </answer>", "new york") == 1.0  # case and whitespace normalised
    assert anls("<answer>pariss</answer>", "paris") == pytest.approx(1 - 1 / 6)
    # "abcd" vs "abxy": distance 2 of 4 = 0.5, not below the 0.5 threshold
    assert anls("<answer>abcd</answer>", "abxy") == 0.0
    assert anls("<answer>abcd</answer>", "abxy", threshold=0.6) == pytest.approx(0.5)
    # the closest ground truth counts
    assert anls("<answer>color</answer>", ["colour", "hue"]) == pytest.approx(1 - 1 / 6)
    assert anls("no answer tag", "paris") == 0.0
    assert anls("<answer></answer>", "") == 1.0


def test_exact_match():
    assert exact_match("<think>x</think><answer>12 %</answer>", ["12 %", "twelve"]) == 1.0
    assert exact_match("<answer>12%</answer>", "12 %") == 0.0
    assert exact_match("12 %", "12 %") == 0.0


def test_answers_inside_agent_observations_are_not_the_answer():
    """Text the agent loop appended (search hits, corrections, notices) is never the policy's answer."""
    hit = "\n<observation>\n[1] d1 | quiz: <answer>Lisbon</answer>\n</observation>\n"
    notice = "\n<observation>\nLast turn: give your final answer in <answer>...</answer>.\n</observation>\n"
    leaked = f"<search>capital</search>{hit}<search>again</search>{hit}"
    assert anls(leaked, "Lisbon") == 0.0 and exact_match(leaked, "Lisbon") == 0.0
    assert anls(f"{leaked}<answer>Oslo</answer>", "Lisbon") == 0.0  # its own (wrong) answer counts
    assert anls(f"{leaked}<think>d1</think><answer>Lisbon</answer>", "Lisbon") == 1.0
    assert exact_match(f"<search>capital</search>{notice}<answer>Lisbon</answer>", "Lisbon") == 1.0
    assert final_answer(f"<search>capital</search>{notice}") is None
    # a frozen generator's answer follows the last observation, outside it
    assert final_answer(f"<search_complete>true</search_complete>{hit}\n<answer> Porto</answer>") == "Porto"


def test_in_the_composite_reward():
    composite = CompositeReward(
        [
            RewardComponent("ndcg", ndcg, weight=0.2, kwargs={"k": 3}),
            RewardComponent("recall", recall),
            RewardComponent("anls", anls),
            RewardComponent("em", exact_match),
        ]
    )
    good = trajectory(["a", "b", "c"], "<answer>Seoul</answer>", {"gold_docs": ["a", "c"]}, "seoul")
    no_gold = trajectory(["a"], "<answer>Seoul</answer>", {}, "seoul")
    metrics = composite.score([good, no_gold])
    assert good.rewards == pytest.approx({"ndcg": 0.9197207891481876, "recall": 1.0, "anls": 1.0, "em": 1.0})
    assert good.reward == pytest.approx(0.2 * 0.9197207891481876 + 3.0)
    assert no_gold.rewards["ndcg"] == 0.0 and metrics["reward/errors/ndcg"] == 1.0  # counted, not silent
