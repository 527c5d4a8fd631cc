"""Held-out evaluation: `Evaluator` (the trainer's, for `grouprl train` and `grouprl eval`), and
its numbers and files, shared with `grouprl sft`'s accuracy on RL data (`sft.val_rl_files`).

answers.jsonl: one line per held-out sample, in file order (a prompt over
data.max_prompt_length is a line too, marked skipped), so two models' files pair up line by
line: `uid`, `prompt` (the last message), `response`, `rewards`, `reward`, `accuracy`
(reward.val_metric's value), `ground_truth`, `response_tokens`, `finish_reason`, `skipped`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grouprl.config import Config
from grouprl.data import Sample, encode_prompt, fit_prompt
from grouprl.rewards.failures import rewards_down
from grouprl.rollout.engines import SamplingParams, rollout_phase
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.image_report import eval_rows
from grouprl.trainer.loggers import clean
from grouprl.trainer.models import resolve_model_path
from grouprl.trainer.parts import EvalParts
from grouprl.trainer.step import policy_for_generation

Progress = Callable[[int, int], None]  # (done, total) after each chunk


def breakdown_value(sample: Sample, key: str) -> str | None:
    """The group a held-out sample counts in for trainer.val_breakdown (None: no key, or no value)."""
    if not key:
        return None
    value = sample.data_source if key == "data_source" else sample.extra_info.get(key)
    return None if value in (None, "") else str(value)


def score_of(t: Trajectory, metric: str) -> float:
    """The trajectory's value of reward.val_metric ("reward": the composite)."""
    return t.reward if metric == "reward" else t.rewards[metric]


def metrics_of(rows: list[tuple], prefix: str = "val") -> dict[str, float]:
    """accuracy (mean of the metric; NaN, a failed judge, left out), reward, response length, each
    component, and accuracy per breakdown value, from rows of (score, reward, response tokens,
    rewards, breakdown value)."""
    out = {
        f"{prefix}/accuracy": float(np.nanmean([r[0] for r in rows])),
        f"{prefix}/reward": float(np.nanmean([r[1] for r in rows])),
        f"{prefix}/response_length": float(np.mean([r[2] for r in rows])),
    }
    for name in rows[0][3]:
        out[f"{prefix}/{name}"] = float(np.nanmean([r[3][name] for r in rows]))
    for value in sorted({r[4] for r in rows if r[4] is not None}):
        scores = [r[0] for r in rows if r[4] == value and not math.isnan(r[0])]
        if scores:  # a group whose every score failed (NaN) logs nothing
            out[f"{prefix}/accuracy/{value.replace('/', '_')}"] = float(np.mean(scores))
    return out


def rows_of(
    trajectories: list[Trajectory], metric: str, group_of: Callable[[Sample], str | None] | None = None
) -> list[tuple]:
    """What `metrics_of` reads, per trajectory (`group_of`: a sample's breakdown value)."""
    return [
        (score_of(t, metric), t.reward, len(t.response_ids), t.rewards, group_of(t.sample) if group_of else None)
        for t in trajectories
    ]


def _prompt(sample: Sample) -> str:
    return str(sample.messages[-1].get("content", "")) if sample.messages else ""


def answer_record(t: Trajectory, metric: str) -> dict[str, Any]:
    """One answers.jsonl line."""
    return {
        "uid": t.uid,
        "prompt": _prompt(t.sample),
        "response": t.response_text,
        "rewards": {k: clean(v) for k, v in t.rewards.items()},
        "reward": clean(t.reward),
        "accuracy": clean(score_of(t, metric)),
        "ground_truth": t.sample.ground_truth,
        "response_tokens": len(t.response_ids),
        "finish_reason": t.finish_reason,
        "skipped": False,
    }


def skipped_record(sample: Sample) -> dict[str, Any]:
    """The answers.jsonl line of a sample whose prompt was not answered (over-long)."""
    return {
        "uid": sample.uid,
        "prompt": _prompt(sample),
        "response": None,
        "rewards": {},
        "reward": None,
        "accuracy": None,
        "ground_truth": sample.ground_truth,
        "response_tokens": 0,
        "finish_reason": None,
        "skipped": True,
    }


def write_answers(folder: Path, records: list[dict], metrics: dict[str, Any]) -> Path:
    """answers.jsonl and metrics.json in `folder` (replacing earlier ones); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "answers.jsonl").open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    (folder / "metrics.json").write_text(json.dumps({k: clean(v) for k, v in metrics.items()}, indent=2))
    return folder


def reward_config(cfg: Config):
    """cfg.reward with `builtin:` models (a local judge's, a reward model's) resolved to the
    folders from_pretrained reads."""
    r = cfg.reward

    def resolved(path: str) -> str:
        if not path.startswith("builtin:"):
            return path
        return resolve_model_path(dataclasses.replace(cfg.model, path=path, gguf_file=None))

    return dataclasses.replace(
        r,
        judges=[dataclasses.replace(j, model=resolved(j.model)) if j.backend == "local" else j for j in r.judges],
        models=[dataclasses.replace(m, path=resolved(m.path)) for m in r.models],
    )


@torch.no_grad()
def answer_held_out(
    model, tokenizer, vision, samples: list[Sample], cfg: Config, progress: Progress | None = None
) -> list[Trajectory | Sample]:
    """Greedy single-turn answers of a model outside the trainer (`grouprl sft`), one per sample
    in order: its Trajectory (not scored yet), or the Sample itself where the prompt is over
    data.max_prompt_length (prompt_overflow: skip, or keep the last tokens; a prompt with images
    is never cut). `vision`: a VLM's processor."""
    from grouprl.rollout.engines import build_engine

    d, r = cfg.data, cfg.rollout
    was_training = model.training
    model.eval()
    engine = build_engine(None, model, tokenizer, vision=vision.family if vision is not None else None)
    params = SamplingParams(max_new_tokens=r.max_response_length, temperature=0.0, stop=list(r.stop))
    batch = r.gen_batch_size or 64
    out: list[Trajectory | Sample] = []
    for start in range(0, len(samples), batch):
        chunk, prompts, images = [], [], []
        for s in samples[start : start + batch]:
            if vision is not None:
                ids, prepared = vision.encode(s.messages, s.images)
            else:
                ids, prepared = encode_prompt(tokenizer, s.messages), []
            fitted = fit_prompt(ids, d.max_prompt_length, d.prompt_overflow)
            if fitted is not None and len(fitted) < len(ids) and prepared:
                fitted = None
            out.append(s)
            if fitted is not None:
                chunk.append(len(out) - 1)
                prompts.append(fitted)
                images.append(prepared)
        generations = engine.generate(prompts, 1, params, images=images if vision is not None else None)
        for k, prompt, prepared, gen in zip(chunk, prompts, images, generations):
            out[k] = Trajectory(
                sample=out[k],
                index=0,
                prompt_ids=prompt,
                response_ids=gen.token_ids,
                loss_mask=[1] * len(gen.token_ids),
                response_text=gen.text,
                finish_reason=gen.finish_reason,
                prompt_images=prepared,
            )
        if progress is not None:
            progress(min(start + batch, len(samples)), len(samples))
    model.train(was_training)
    return out


class Evaluator:
    """The trainer's held-out evaluation: answers to the held-out prompts (rollout.val_temperature;
    0 = greedy) on evaluation's own sampling streams, scored; several ranks answer a block each.
    Keeps the images of evaluations whose reward draws them, for the before/after report."""

    def __init__(self, cfg: Config, parts: EvalParts, collector):
        """`parts`: what evaluation reads (the held-out samples and prompts, the engine, the
        rewards, the ranks); `collector`: step.Collector (its rollout)."""
        self.cfg, self.p, self.collector = cfg, parts, collector
        self.ranks = parts.ranks
        self.images: list[tuple[int, list[dict]]] = []  # (step, rows) of evaluations that drew images
        self.originals: list[dict] | None = None  # the held-out requests drawn as written

    @torch.no_grad()
    def evaluate(self, step: int, answers: Path | None = None, progress: Progress | None = None) -> dict[str, float]:
        """val/accuracy (reward.val_metric), val/reward, each component, and accuracy per
        trainer.val_breakdown value. `answers`: a folder for answers.jsonl and metrics.json;
        `progress(done, total)` after each chunk of this rank's share."""
        p = self.p
        keep = [i for i, q in enumerate(p.prompts) if q is not None]
        if not keep:
            return {}
        t0 = time.perf_counter()
        p.reward.failure_report()  # the training steps' judge calls are not this evaluation's
        batch = self.cfg.rollout.gen_batch_size or 64
        mine = self.ranks.split(len(keep))  # several ranks: each answers its block
        trajectories: list[Trajectory] = []
        with policy_for_generation(p.engine, p.policy), rollout_phase(p.engine):
            for start in range(mine.start, mine.stop, batch):
                chunk = keep[start : min(start + batch, mine.stop)]
                trajectories += self.collector.rollout(
                    [p.samples[i] for i in chunk],
                    [p.prompts[i] for i in chunk],
                    1,
                    evaluation=True,
                    first_group=start,
                )
                if progress is not None:
                    progress(start + len(chunk) - mine.start, len(mine))
        p.reward.score(trajectories)
        # figures from fallback scores are no figures: stop, on every rank alike
        r = self.cfg.reward
        down = rewards_down(self.ranks.gather(p.reward.failure_report()), r.max_consecutive_failures, r.max_failed_share)
        if down is not None:
            raise type(down)(f"held-out evaluation: {down}")
        # the reward draws images: keep them for the report (decided over every rank: it gathers)
        if self.ranks.reduce([float(any(t.artifacts for t in trajectories))], "max")[0]:
            self._keep_images(step, trajectories)
        p.reward.step_metrics()  # reward-model counters stay the training steps' own
        metric, key = self.cfg.reward.val_metric, p.breakdown
        rows = rows_of(trajectories, metric, lambda sample: breakdown_value(sample, key))
        rows = [row for part in self.ranks.gather(rows) for row in part]  # blocks in rank order: keep's order
        out = {**metrics_of(rows), "time/eval": time.perf_counter() - t0}
        if answers is not None:
            records = [answer_record(t, metric) for t in trajectories]
            records = iter([r for part in self.ranks.gather(records) for r in part])
            if self.ranks.main:
                answered = set(keep)
                write_answers(
                    answers,
                    [next(records) if i in answered else skipped_record(s) for i, s in enumerate(p.samples)],
                    {"model": self.cfg.model.path, "step": step, "samples": len(p.samples),
                     "answered": len(keep), **out},
                )
        return out

    def _keep_images(self, step: int, trajectories: list[Trajectory]) -> None:
        """This evaluation's images and scores (every rank's), and once, those of the held-out
        requests drawn as written (same seeds), for the before/after report."""

        def prompt_of(t):
            return str(t.sample.messages[-1].get("content", ""))

        rows = [r for part in self.ranks.gather(eval_rows(trajectories, prompt_of)) for r in part]
        self.images.append((step, rows))
        if self.originals is None:
            as_written = [
                Trajectory(sample=t.sample, index=t.index, prompt_ids=t.prompt_ids, response_text=prompt_of(t))
                for t in trajectories
            ]
            self.p.reward.score(as_written)
            self.originals = [r for part in self.ranks.gather(eval_rows(as_written, prompt_of)) for r in part]
