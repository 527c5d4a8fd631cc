"""Gold search trajectories: the conversations a good searcher has with the agent loop, for the
SFT that warms a searcher up before RL, and `write_slides_task`, which writes the slide-deck task
(grouprl.data.tasks.slides_files) with them; also `python -m grouprl.rollout.gold --out DIR
[--seed N] [--train N] [--val N] [--decks N] [--self-answer] [--page-images]`.

A gold trajectory is the conversation a good searcher has with the agent loop, one record a
line of `sft_*.jsonl`: `{"id", "messages", "train_on": [assistant message indices],
"gold_docs", "answer"}`:

    system    the agent loop's protocol prompt (agent_prompts.PROTOCOL)
    user      the question
    assistant <think>...</think><search>project label</search>      (one per gold slide)
    user      the search tool's observation for that query
    assistant <think>...evidence...</think><search_complete>true</search_complete>

With `self_answer` (the agent loop's `answer_generator: none`, where the policy answers itself)
the system prompt is PROTOCOL_SELF_ANSWER and the last turn gives the answer instead:

    assistant <think>...evidence...</think><answer>the gold answer</answer>

Observations are made by the agent's own search tool over a BM25 index of the corpus (the
retriever's settings), so SFT shows the policy the very text RL will show it. The query is
chosen so that the top TOP_K hits hold the gold slide. They are written with the agent's own tool and protocol prompt, which is why they live here
and not with the task's data.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl.data.sample import Sample
from grouprl.data.tasks.slides import (
    FIRST_THOUGHTS,
    FOUND_THOUGHTS,
    QUERY_FORMS,
    TOP_K,
    Question,
    gold_queries,
)
from grouprl.data.tasks.slides_files import IMAGES_DIR, write_jsonl, write_slides_data
from grouprl.errors import UserError
from grouprl.rollout.agent_prompts import protocol_prompt, with_protocol
from grouprl.vision.images import IMAGE_PLACEHOLDER


# -- the agent's search, in-process ------------------------------------------------------
class GoldSearch:
    """The agent's `<search>` tool over a BM25-only in-process retriever of `corpus.jsonl`."""

    def __init__(self, corpus_path: Path, top_k: int = TOP_K, page_images: bool = False):
        import bm25s

        from grouprl.retriever.corpus import read_corpus
        from grouprl.retriever.index import BM25_SETTINGS, Retriever
        from grouprl.rollout.tools.search import SearchTool

        documents = read_corpus(corpus_path)
        bm25 = bm25s.BM25(method=BM25_SETTINGS["method"], k1=BM25_SETTINGS["k1"], b=BM25_SETTINGS["b"])
        texts = [d.searchable_text for d in documents]
        bm25.index(
            bm25s.tokenize(texts, stopwords=BM25_SETTINGS["stopwords"], show_progress=False),
            show_progress=False,
        )
        retriever = Retriever(documents, bm25, None, None, {}, mode="bm25", fusion_k=60, candidates=100)
        self.tool = SearchTool(retriever, top_k=top_k, max_images=1 if page_images else 0)

    async def observe(self, query: str) -> tuple[str, list[str], list[str]]:
        """The observation text the policy reads after `<search>query</search>`, the hit ids, and
        the page image the tool shows a VLM (`images/<id>.png`, relative to the task folder;
        none unless page_images)."""
        from grouprl.rollout.tools.base import AgentState

        state = AgentState(sample=Sample(uid="gold", messages=[]), index=0)
        observation = await self.tool(query, state)
        if observation.error:
            raise RuntimeError(f"gold search for {query!r} failed: {observation.error}")
        # the page's file (the tool shows it as it is, or resized where it bounds pixels)
        shown = [f"{IMAGES_DIR}/{Path(str(state.current_image)).name}"] if observation.images else []
        return observation.text, [hit["id"] for hit in observation.retrieved], shown


# -- gold trajectories ---------------------------------------------------------------------
def _thoughts(question: Question, variant: int) -> list[str]:
    """One thought per assistant turn: before each search, then before search_complete (or the answer)."""
    if question.kind == "single":
        (f,) = question.facts
        fields = {
            "noun": f.noun,
            "label": f.label.lower(),
            "deck": f.deck,
            "slide": f.slide,
            "doc": f.slide_id,
            "title": f"{f.deck}: {f.slide}",
            "value": f.value,
        }
        return [
            FIRST_THOUGHTS[variant % len(FIRST_THOUGHTS)].format(**fields),
            FOUND_THOUGHTS[variant % len(FOUND_THOUGHTS)].format(**fields),
        ]
    a, b = question.facts
    label = a.noun
    return [
        f"I need the {label} of both {a.deck} and {b.deck}. First {a.deck}.",
        f"{a.deck}'s {label} is {a.value} ({a.slide_id}). Now {b.deck}.",
        f"{b.deck}'s {label} is {b.value} ({b.slide_id}), so {question.answer} has the higher {label}.",
    ]


async def gold_conversation(
    question: Question,
    sample: Sample,
    search: GoldSearch,
    variant: int,
    system_prompt: str,
    self_answer: bool = False,
) -> dict[str, Any]:
    """The gold trajectory of `question` as an SFT record (see the module docstring); with
    self_answer its last turn is `<answer>` instead of `<search_complete>`. Where the search
    shows a page image, the observation starts with its `<image>` placeholder (as the agent loop
    shows a VLM its observations: images first) and the record lists it under `images`."""
    thoughts = _thoughts(question, variant)
    messages = with_protocol(sample.messages, system_prompt)
    images: list[str] = []
    for i, fact in enumerate(question.facts):
        for shift in range(len(QUERY_FORMS)):  # the first query form whose hits hold the gold slide
            query = gold_queries(question, variant + shift)[i]
            observation, hit_ids, shown = await search.observe(query)
            if fact.slide_id in hit_ids:
                break
        else:
            raise RuntimeError(
                f"no query form finds slide {fact.slide_id} for {question.key!r} in the top {TOP_K}"
            )
        messages.append(
            {"role": "assistant", "content": f"<think>{thoughts[i]}</think><search>{query}</search>"}
        )
        messages.append({"role": "user", "content": IMAGE_PLACEHOLDER * len(shown) + observation})
        images += shown
    action = (
        f"<answer>{question.answer}</answer>" if self_answer else "<search_complete>true</search_complete>"
    )
    messages.append({"role": "assistant", "content": f"<think>{thoughts[-1]}</think>{action}"})
    record = {
        "id": sample.uid,
        "messages": messages,
        "train_on": [i for i, m in enumerate(messages) if m["role"] == "assistant"],
        "gold_docs": [f.slide_id for f in question.facts],
        "answer": question.answer,
    }
    return {**record, "images": images} if images else record


# -- everything on disk --------------------------------------------------------------------
@dataclass
class SlidesTaskFiles:
    """Where `write_slides_task` put things."""

    corpus: Path  # corpus.jsonl
    images: Path  # images/ folder
    train: Path  # train.parquet (verl layout)
    val: Path  # val.parquet
    sft_train: Path  # sft_train.jsonl (gold trajectories of the train questions)
    sft_val: Path  # sft_val.jsonl


def write_slides_task(
    out_dir: str | Path,
    seed: int = 0,
    n_train: int = 200,
    n_val: int = 50,
    *,
    n_decks: int = 12,
    slides_per_deck: tuple[int, int] = (7, 11),
    two_slide_share: float = 0.2,
    image_size: tuple[int, int] = (480, 270),
    system_prompt: str | None = None,
    self_answer: bool = False,
    page_images: bool = False,
) -> SlidesTaskFiles:
    """Write the corpus, slide images, train/val questions and their gold trajectories under `out_dir`.
    The same arguments give byte-identical files. system_prompt: of the gold trajectories
    (None = the agent loop's built-in protocol prompt, what RL shows with agent.system_prompt unset).
    self_answer: gold trajectories end with the policy's own `<answer>` (for RL with
    `agent.answer_generator: none`, whose protocol prompt they then carry) instead of
    `<search_complete>`; only the sft_*.jsonl files differ. page_images: each search
    observation of a gold trajectory shows the first hit's page image, as the search tool shows
    it to a VLM policy (for the SFT of a VLM searcher; only the sft_*.jsonl files differ)."""
    data = write_slides_data(
        out_dir, seed, n_train, n_val, n_decks=n_decks, slides_per_deck=slides_per_deck,
        two_slide_share=two_slide_share, image_size=image_size,
    )  # fmt: skip
    out = Path(out_dir)
    files = SlidesTaskFiles(data.corpus, data.images, data.train, data.val, out / "sft_train.jsonl", out / "sft_val.jsonl")
    search = GoldSearch(files.corpus, page_images=page_images)
    prompt = protocol_prompt("none" if self_answer else "frozen", system_prompt)

    async def conversations(split_questions: list[Question], samples: list[Sample]) -> list[dict[str, Any]]:
        return [
            await gold_conversation(q, s, search, i, prompt, self_answer)
            for i, (q, s) in enumerate(zip(split_questions, samples))
        ]

    for split, sft in (("train", files.sft_train), ("val", files.sft_val)):
        write_jsonl(sft, asyncio.run(conversations(data.questions[split], data.samples[split])))
    return files


def main(argv: list[str] | None = None) -> int:
    """`python -m grouprl.rollout.gold --out DIR [--seed N] [--train N] [--val N] [--decks N]
    [--self-answer] [--page-images]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m grouprl.rollout.gold", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=200, help="training questions")
    parser.add_argument("--val", type=int, default=50, help="held-out questions")
    parser.add_argument("--decks", type=int, default=12, help="number of slide decks")
    parser.add_argument(
        "--self-answer",
        action="store_true",
        help="gold trajectories end with the policy's own <answer> (agent.answer_generator: none)",
    )
    parser.add_argument(
        "--page-images",
        action="store_true",
        help="gold search observations show the first hit's page image (the SFT of a VLM searcher)",
    )
    args = parser.parse_args(argv)
    try:
        files = write_slides_task(
            args.out, args.seed, args.train, args.val, n_decks=args.decks, self_answer=args.self_answer,
            page_images=args.page_images,
        )
    except UserError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    for name, path in vars(files).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
