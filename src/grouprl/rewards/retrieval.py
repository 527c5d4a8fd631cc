"""Rewards for the search agent: NDCG, recall, ANLS, exact match, protocol validity.

They take their context by parameter name (see `CompositeReward`): `ndcg` and `recall` read
`trajectory.retrieved` (unique doc ids in first-retrieval order, filled by the search tool)
and the gold pages from `extra_info`; `anls` and `exact_match` compare the last `<answer>`
block of the response with the ground truth (a string or a list of acceptable strings). For an
agent that block is the policy's own `<answer>` action (agent.answer_generator: none) or the
frozen generator's answer: the agent loop's observations (`\n<observation>\n...\n</observation>\n`
in the response text: search hits, corrections, the last-turn notice that quotes
`<answer>...</answer>`) are left out, so text the policy did not write is never its answer.

Gold pages, from the first `extra_info` key present (see `gold_doc_ids`):
- `gold_docs`: doc ids (the plain layout);
- `reference_images`: page image paths; the doc id is the file name without its extension
  ("data/images/report_3.jpg" -> "report_3");
- `reference_pages` / `reference_page`: page numbers; with `file_name` the doc id is
  "<file_name without extension>_<page>" (the source's SlideVQA layout: "deck.pdf", page 3 ->
  "deck_3"), without it the page number itself.
The index's doc ids must follow the same naming for these to match.

NDCG (binary relevance): DCG@k = sum_{i=1..k} rel_i / log2(i + 1), i the 1-based rank;
IDCG@k = the DCG of min(|gold|, k) relevant documents at the top; k=None means no cut-off.
The source's reward manager (verl `rm.py`) differs in two ways: it scores the list of every
retrieved image, so a page retrieved twice counts twice (its NDCG can exceed 1), and it has
no cut-off. Here each document counts once, at its first rank, so NDCG stays in [0, 1];
with k=None the values agree whenever no page repeats.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

from grouprl.rewards.rules import extract_answer

GOLD_KEYS = ("gold_docs", "reference_images", "reference_pages", "reference_page")
# how the agent loop marks an observation in Trajectory.response_text (rollout/agent.py)
_OBSERVATION = re.compile(r"\n<observation>\n.*?\n</observation>\n", re.DOTALL)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, bytes, int, float)):
        return [value]
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
        return value if isinstance(value, list) else [value]
    return list(value)


def gold_doc_ids(extra_info: dict[str, Any] | None) -> list[str]:
    """The gold doc ids of a sample, unique, in order (see the module docstring).

    >>> gold_doc_ids({"gold_docs": ["a", "c"]})
    ['a', 'c']
    >>> gold_doc_ids({"reference_images": ["/data/images/deck_3.jpg", "deck_7.png"]})
    ['deck_3', 'deck_7']
    >>> gold_doc_ids({"file_name": "deck.pdf", "reference_page": [3, 7]})
    ['deck_3', 'deck_7']
    """
    info = extra_info or {}
    for key in GOLD_KEYS:
        values = _as_list(info.get(key))
        if not values:
            continue
        if key == "reference_images":
            ids = [PurePath(str(v).rstrip("/")).stem for v in values]
        elif key.startswith("reference_page") and info.get("file_name"):
            stem = PurePath(str(info["file_name"])).stem
            ids = [f"{stem}_{_page(v)}" for v in values]
        else:
            ids = [str(_page(v)) if key.startswith("reference_page") else str(v) for v in values]
        return list(dict.fromkeys(ids))
    return []


def _page(value: Any) -> Any:
    """3.0 -> 3 (pages read from parquet may be floats)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _retrieved_and_gold(trajectory: Any, extra_info: dict[str, Any] | None, k: int | None):
    gold = gold_doc_ids(extra_info)
    if not gold:
        raise ValueError(f"no gold pages in extra_info (looked for {', '.join(GOLD_KEYS)})")
    if k is not None and k < 1:
        raise ValueError(f"k must be >= 1 or None, got {k}")
    retrieved = list(dict.fromkeys(str(doc) for doc in trajectory.retrieved))
    return (retrieved if k is None else retrieved[:k]), set(gold)


def ndcg(trajectory: Any, extra_info: dict[str, Any] | None = None, k: int | None = None) -> float:
    """NDCG@k of the agent's retrieved pages against the gold pages (binary relevance).

    >>> from types import SimpleNamespace as T
    >>> round(ndcg(T(retrieved=["a", "b", "c"]), {"gold_docs": ["a", "c"]}, k=3), 6)  # 1.5 / (1 + 1/log2(3))
    0.919721
    >>> ndcg(T(retrieved=["b", "a"]), {"gold_docs": ["a"]})  # 1/log2(3)
    0.6309297535714575
    >>> ndcg(T(retrieved=[]), {"gold_docs": ["a"]})
    0.0
    """
    retrieved, gold = _retrieved_and_gold(trajectory, extra_info, k)
    dcg = sum(1.0 / math.log2(rank + 1) for rank, doc in enumerate(retrieved, start=1) if doc in gold)
    ideal = len(gold) if k is None else min(len(gold), k)
    idcg = sum(1.0 / math.log2(rank + 1) for rank in range(1, ideal + 1))
    return dcg / idcg


def recall(trajectory: Any, extra_info: dict[str, Any] | None = None, k: int | None = None) -> float:
    """Share of the gold pages among the first k retrieved pages (all of them for k=None).

    >>> from types import SimpleNamespace as T
    >>> recall(T(retrieved=["a", "b", "c"]), {"gold_docs": ["a", "c"]}, k=2)
    0.5
    """
    retrieved, gold = _retrieved_and_gold(trajectory, extra_info, k)
    return len(gold.intersection(retrieved)) / len(gold)


def _normalise(text: Any) -> str:
    return " ".join(str(text).split()).lower()


def final_answer(response: str) -> str | None:
    """The last `<answer>` block outside the agent loop's observations, stripped, or None.

    >>> final_answer("<search>q</search>\\n<observation>\\n<answer>Oslo</answer>\\n</observation>\\n") is None
    True
    >>> final_answer("<search>q</search>\\n<observation>\\nhit\\n</observation>\\n<answer> Lima </answer>")
    'Lima'
    """
    return extract_answer(_OBSERVATION.sub("\n", response))


def _truths(ground_truth: Any) -> list[str]:
    truths = [_normalise(t) for t in _as_list(ground_truth)]
    if not truths:
        raise ValueError("needs a ground truth; the sample has none")
    return truths


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1).

    >>> levenshtein("kitten", "sitting")
    3
    """
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))  # distances from a[:i-1] to every prefix of b
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def anls(response: str, ground_truth: Any = None, threshold: float = 0.5) -> float:
    """Normalised Levenshtein similarity of the answer to the closest ground truth (ANLS, Biten
    et al. 2019): 1 - d / max(len) when that distance ratio is below `threshold`, else 0.
    Case and whitespace are normalised; no `<answer>` block (outside observations) scores 0.

    >>> anls("<answer>Paris </answer>", ["paris", "Paris, France"])
    1.0
    >>> anls("<answer>pari</answer>", "paris")  # d = 1, max len 5
    0.8
    >>> anls("<answer>london</answer>", "paris")
    0.0
    """
    truths = _truths(ground_truth)
    answer = final_answer(response)
    if answer is None:
        return 0.0
    answer = _normalise(answer)
    best = 0.0
    for truth in truths:
        longest = max(len(answer), len(truth))
        distance = levenshtein(answer, truth) / longest if longest else 0.0
        if distance < threshold:
            best = max(best, 1.0 - distance)
    return best


def exact_match(response: str, ground_truth: Any = None) -> float:
    """1.0 when the answer equals a ground truth after case/whitespace normalisation.

    >>> exact_match("<answer> New  York</answer>", ["new york", "NYC"])
    1.0
    >>> exact_match("<answer>York</answer>", "new york")
    0.0
    """
    truths = _truths(ground_truth)
    answer = final_answer(response)
    return 1.0 if answer is not None and _normalise(answer) in truths else 0.0


def agent_format(trajectory: Any) -> float:
    """Protocol validity of an agent trajectory: the share of its turns whose action was valid
    (no corrective observation), and 0.0 when it never finished (out of turns or tokens).
    A trajectory without turns (no agent) scores 1.0 unless it was cut at the length limit.

    >>> from types import SimpleNamespace as T
    >>> agent_format(T(turns=[{"error": None}, {"error": "unclosed_tag"}, {"error": None}], finish_reason="stop"))
    0.6666666666666666
    >>> agent_format(T(turns=[{"error": None}, {"error": None, "unfinished": "max_turns"}], finish_reason="length"))
    0.0
    """
    turns = list(getattr(trajectory, "turns", None) or [])
    if getattr(trajectory, "finish_reason", "") == "length" or any(t.get("unfinished") for t in turns):
        return 0.0
    if not turns:
        return 1.0
    return sum(1 for t in turns if not t.get("error")) / len(turns)


RETRIEVAL_REWARDS: dict[str, Callable[..., float]] = {
    "agent_format": agent_format,
    "ndcg": ndcg,
    "recall": recall,
    "anls": anls,
    "exact_match": exact_match,
}
