"""Questions about drawn scenes, generated offline with Pillow: the built-in task for VLM policies.

Each sample is one small image (PNG bytes) and one question of four kinds, answered with one
word in `<answer></answer>`:
- colour: one shape; red, green, blue or yellow;
- shape: one shape; circle, square or triangle;
- count: 1-4 shapes of one kind and colour; the number as a digit;
- side: one shape in the left or right half; left or right.
Guessing within the kind scores 1/4, 1/3, 1/4 and 1/2: about 0.33 over the mix.

Deterministic for a (seed, split): every split draws from its own random stream, and a scene
belongs to val when a hash of its description falls in one bucket of `VAL_SHARE`, so the two
splits never share a scene. `conversations` gives gold SFT conversations of the same scenes.
"""

from __future__ import annotations

import hashlib
import io
import random
from dataclasses import dataclass

from grouprl.data.sample import Sample
from grouprl.errors import ConfigError

SYSTEM_PROMPT = "Look at the image and answer with one word in <answer></answer>."
DATA_SOURCE = "grouprl/shapes"
SPLITS = ("train", "val")
VAL_SHARE = 8
SIZE = 64  # pixels a side
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "What shape is it?",
    "count": "How many shapes are there?",
    "side": "Is the shape on the left or on the right?",
}
KINDS = tuple(QUESTIONS)


@dataclass(frozen=True)
class Scene:
    kind: str
    shape: str
    colour: str
    boxes: tuple[tuple[int, int, int], ...]  # (x, y, size) of each shape: top-left corner and side
    answer: str

    def description(self) -> str:
        return f"{self.kind}|{self.shape}|{self.colour}|{self.boxes}"


def _scene(rng: random.Random) -> Scene:
    kind = rng.choice(KINDS)
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    count = rng.randint(1, 4) if kind == "count" else 1
    size = rng.randint(22, 28) if count == 1 else rng.randint(12, 16)  # large: a tile of the tower sees it
    boxes: list[tuple[int, int, int]] = []
    while len(boxes) < count:  # shapes apart from each other
        x, y = rng.randint(2, SIZE - size - 2), rng.randint(2, SIZE - size - 2)
        if kind == "side":  # clearly in one half
            x = rng.randint(2, SIZE // 2 - size - 2) if rng.random() < 0.5 else rng.randint(SIZE // 2 + 2, SIZE - size - 2)
        if all(abs(x - bx) > max(size, bs) + 1 or abs(y - by) > max(size, bs) + 1 for bx, by, bs in boxes):
            boxes.append((x, y, size))
    answer = {
        "colour": colour,
        "shape": shape,
        "count": str(count),
        "side": "left" if boxes[0][0] + size / 2 < SIZE / 2 else "right",
    }[kind]
    return Scene(kind, shape, colour, tuple(boxes), answer)


def draw(scene: Scene) -> bytes:
    """The scene as PNG bytes (light grey background)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (235, 235, 235))
    pen = ImageDraw.Draw(image)
    fill = COLOURS[scene.colour]
    for x, y, s in scene.boxes:
        if scene.shape == "circle":
            pen.ellipse((x, y, x + s, y + s), fill=fill)
        elif scene.shape == "square":
            pen.rectangle((x, y, x + s, y + s), fill=fill)
        else:
            pen.polygon([(x + s / 2, y), (x, y + s), (x + s, y + s)], fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _in_split(scene: Scene, split: str) -> bool:
    bucket = int(hashlib.sha1(scene.description().encode()).hexdigest(), 16) % VAL_SHARE
    return (bucket == 0) == (split == "val")


def scenes(n: int, seed: int, split: str) -> list[Scene]:
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    rng = random.Random(f"shapes/{seed}/{split}")
    out: list[Scene] = []
    seen: set[str] = set()
    while len(out) < n:
        scene = _scene(rng)
        if _in_split(scene, split) and scene.description() not in seen:
            seen.add(scene.description())
            out.append(scene)
    return out


def _messages(scene: Scene) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"<image>{QUESTIONS[scene.kind]}"},
    ]


def make_shapes(n: int, seed: int = 0, split: str = "train", few_shot: bool = False) -> list[Sample]:
    """n samples of `split` (few_shot is accepted and ignored: an image example would cost a
    second image per prompt)."""
    return [
        Sample(
            uid=f"shapes-{split}-{i}",
            messages=_messages(scene),
            ground_truth=scene.answer,
            images=[draw(scene)],
            data_source=DATA_SOURCE,
            extra_info={"kind": scene.kind},
        )
        for i, scene in enumerate(scenes(n, seed, split))
    ]


def conversations(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """Gold SFT conversations (`messages` ending with the answer, `images`), the task's scenes."""
    return [
        {
            "id": f"shapes-{split}-{i}",
            "messages": [*_messages(scene), {"role": "assistant", "content": f"<answer>{scene.answer}</answer>"}],
            "images": [draw(scene)],
        }
        for i, scene in enumerate(scenes(n, seed, split))
    ]
