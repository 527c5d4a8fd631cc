"""Reciprocal rank fusion against hand-computed scores."""

import doctest

import pytest

from grouprl.retriever import fusion
from grouprl.retriever.fusion import reciprocal_rank_fusion


def test_doctests_pass():
    result = doctest.testmod(fusion)
    assert result.failed == 0 and result.attempted >= 1


def test_scores_and_order_by_hand():
    fused = dict(reciprocal_rank_fusion([["x", "y", "z"], ["z", "x"]], k=10))
    assert fused["x"] == pytest.approx(1 / 11 + 1 / 12, abs=1e-15)
    assert fused["y"] == pytest.approx(1 / 12, abs=1e-15)
    assert fused["z"] == pytest.approx(1 / 13 + 1 / 11, abs=1e-15)
    assert [doc for doc, _ in reciprocal_rank_fusion([["x", "y", "z"], ["z", "x"]], k=10)] == ["x", "z", "y"]


def test_ties_keep_smaller_index_first_and_k_zero_allowed():
    assert reciprocal_rank_fusion([[5], [2]], k=0) == [(2, 1.0), (5, 1.0)]
    assert reciprocal_rank_fusion([[], []]) == []
    with pytest.raises(ValueError):
        reciprocal_rank_fusion([[1]], k=-1)
