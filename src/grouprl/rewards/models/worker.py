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
    parts = [cfg.kind, cfg.path, cfg.base_url, cfg.dtype, cfg.height, cfg.width, cfg.steps, cfg.guidance_scale]
    parts += [prompt, seed]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


class Models:
    """The loaded models by name and the image cache; `call(name, items)` answers one batch."""

    def __init__(self, configs: list, cache_dir: str) -> None:
        self.configs = {c.name: c for c in configs}
        self.models = {c.name: load(c) for c in configs}
        self.cache = Path(cache_dir)

    def call(self, name: str, items: list[dict[str, Any]]) -> list[Any]:
        """One result per item; an item whose image could not be drawn gets {"error": why}."""
        cfg = self.configs[name]
        if cfg.kind == "sequence_classifier":
            return self.models[name].classify([i["prompt"] for i in items], [i["response"] for i in items])
        paths = self.images(cfg.images_from, [i["draw"] for i in items], [i["seed"] for i in items])
        from PIL import Image

        drawn = [k for k, p in enumerate(paths) if isinstance(p, Path)]
        images = []
        for k in drawn:
            with Image.open(paths[k]) as image:
                images.append(image.convert("RGB"))
        scores = self.models[name].score(images, [items[k]["text"] for k in drawn]) if drawn else []
        results: list[Any] = [{"error": p} for p in paths]
        for k, score in zip(drawn, scores):
            results[k] = [float(score), str(paths[k])]
        return results

    def images(self, drawer: str, prompts: list[str], seeds: list[int]) -> list[Path | str]:
        """Each prompt's image file, from the cache or drawn (in the drawer's batches) and cached;
        where drawing failed, why (a failed batch is drawn again one prompt at a time, so one
        bad prompt costs only its own image)."""
        cfg = self.configs[drawer]
        paths: list[Path | str] = []
        for prompt, seed in zip(prompts, seeds):
            key = cache_key(cfg, prompt, seed)
            paths.append(self.cache / key[:2] / f"{key}.png")
        unique: dict[Path, int] = {}  # a prompt drawn once per call, however many ask for it
        for i, path in enumerate(paths):
            if not path.is_file():
                unique.setdefault(path, i)
        todo = list(unique.values())
        failed: dict[int, str] = {}
        for start in range(0, len(todo), cfg.batch_size):
            chunk = todo[start : start + cfg.batch_size]
            try:
                failed.update(self._draw(drawer, chunk, prompts, seeds, paths))
            except Exception:  # noqa: BLE001 - find the prompt at fault
                for i in chunk:
                    try:
                        failed.update(self._draw(drawer, [i], prompts, seeds, paths))
                    except Exception as e:  # noqa: BLE001 - this prompt's image fails, not the call
                        failed[i] = _describe(e)
        for i, path in enumerate(paths):
            first = unique.get(path) if isinstance(path, Path) else None
            if first is not None and first in failed:
                paths[i] = failed[first]
        return paths

    def _draw(self, drawer: str, chunk: list[int], prompts, seeds, paths) -> dict[int, str]:
        """Draw and cache the chunk's images; a drawer may answer an exception for one prompt
        (a service's request), which is returned, by index, instead of its image."""
        drawn = self.models[drawer].draw([prompts[i] for i in chunk], [seeds[i] for i in chunk])
        failed = {}
        for i, image in zip(chunk, drawn):
            if isinstance(image, BaseException):
                failed[i] = _describe(image)
                continue
            paths[i].parent.mkdir(parents=True, exist_ok=True)
            tmp = paths[i].with_suffix(f".tmp{os.getpid()}.png")
            image.save(tmp)
            os.replace(tmp, paths[i])  # a complete file or none: the cache is never half-written
        return failed


def _describe(e: BaseException) -> str:
    """One line for a failure: type, message, and where it was raised."""
    last = traceback.extract_tb(e.__traceback__)[-1:]
    where = f" ({Path(last[0].filename).name}:{last[0].lineno})" if last else ""
    return f"{type(e).__name__}: {e}{where}"


def serve(conn, configs: list, cache_dir: str) -> None:
    """The worker process: load, say ready (or why not), then answer (id, name, items) until None."""
    try:
        import torch

        # the trainer's reason (trainer.models.shape_stable_attention): texts of every length
        # would make cuDNN's fused attention build a graph per batch shape
        torch.backends.cuda.enable_cudnn_sdp(False)
        models = Models(configs, cache_dir)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer as one line
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    try:
        _answer(conn, models)
    except (KeyboardInterrupt, BrokenPipeError, EOFError):  # the trainer stops or is gone
        return


def _answer(conn, models: Models) -> None:
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
            result = ("error", _describe(e))
        conn.send((call_id, *result, time.perf_counter() - start))
