"""An observation within `agent.max_observation_tokens`, counted as the policy is fed it: the
chat template's turn markers, the images' tokens and the text together.

Images come first (a search's page is what `<bbox>` refers to): when they take more than their
share, each is processed again at fewer pixels (aspect kept, the pixels scaled by the share over
the tokens they took, a few times at most), and those that still do not fit are left out, last
first. The text then gets what is left, cut at a token and marked " [...]". Trajectory lengths,
the memory plan's context and vLLM's `max_model_len` rely on this bound.
"""

from __future__ import annotations

import math
from typing import Any

from grouprl.errors import ConfigError
from grouprl.vision.images import IMAGE_PLACEHOLDER

CUT_MARK = " [...]"
SHRINK_TRIES = 3


def image_pixels(image) -> int:
    """Pixels of the image a processed ImageInput was made from (its source, else its shown size)."""
    source = getattr(image, "source", None)
    width, height = source.size if source is not None else image.shown_size
    return width * height


def image_tokens(vision, image) -> int:
    """The tokens an image takes in the ids: its expansion (image tokens and the family's
    markers around them, tile tags included)."""
    return len(vision.tokenizer(image.text, add_special_tokens=False)["input_ids"])


def fit_images(vision, originals: list[Any], shown: list, budget: int) -> list:
    """`shown` (the processed `originals`) within `budget` tokens: shrunk, then the last ones
    left out. Returns the images kept, in order (a prefix of the originals)."""
    for _ in range(SHRINK_TRIES):
        total = sum(image_tokens(vision, image) for image in shown)
        if total <= budget or budget <= 0:
            break
        scale = budget / total * 0.95  # tokens grow about linearly with pixels; a margin for rounding
        smaller = [
            vision.prepare_image(original, max_pixels=max(1, math.floor(image_pixels(image) * scale)))
            for original, image in zip(originals, shown)
        ]
        if sum(image_tokens(vision, image) for image in smaller) >= total:
            break  # a processor of a fixed size per image (tiles): fewer pixels, as many tokens
        shown = smaller
    while shown and sum(image_tokens(vision, image) for image in shown) > max(budget, 0):
        shown = shown[:-1]
    return shown


def clipped_observation(chat, tokenizer, text: str, last: str, closing, shown: list, expand, limit: int):
    """(placed text, token ids) of the observation `text` (then `last`, never cut) with the
    images `shown` before it, within `limit` tokens (0: no limit): the text cut as needed."""
    body = text
    for _ in range(4):  # re-tokenising a cut text can differ by a token or two at the cut
        placed = IMAGE_PLACEHOLDER * len(shown) + body + last
        ids = chat.observation_ids(placed, closing, images=shown or None, expand=expand if shown else None)
        excess = len(ids) - limit if limit else 0
        if excess <= 0 or not body:
            return placed, ids
        tokens = tokenizer(body.removesuffix(CUT_MARK), add_special_tokens=False)["input_ids"]
        keep = len(tokens) - excess - len(tokenizer(CUT_MARK, add_special_tokens=False)["input_ids"])
        body = tokenizer.decode(tokens[:keep]) + CUT_MARK if keep > 0 else ""
    return placed, ids


def check_limit(tokenizer, cfg) -> None:
    """A limit (`cfg`: the agent section) below what an observation's turn markers and the longer
    last-turn note take alone cannot hold any observation: one line naming the setting."""
    from grouprl.rollout.agent_prompts import LAST_TURN
    from grouprl.rollout.chat import ChatRenderer

    limit = cfg.max_observation_tokens
    if not limit:
        return
    need = len(ChatRenderer(tokenizer, cfg.observation_role).observation_ids("\n\n" + max(LAST_TURN.values(), key=len))) + 1
    if limit < need:
        raise ConfigError(
            f"agent.max_observation_tokens={limit} is below the {need} tokens an observation takes with its chat "
            "turn markers, the last turn's note and one token of text: raise it (0 = no limit)"
        )


def fixed_tokens(chat, last: str, closing) -> int:
    """The tokens of an observation without its text and images: turn markers and `last`."""
    return len(chat.observation_ids(last, closing))
