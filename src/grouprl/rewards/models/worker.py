"""The reward-model worker: a separate process that loads every configured model on its own
device and answers batched calls over a pipe, so heavy scoring never runs on the trainer's
threads. Drawn images are cached on disk by (drawer settings, prompt, seed).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from grouprl.rewards.models.kinds import load


def cache_key(cfg, prompt: str, seed: int) -> str:
    """What makes a drawn image: the drawer and its settings, the prompt, the seed."""
    parts = [cfg.kind, cfg.path, cfg.dtype, cfg.height, cfg.width, cfg.steps, cfg.guidance_scale, prompt, seed]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


class Models:
    """The loaded models by name and the image cache; `call(name, items)` answers one batch."""

    def __init__(self, configs: list, cache_dir: str) -> None:
        self.configs = {c.name: c for c in configs}
        self.models = {c.name: load(c) for c in configs}
        self.cache = Path(cache_dir)

    def call(self, name: str, items: list[dict[str, Any]]) -> list[Any]:
        cfg = self.configs[name]
        if cfg.kind == "sequence_classifier":
            return self.models[name].classify([i["prompt"] for i in items], [i["response"] for i in items])
        paths = self.images(cfg.images_from, [i["draw"] for i in items], [i["seed"] for i in items])
        from PIL import Image

        images = []
        for path in paths:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        scores = self.models[name].score(images, [i["text"] for i in items])
        return [[float(s), str(p)] for s, p in zip(scores, paths)]

    def images(self, drawer: str, prompts: list[str], seeds: list[int]) -> list[Path]:
        """Each prompt's image file: from the cache, or drawn (in the drawer's batches) and cached."""
        cfg = self.configs[drawer]
        paths = []
        for prompt, seed in zip(prompts, seeds):
            key = cache_key(cfg, prompt, seed)
            paths.append(self.cache / key[:2] / f"{key}.png")
        unique: dict[Path, int] = {}  # a prompt drawn once per batch, however many ask for it
        for i, path in enumerate(paths):
            if not path.is_file():
                unique.setdefault(path, i)
        todo = list(unique.values())
        for start in range(0, len(todo), cfg.batch_size):
            chunk = todo[start : start + cfg.batch_size]
            drawn = self.models[drawer].draw([prompts[i] for i in chunk], [seeds[i] for i in chunk])
            for i, image in zip(chunk, drawn):
                paths[i].parent.mkdir(parents=True, exist_ok=True)
                tmp = paths[i].with_suffix(f".tmp{os.getpid()}.png")
                image.save(tmp)
                os.replace(tmp, paths[i])  # a complete file or none: the cache is never half-written
        return paths


def serve(conn, configs: list, cache_dir: str) -> None:
    """The worker process: load, say ready (or why not), then answer (id, name, items) until None."""
    try:
        models = Models(configs, cache_dir)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer as one line
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        call_id, name, items = message
        start = time.perf_counter()
        try:
            result = ("ok", models.call(name, items))
        except Exception as e:  # noqa: BLE001 - one batch's fault; the client retries items one by one
            last = traceback.extract_tb(e.__traceback__)[-1:]
            where = f" ({Path(last[0].filename).name}:{last[0].lineno})" if last else ""
            result = ("error", f"{type(e).__name__}: {e}{where}")
        conn.send((call_id, *result, time.perf_counter() - start))
