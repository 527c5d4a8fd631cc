"""Reciprocal rank fusion (Cormack, Clarke & Buettcher, SIGIR 2009) of several rankings.

    score(d) = sum over rankings r that contain d of 1 / (k + rank_r(d)),   rank 1-based

k = 60 is the paper's value: it damps the head of each list so a document ranked well by
both retrievers beats one ranked first by only one of them.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_RRF_K = 60
# Search modes: BM25 alone, dense alone, or both fused by RRF.
MODES = ("bm25", "dense", "hybrid")


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[int]], k: int = DEFAULT_RRF_K
) -> list[tuple[int, float]]:
    """Fused (doc index, score) pairs, best first; equal scores keep the smaller doc index first.

    Doc 3 is 2nd and 1st: 1/62 + 1/61; doc 7 is 1st once: 1/61; doc 9 is 2nd once: 1/62.

    >>> [(doc, round(score, 6)) for doc, score in reciprocal_rank_fusion([[7, 3], [3, 9]], k=60)]
    [(3, 0.032522), (7, 0.016393), (9, 0.016129)]
    """
    if k < 0:
        raise ValueError(f"rrf k must be >= 0, got {k}")
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, doc in enumerate(ranking, start=1):
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))
