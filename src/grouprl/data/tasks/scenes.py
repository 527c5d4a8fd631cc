"""Picture requests to rewrite for a renderer: the built-in task of the model-reward demo.

Each sample is a short free-form request ("a pair of crimson balls in the upper left and a navy
box at the bottom right"); the policy answers with a description in the renderer's language
(`2 red circles top-left; 1 blue square bottom-right`, see `scene_language`). The reward draws
the answer with `SceneRenderer` and scores the picture against the request with `SceneScorer`
(`grouprl.rewards.models.scenes`), as a diffusion model and CLIP would in the source recipe.

ground_truth is the canonical description; extra_info holds the request and its clauses.
Deterministic for a (seed, split, max_clauses): every split draws from its own random stream, and
a scene belongs to val when a hash of its canonical description falls in one bucket of
`VAL_SHARE`, so the splits never share a scene (nor the example's).
"""

from __future__ import annotations

import hashlib
import random

from grouprl.data.sample import Sample
from grouprl.data.tasks.scene_language import (
    COLOURS,
    COUNTS,
    REGIONS,
    SHAPES,
    Clause,
    describe,
    parse_request,
    phrase_request,
)
from grouprl.errors import ConfigError

# Calibrated on SmolLM2-135M-Instruct (temperature 1, 40 tokens): mean reward ~0.14 zero-shot.
SYSTEM_PROMPT = (
    "Translate the picture request into the renderer's words. The renderer knows only: 1, 2, 3; "
    "red, green, blue, yellow; circle, square, triangle; top-left, top-right, bottom-left, bottom-right. "
    "Write each group as: number colour shape place. Separate groups with ';'."
)
EXAMPLE_REQUEST = "a pair of scarlet discs in the lower right and a single lemon block at the top left"
EXAMPLE_DESCRIPTION = describe(parse_request(EXAMPLE_REQUEST))  # 2 red circles bottom-right; 1 yellow ...
DATA_SOURCE = "grouprl/scenes"
SPLITS = ("train", "val")
VAL_SHARE = 8  # one scene in VAL_SHARE (by the hash of its description) is held out


def split_of(description: str) -> str:
    """The split a scene belongs to, fixed by its canonical description alone."""
    bucket = int(hashlib.sha1(description.encode("utf-8")).hexdigest()[:8], 16) % VAL_SHARE
    return "val" if bucket == 0 else "train"


def scene_messages(request: str, *, few_shot: bool = True) -> list[dict[str, str]]:
    """System instruction, optionally one worked example, then the request."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    if few_shot:
        messages += [
            {"role": "user", "content": EXAMPLE_REQUEST},
            {"role": "assistant", "content": EXAMPLE_DESCRIPTION},
        ]
    messages.append({"role": "user", "content": request})
    return messages


def _scene(rng: random.Random, max_clauses: int) -> tuple[Clause, ...]:
    regions = rng.sample(REGIONS, rng.randint(1, max_clauses))
    return tuple(
        Clause(rng.choice(COUNTS), rng.choice(list(COLOURS)), rng.choice(SHAPES), r) for r in regions
    )


def make_scenes(
    n: int, seed: int, split: str = "train", *, few_shot: bool = True, max_clauses: int = 2
) -> list[Sample]:
    """`n` distinct requests of `split` ("train" or "val") with one to `max_clauses` (1 or 2)
    groups of shapes; the same arguments give the same list. uid: `scenes-<split>-<index:05d>`."""
    if split not in SPLITS:
        raise ConfigError(f"scenes split must be one of {', '.join(SPLITS)}, got {split!r}")
    if max_clauses not in (1, 2):
        raise ConfigError(f"scenes max_clauses must be 1 or 2, got {max_clauses}")
    if n < 0:
        raise ConfigError(f"scenes needs n >= 0 requests, got {n}")
    rng = random.Random(f"{DATA_SOURCE}/{split}/{seed}/{max_clauses}")
    samples: list[Sample] = []
    seen = {EXAMPLE_REQUEST}
    attempts_left = 100 * n + 1000  # the request space is far larger; this only stops a bad change
    while len(samples) < n:
        attempts_left -= 1
        if attempts_left < 0:
            raise ConfigError(
                f"scenes could make only {len(samples)} distinct {split} requests, asked for {n}"
            )
        clauses = _scene(rng, max_clauses)
        description = describe(clauses)
        request = phrase_request(clauses, rng)
        if request in seen or description == EXAMPLE_DESCRIPTION or split_of(description) != split:
            continue
        seen.add(request)
        index = len(samples)
        samples.append(
            Sample(
                uid=f"scenes-{split}-{index:05d}",
                messages=scene_messages(request, few_shot=few_shot),
                ground_truth=description,
                data_source=DATA_SOURCE,
                extra_info={
                    "index": index,
                    "split": split,
                    "request": request,
                    "clauses": [c._asdict() for c in clauses],
                    "seed": seed,
                },
            )
        )
    return samples
