"""Pillow stand-ins for a text-to-image model and CLIP, for the offline scenes demo.

`SceneRenderer` draws what the description language says (`2 red circles top-left; 1 blue
square bottom-right`, see `grouprl.data.tasks.scene_language`), choosing from its seed what a
clause leaves unsaid: free-form English with synonyms draws nothing or the wrong picture, so a
policy earns reward by learning to rewrite requests into descriptions.
`SceneScorer` reads the original free-form request and checks the picture by its pixels.

Score of an image against a request of K clauses (count n, colour c, shape s, region r):
    O      = the objects of colour c in region r, m = |O|
    clause = 1/2 + count/4 + shape/4 when m > 0, with count = min(m, n) / max(m, n) and
             shape = the share of O whose shape is s;
             when m = 0 a near miss: NEAR x (some object of colour c anywhere)
                                   + NEAR x (some object of any colour in region r)
    recall    = mean of the clauses
    precision = the share of objects whose (colour, region) some clause asks for (1 if none drawn)
    score     = recall x (1 + precision) / 2
where an object is a connected blob (8-neighbourhood) of one palette colour, its region is the
quadrant of its centroid, and its shape is read from how much of its bounding box it fills.
Precision makes drawing everything everywhere a poor bet: a policy that sprays groups over the
quadrants collects near misses and the odd hit, and loses up to half of it.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

import numpy as np

from grouprl.data.tasks.scene_language import (
    BACKGROUND,
    COLOURS,
    COUNTS,
    REGIONS,
    SHAPES,
    Clause,
    Said,
    parse_description,
    parse_request,
)

NEAR = 0.1  # a clause's credit for its colour somewhere or something in its region, when missed
# Centres of the objects of a group, as fractions of the quadrant's side; the seed picks one.
LAYOUTS = {
    1: (((0.5, 0.5),),),
    2: (
        ((0.27, 0.5), (0.73, 0.5)),
        ((0.5, 0.27), (0.5, 0.73)),
        ((0.27, 0.27), (0.73, 0.73)),
        ((0.73, 0.27), (0.27, 0.73)),
    ),
    3: (((0.25, 0.27), (0.75, 0.27), (0.5, 0.75)), ((0.25, 0.73), (0.75, 0.73), (0.5, 0.25))),
}
SIZE_SHARE = {1: 0.45, 2: 0.33, 3: 0.28}  # an object's side, as a fraction of the quadrant's
JITTER = {1: 0.09, 2: 0.04, 3: 0.03}  # largest shift of a group, as a fraction of the quadrant's
COLOUR_TOLERANCE = 60  # largest L1 distance of a pixel to its palette colour
SQUARE_FILL, CIRCLE_FILL = 0.9, 0.65  # fill of the bounding box: square ~1, circle ~0.78, triangle ~0.52


class SceneRenderer:
    """Description -> RGB picture, deterministic for (prompt, seed). The seed jitters where and
    how large the objects are and fills in what a clause leaves unsaid, drawing the same numbers
    for a clause whatever it says, so equal seeds give pictures that differ only by prompt."""

    def __init__(self, size: int = 64) -> None:
        if size < 48:
            raise ValueError(f"scene pictures need at least 48 pixels a side, got {size}")
        self.size = size

    def __call__(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        return [self.draw(parse_description(p), s) for p, s in zip(prompts, seeds)]

    def draw(self, clauses: list[Said], seed: int) -> Any:
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (self.size, self.size), BACKGROUND)
        pen = ImageDraw.Draw(image)
        q = self.size // 2
        for index, said in enumerate(clauses):
            rng = random.Random(f"{seed}/{index}")  # a clause's draws do not depend on the others
            unsaid = Clause(
                rng.choice(COUNTS), rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(REGIONS)
            )
            clause = Clause(*(s if s is not None else u for s, u in zip(said, unsaid)))
            left = q if clause.region.endswith("right") else 0
            top = q if clause.region.startswith("bottom") else 0
            layout = rng.choice(LAYOUTS[clause.count])
            shift = max(1, round(JITTER[clause.count] * q))
            side = round(SIZE_SHARE[clause.count] * q) + rng.randint(-1, 1)
            dx, dy = rng.randint(-shift, shift), rng.randint(-shift, shift)
            for cx, cy in layout:  # the group moves as one: its objects never touch
                x = left + round(cx * q - side / 2) + dx
                y = top + round(cy * q - side / 2) + dy
                _shape(pen, clause.shape, x, y, side - 1, COLOURS[clause.colour])
        return image


def _shape(pen: Any, shape: str, x: int, y: int, extent: int, fill: tuple[int, int, int]) -> None:
    if shape == "circle":
        pen.ellipse((x, y, x + extent, y + extent), fill=fill)
    elif shape == "square":
        pen.rectangle((x, y, x + extent, y + extent), fill=fill)
    else:
        pen.polygon([(x + extent / 2, y), (x, y + extent), (x + extent, y + extent)], fill=fill)


class Blob(NamedTuple):
    """One object found in a picture."""

    colour: str
    region: str
    shape: str
    pixels: int


class SceneScorer:
    """(picture, original request) -> score in [0, 1], by the rule in the module docstring."""

    def __call__(self, images: list[Any], requests: list[str]) -> list[float]:
        if len(images) != len(requests):
            raise ValueError(f"{len(images)} images but {len(requests)} requests")
        wanted = [parse_request(r) for r in requests]  # every request checked before any work
        return [score_blobs(find_blobs(image), clauses) for image, clauses in zip(images, wanted)]


def score_blobs(blobs: list[Blob], clauses: tuple[Clause, ...]) -> float:
    """The score of the objects found against the clauses asked for (see the module docstring)."""
    total, asked = 0.0, {(c.colour, c.region) for c in clauses}
    for c in clauses:
        group = [b for b in blobs if b.colour == c.colour and b.region == c.region]
        m = len(group)
        if m:
            count = min(m, c.count) / max(m, c.count)
            shape = sum(b.shape == c.shape for b in group) / m
            total += 0.5 + count / 4 + shape / 4
        else:
            total += NEAR * any(b.colour == c.colour for b in blobs) + NEAR * any(b.region == c.region for b in blobs)
    precision = sum((b.colour, b.region) in asked for b in blobs) / len(blobs) if blobs else 1.0
    return total / len(clauses) * (1 + precision) / 2


def find_blobs(image: Any) -> list[Blob]:
    """The objects of a picture: connected blobs of one palette colour, specks left out."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)  # [H, W, 3]
    h, w = pixels.shape[:2]
    names = list(COLOURS)
    palette = np.array([COLOURS[n] for n in names], dtype=np.int16)  # [P, 3]
    distance = np.abs(pixels[:, :, None, :] - palette).sum(-1)  # [H, W, P]
    classes = np.where(distance.min(-1) <= COLOUR_TOLERANCE, distance.argmin(-1) + 1, 0)  # [H, W]
    labels = _label(classes)
    smallest = max(4, h * w // 1024)
    blobs = []
    for label in np.unique(labels[classes > 0]):
        ys, xs = np.nonzero(labels == label)
        if len(ys) < smallest:
            continue
        fill = len(ys) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
        shape = "square" if fill >= SQUARE_FILL else "circle" if fill >= CIRCLE_FILL else "triangle"
        vertical = "top" if ys.mean() < h / 2 else "bottom"
        horizontal = "left" if xs.mean() < w / 2 else "right"
        colour = names[classes[ys[0], xs[0]] - 1]
        blobs.append(Blob(colour, f"{vertical}-{horizontal}", shape, len(ys)))
    return blobs


def _label(classes: np.ndarray) -> np.ndarray:
    """Connected components (8-neighbourhood) of equal nonzero classes: each pixel gets the
    smallest flat index in its component (spread by neighbours, then by pointer jumping)."""
    h, w = classes.shape
    foreground = classes > 0
    outside = h * w
    labels = np.where(foreground, np.arange(h * w).reshape(h, w), outside)
    padded = np.pad(classes, 1)
    shifts = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx]
    joined = [foreground & (padded[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] == classes) for dy, dx in shifts]
    while True:
        around = np.pad(labels, 1, constant_values=outside)
        new = labels
        for (dy, dx), join in zip(shifts, joined):
            new = np.where(join, np.minimum(new, around[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w]), new)
        flat = new.ravel()
        new = np.where(foreground, flat[np.minimum(new, outside - 1)], outside)  # jump to the label's label
        if np.array_equal(new, labels):
            return labels
        labels = new
