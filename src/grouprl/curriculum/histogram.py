"""histogram.png: the distribution of per-uid mean scores, bars coloured by bucket, with the
two thresholds drawn. Pillow only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

WIDTH, HEIGHT = 800, 460
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 60  # margins around the plot area
COLOURS = {"mastered": (76, 145, 65), "edge": (222, 140, 30), "unsolvable": (120, 120, 120)}
THRESHOLD_COLOURS = {"easy": (30, 90, 200), "hard": (200, 40, 40)}


def draw_histogram(
    mean: np.ndarray, *, easy: float, hard: float, path: Path, title: str, bins: int = 20
) -> None:
    lo = min(0.0, float(mean.min()) if len(mean) else 0.0, hard)
    hi = max(1.0, float(mean.max()) if len(mean) else 1.0, easy)
    counts, edges = np.histogram(mean, bins=bins, range=(lo, hi))
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top_count = max(int(counts.max()) if len(counts) else 0, 1)

    def x_of(value: float) -> float:
        return LEFT + (value - lo) / (hi - lo) * plot_w

    def y_of(count: float) -> float:
        return TOP + plot_h - count / top_count * plot_h

    for count, left, right in zip(counts, edges[:-1], edges[1:]):
        centre = (left + right) / 2
        bucket = "mastered" if centre > easy else "unsolvable" if centre < hard else "edge"
        if count:
            draw.rectangle([x_of(left) + 1, y_of(count), x_of(right) - 1, y_of(0)], fill=COLOURS[bucket])
    draw.line([LEFT, TOP + plot_h, LEFT + plot_w, TOP + plot_h], fill="black")
    draw.line([LEFT, TOP, LEFT, TOP + plot_h], fill="black")
    for tick in np.linspace(lo, hi, 6):
        draw.line([x_of(tick), TOP + plot_h, x_of(tick), TOP + plot_h + 4], fill="black")
        draw.text((x_of(tick) - 10, TOP + plot_h + 8), f"{tick:.2f}", fill="black", font=font)
    for tick in np.linspace(0, top_count, 5):
        draw.text((8, y_of(tick) - 6), f"{int(round(tick))}", fill="black", font=font)
    for name, value in (("easy", easy), ("hard", hard)):
        x = x_of(value)
        for y in range(TOP, TOP + plot_h, 8):  # dashed
            draw.line([x, y, x, min(y + 4, TOP + plot_h)], fill=THRESHOLD_COLOURS[name], width=2)
        draw.text(
            (x + 4, TOP + 2 if name == "easy" else TOP + 16),
            f"{name} = {value:g}",
            fill=THRESHOLD_COLOURS[name],
            font=font,
        )
    draw.text((LEFT, 12), title, fill="black", font=font)
    draw.text((LEFT + plot_w // 2 - 60, HEIGHT - 24), "mean score per uid", fill="black", font=font)
    legend_x = LEFT + plot_w - 260
    for i, (bucket, colour) in enumerate(COLOURS.items()):
        draw.rectangle([legend_x + i * 88, 12, legend_x + i * 88 + 10, 22], fill=colour)
        draw.text((legend_x + i * 88 + 14, 12), bucket, fill="black", font=font)
    image.save(path, format="PNG")
