"""The slide-deck task on disk: gold search trajectories for SFT, slide images, and
`write_slides_task`, which writes everything (see `grouprl.data.tasks.slides`); also
`python -m grouprl.data.tasks.slides_files --out DIR [--seed N] [--train N] [--val N] [--decks N]
[--self-answer] [--page-images]`.

A gold trajectory is the conversation a good searcher has with the agent loop, one record a
line of `sft_*.jsonl`: `{"id", "messages", "train_on": [assistant message indices],
"gold_docs", "answer"}`:

    system    the agent loop's protocol prompt (grouprl.rollout.agent_prompts.PROTOCOL)
    user      the question
    assistant <think>...</think><search>project label</search>      (one per gold slide)
    user      the search tool's observation for that query
    assistant <think>...evidence...</think><search_complete>true</search_complete>

With `self_answer` (the agent loop's `answer_generator: none`, where the policy answers itself)
the system prompt is PROTOCOL_SELF_ANSWER and the last turn gives the answer instead:

    assistant <think>...evidence...</think><answer>the gold answer</answer>

Observations are made by the agent's own search tool over a BM25 index of the corpus (the
retriever's settings), so SFT shows the policy the very text RL will show it. The query is
chosen so that the top TOP_K hits hold the gold slide.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl.data.sample import Sample
from grouprl.data.tasks.slides import (
    DATA_SOURCE,
    FIRST_THOUGHTS,
    FOUND_THOUGHTS,
    QUERY_FORMS,
    TOP_K,
    Question,
    Slide,
    gold_queries,
    make_corpus,
    make_questions,
    to_sample,
)
from grouprl.errors import ConfigError, UserError
from grouprl.vision.images import IMAGE_PLACEHOLDER

IMAGES_DIR = "images"  # the slide images' folder inside the task folder

log = logging.getLogger(__name__)


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
    from grouprl.rollout.agent_prompts import with_protocol

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


# -- images -------------------------------------------------------------------------------
def draw_slide(slide: Slide, size: tuple[int, int] = (480, 270)) -> bytes:
    """The slide as PNG bytes: a title bar, the bullets, and `n / count` in the corner."""
    from PIL import Image, ImageDraw, ImageFont

    width, height = size
    shade = hashlib.sha1(slide.deck.encode()).digest()  # one colour per deck
    bar = (40 + shade[0] % 80, 60 + shade[1] % 80, 110 + shade[2] % 100)
    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    title_font = ImageFont.load_default(size=max(8, height // 11))
    body_font = ImageFont.load_default(size=max(6, height // 17))
    margin = width // 24
    bar_height = height // 5
    draw.rectangle([0, 0, width, bar_height], fill=bar)
    draw.text((margin, bar_height // 2), slide.title, font=title_font, fill=(255, 255, 255), anchor="lm")
    line = int(body_font.size * 1.8)
    for i, bullet in enumerate(slide.bullets):
        draw.text(
            (margin, bar_height + line // 2 + i * line), f"- {bullet}", font=body_font, fill=(20, 20, 20)
        )
    draw.text(
        (width - margin, height - margin),
        f"{slide.number} / {slide.count}",
        font=body_font,
        fill=(110, 110, 110),
        anchor="rb",
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


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


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def _verl_record(sample) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": sample.messages,
        "reward_model": {"style": "rule", "ground_truth": sample.ground_truth},
        "extra_info": sample.extra_info,
    }


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
    import pyarrow as pa
    import pyarrow.parquet as pq

    from grouprl.rollout.agent_prompts import protocol_prompt

    if len(image_size) != 2 or min(image_size) < 32:
        raise ConfigError(f"image_size must be [width, height], each >= 32, got {list(image_size)}")
    out = Path(out_dir)
    images = out / IMAGES_DIR
    images.mkdir(parents=True, exist_ok=True)
    slides = make_corpus(seed, n_decks=n_decks, slides_per_deck=tuple(slides_per_deck))
    questions = {
        split: make_questions(slides, n, seed, split, two_slide_share=two_slide_share)
        for split, n in (("train", n_train), ("val", n_val))
    }  # too many asked for: fail before writing
    for stale in set(images.glob("*.png")) - {images / f"{s.id}.png" for s in slides}:
        stale.unlink()  # left by an earlier corpus in the same folder
    for slide in slides:
        (images / f"{slide.id}.png").write_bytes(draw_slide(slide, tuple(image_size)))
    files = SlidesTaskFiles(
        out / "corpus.jsonl",
        images,
        out / "train.parquet",
        out / "val.parquet",
        out / "sft_train.jsonl",
        out / "sft_val.jsonl",
    )
    _write_jsonl(
        files.corpus,
        [{"id": s.id, "title": s.title, "text": s.text, "image": f"{IMAGES_DIR}/{s.id}.png"} for s in slides],
    )
    search = GoldSearch(files.corpus, page_images=page_images)
    prompt = protocol_prompt("none" if self_answer else "frozen", system_prompt)

    async def conversations(split_questions: list[Question], samples: list[Sample]) -> list[dict[str, Any]]:
        return [
            await gold_conversation(q, s, search, i, prompt, self_answer)
            for i, (q, s) in enumerate(zip(split_questions, samples))
        ]

    for split, parquet, sft in (("train", files.train, files.sft_train), ("val", files.val, files.sft_val)):
        samples = [to_sample(q, i, split, seed) for i, q in enumerate(questions[split])]
        pq.write_table(pa.Table.from_pylist([_verl_record(s) for s in samples]), parquet)
        _write_jsonl(sft, asyncio.run(conversations(questions[split], samples)))
    log.info(
        "slides task: %d slides, %d train / %d held-out questions in %s", len(slides), n_train, n_val, out
    )
    return files


def main(argv: list[str] | None = None) -> int:
    """`python -m grouprl.data.tasks.slides_files --out DIR [--seed N] [--train N] [--val N] [--decks N]
    [--self-answer] [--page-images]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m grouprl.data.tasks.slides_files", description=__doc__.split("\n")[0]
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
