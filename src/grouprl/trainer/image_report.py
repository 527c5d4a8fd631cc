"""Before/after report of a run whose reward draws images (text-to-image -> scorer): for the
held-out prompts, the image of the request as written, of the policy's rewrite before training
and after it (same seeds: a prompt's images differ only by the text drawn), with their scores.

    <run>/report/grid.png    rows = held-out prompts; columns = as written | before | after
    <run>/report/scores.csv  prompt, each column's text and score
and one line: the mean score of each column.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

CELL = 128  # pixels per image in the grid
CAPTION = 14  # pixels of text under each image


def eval_rows(trajectories, prompt_of) -> list[dict[str, Any]]:
    """What the report keeps of an evaluation: per trajectory its prompt, response, composite
    reward and the first image a reward model drew for it (None when none did)."""
    return [
        {
            "uid": t.uid,
            "prompt": prompt_of(t),
            "text": t.response_text,
            "score": t.reward,
            "image": next(iter(t.artifacts.values()), None),
        }
        for t in trajectories
    ]


def write_report(
    folder: Path,
    originals: list[dict],
    before: list[dict],
    after: list[dict],
    steps: tuple[int, int],
    rows: int = 8,
) -> str:
    """grid.png and scores.csv in `folder`; returns the summary line."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    by_uid = [{r["uid"]: r for r in column} for column in (originals, before, after)]
    uids = [r["uid"] for r in originals if all(r["uid"] in column for column in by_uid)]
    columns = ("as written", f"before (step {steps[0]})", f"after (step {steps[1]})")

    with open(folder / "scores.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["uid", "prompt", *(x for name in columns for x in (f"{name}: text", f"{name}: score"))])
        for uid in uids:
            cells = [by_uid[k][uid] for k in range(3)]
            out.writerow(
                [uid, cells[0]["prompt"], *(x for c in cells for x in (c["text"], f"{c['score']:.4f}"))]
            )

    shown = uids[:rows]
    grid = Image.new("RGB", (3 * CELL, CAPTION + len(shown) * (CELL + CAPTION)), "white")
    draw = ImageDraw.Draw(grid)
    for k, name in enumerate(columns):
        draw.text((k * CELL + 3, 1), name, fill="black")
    for row, uid in enumerate(shown):
        top = CAPTION + row * (CELL + CAPTION)
        for k in range(3):
            cell = by_uid[k][uid]
            if cell["image"] and Path(cell["image"]).is_file():
                with Image.open(cell["image"]) as image:
                    grid.paste(image.convert("RGB").resize((CELL, CELL), Image.NEAREST), (k * CELL, top))
            draw.text((k * CELL + 3, top + CELL + 1), f"{cell['score']:.2f}", fill="black")
    grid.save(folder / "grid.png")

    means = [sum(by_uid[k][u]["score"] for u in uids) / max(len(uids), 1) for k in range(3)]
    return (
        f"image score (held-out, {len(uids)} prompts): as written {means[0]:.3f}; "
        f"rewritten {means[1]:.3f} before -> {means[2]:.3f} after ({means[2] - means[1]:+.3f})"
    )
