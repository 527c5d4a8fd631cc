"""The slide-deck task on disk (see `grouprl.data.tasks.slides`): the corpus, slide images and
the train / held-out questions in the verl layout, written by `write_slides_data`. The gold
search trajectories for SFT are the agent's to write (`grouprl.rollout.gold.write_slides_task`
writes these files and them, and is the task's command: `python -m grouprl.rollout.gold`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl.data.sample import Sample
from grouprl.data.tasks.slides import (
    DATA_SOURCE,
    Question,
    Slide,
    make_corpus,
    make_questions,
    to_sample,
)
from grouprl.errors import ConfigError

IMAGES_DIR = "images"  # the slide images' folder inside the task folder

log = logging.getLogger(__name__)


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
class SlidesData:
    """Where `write_slides_data` put things, and the questions it wrote."""

    corpus: Path  # corpus.jsonl
    images: Path  # images/ folder
    train: Path  # train.parquet (verl layout)
    val: Path  # val.parquet
    questions: dict[str, list[Question]]  # by split
    samples: dict[str, list[Sample]]  # by split, as the parquet files hold them


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def _verl_record(sample) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": sample.messages,
        "reward_model": {"style": "rule", "ground_truth": sample.ground_truth},
        "extra_info": sample.extra_info,
    }


def write_slides_data(
    out_dir: str | Path,
    seed: int = 0,
    n_train: int = 200,
    n_val: int = 50,
    *,
    n_decks: int = 12,
    slides_per_deck: tuple[int, int] = (7, 11),
    two_slide_share: float = 0.2,
    image_size: tuple[int, int] = (480, 270),
) -> SlidesData:
    """Write the corpus, slide images and train/val questions under `out_dir` (the same arguments
    give byte-identical files); returns where, with each split's questions and samples."""
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    data = SlidesData(out / "corpus.jsonl", images, out / "train.parquet", out / "val.parquet", questions, {})
    write_jsonl(
        data.corpus,
        [{"id": s.id, "title": s.title, "text": s.text, "image": f"{IMAGES_DIR}/{s.id}.png"} for s in slides],
    )
    for split, parquet in (("train", data.train), ("val", data.val)):
        data.samples[split] = [to_sample(q, i, split, seed) for i, q in enumerate(questions[split])]
        pq.write_table(pa.Table.from_pylist([_verl_record(s) for s in data.samples[split]]), parquet)
    log.info("slides task: %d slides, %d train / %d held-out questions in %s", len(slides), n_train, n_val, out)
    return data
