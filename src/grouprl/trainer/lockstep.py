"""Passes in step across ranks: what lets a policy stay sharded (ZeRO-3) through the update.

FSDP2 gathers a layer's weights when the layer runs forward and again for its backward, and
reduce-scatters its gradients at the end of its backward: each of these is a collective that
every rank must make, in the same order. Ranks hold different rows (other prompt lengths, token
budgets, images on some ranks only), so left alone they would run different numbers of passes
and touch different modules. Three rules keep them in step:

- every micro-batch is one pass (its prompts run inside it: no prefix or opening shared across
  passes, whose separate forward and backward would interleave differently on each rank), and
  every rank runs as many passes as the rank with the most (`pass_count`), the others padded
  with a pass of zero weight over one pad token (`pad_batch`) that takes the same path;
- when any rank's rows of the mini-batch have images, every pass on every rank first runs the
  vision tower on its images, or on the family's blank image when it has none (`PassImages`),
  as a forward of its own: its features enter the pass as detached leaves, and the tower's
  backward runs after the pass's, with the leaves' gradient (zeros for the blank). The tower's
  collectives therefore come at the same point on every rank, whichever rows hold the images;
- the language model's graph is the same on every rank: the features' leaves enter every
  embedding of the pass (times zero where unused), so that even a frozen language model under a
  trainable tower runs its backward on every rank alike.

In one process none of this applies: the updater shares prefixes and openings across
micro-batches (update.py).
"""

from __future__ import annotations

import torch

from grouprl.trainer.logprobs import ResponseBatch
from grouprl.trainer.parallel import Ranks, run


def pass_count(ranks: Ranks, mine: int, *flags: float) -> tuple[int, ...]:
    """The most passes any rank has (`mine` here) and the largest of each flag over the ranks."""
    most = ranks.reduce([float(mine), *map(float, flags)], "max")
    return (int(most[0]), *(int(v) for v in most[1:]))


def pad_batch(pad_token_id: int, device) -> ResponseBatch:
    """One row: a one-token prompt and one response token, both the pad token: a pass of zero
    weight through the same modules as any other."""
    ids = torch.full((1, 1), pad_token_id, dtype=torch.long, device=device)
    return ResponseBatch([[pad_token_id]], ids, torch.ones_like(ids))


def pass_images(batch: ResponseBatch) -> list:
    """The distinct images of a pass's rows (prompts' and responses'), in order of first sight;
    equal pixels are one image."""
    seen: dict = {}
    for rows in (batch.prompt_images or [], batch.response_images or []):
        for row in rows:
            for image in row:
                seen.setdefault(image.key or id(image), image)
    return list(seen.values())


class PassImages:
    """The image features of one pass, computed before it by a forward of their own: `family`
    is the VLM family the pass runs with (its features come from here), `backward()` runs the
    tower's backward once the pass's own is done."""

    def __init__(self, model, family, batch: ResponseBatch | None, autocast):
        images = pass_images(batch) if batch is not None else []
        self.blank = not images
        images = images or [family.blank()]
        with autocast:
            self.whole = run(model, family.features, images)  # [tokens of every image, H]
        self.leaf = self.whole.detach().requires_grad_(self.whole.requires_grad)
        self.rows: dict = {}
        start = 0
        for image in images:
            self.rows[image.key or id(image)] = (start, image.num_tokens)
            start += image.num_tokens
        self.family = _Precomputed(family, self)

    def features(self, images: list) -> torch.Tensor:
        parts = [self.leaf.narrow(0, *self.rows[image.key or id(image)]) for image in images]
        return torch.cat(parts) if parts else self.leaf[:0]

    def backward(self) -> None:
        """The tower's and connector's backward, with what the pass left on the leaves (exact
        zeros for a blank image: the tower's reductions are made, its gradients unchanged)."""
        if self.whole.requires_grad:
            grad = self.leaf.grad if self.leaf.grad is not None else torch.zeros_like(self.leaf)
            self.whole.backward(grad)


class _Precomputed:
    """A VLM family whose image features are a pass's precomputed ones, and whose every
    embedding depends on them (times zero where none is placed)."""

    def __init__(self, family, images: PassImages):
        self._family, self._images = family, images

    def __getattr__(self, name: str):
        return getattr(self._family, name)

    def features(self, model, images: list) -> torch.Tensor:
        return self._images.features(images)

    def embed(self, model, ids: torch.Tensor, images: list) -> torch.Tensor:
        embeds = type(self._family).embed(self, model, ids, images)
        leaf = self._images.leaf
        return embeds + (leaf.sum() * 0).to(embeds.dtype) if leaf.requires_grad else embeds
