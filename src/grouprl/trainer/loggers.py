"""Where metrics go: console progress, metrics.jsonl, rollouts.jsonl, and wandb / TensorBoard
when they are installed and enabled (never required)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from grouprl.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


class Logger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


def clean(value: Any) -> Any:
    """A JSON-safe value: NaN and inf become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN
    return value


class JsonlLogger:
    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)

    def log(self, metrics, step):
        self.file.write(json.dumps({"step": step, **{k: clean(v) for k, v in metrics.items()}}) + "\n")

    def close(self):
        self.file.close()


class ConsoleLogger:
    """A progress line per step with ETA and the metrics people watch: a live bar on a terminal;
    written elsewhere (a file, a pipe), where a bar shows only when it stops, one plain line per
    step and per evaluation chunk, as they happen."""

    KEYS = [
        ("reward/mean", "reward"),
        ("val/accuracy", "val"),
        ("actor/pg_loss", "loss"),
        ("actor/clipfrac", "clip"),
        ("actor/grad_norm", "gnorm"),
        ("response/length_mean", "len"),
        ("time/step", "s/step"),
    ]

    def __init__(self, total_steps: int, start_step: int = 0, console=None):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.console = console or Console()
        self.plain = not (self.console.is_terminal or self.console.is_jupyter)
        self.total, self.start_step, self.started = total_steps, start_step, time.perf_counter()
        self.chunk_task = None
        self.progress = Progress(
            TextColumn("[bold]{task.description} {task.completed}/{task.total}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            transient=False,
            console=self.console,
        )
        self.task = None  # the steps' row (none for an evaluation alone: total_steps 0)
        if not self.plain:
            if total_steps:
                self.task = self.progress.add_task("step", total=total_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, metrics, step):
        parts = [f"{short} {metrics[key]:.3g}" for key, short in self.KEYS if key in metrics]
        if not self.plain:
            if self.task is not None:
                self.progress.update(self.task, completed=step, info=" ".join(parts))
            return
        elapsed = time.perf_counter() - self.started
        done = step - self.start_step
        eta = f" eta {_clock(elapsed / done * (self.total - step))}" if 0 < done and step < self.total else ""
        self.print(" ".join([f"step {step}/{self.total} {_clock(elapsed)}{eta}", *parts]))

    def chunk(self, done: int, total: int, what: str = "eval") -> None:
        """Progress inside a step or an evaluation: `done` of `total` items."""
        if self.plain:
            self.print(f"{what} {done}/{total} {_clock(time.perf_counter() - self.started)}")
            return
        if self.chunk_task is None:
            self.chunk_task = self.progress.add_task(what, total=total, info="")
        self.progress.update(self.chunk_task, completed=done, total=total)
        if done >= total:  # the row goes once its work is done
            self.progress.remove_task(self.chunk_task)
            self.chunk_task = None

    def print(self, text: str) -> None:
        # soft_wrap: a line written to a file is not cut at the 80 columns rich assumes there
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def close(self):
        if not self.plain:
            self.progress.stop()


def _clock(seconds: float) -> str:
    """h:mm:ss, as the bar shows time."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class WandbLogger:
    def __init__(self, project: str, name: str, config: dict, run_dir: Path):
        import wandb

        self.run = wandb.init(project=project, name=name, config=config, dir=str(run_dir), resume="allow")

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def close(self):
        self.run.finish()


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, metrics, step):
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)

    def close(self):
        self.writer.close()


def make_loggers(
    names: list[str],
    run_dir: Path,
    *,
    total_steps: int,
    start_step: int,
    project: str,
    experiment: str,
    config: dict,
) -> list[Logger]:
    loggers: list[Logger] = []
    for name in names:
        try:
            if name == "jsonl":
                loggers.append(JsonlLogger(run_dir / "metrics.jsonl"))
            elif name == "console":
                loggers.append(ConsoleLogger(total_steps, start_step))
            elif name == "wandb":
                loggers.append(WandbLogger(project, experiment, config, run_dir))
            elif name == "tensorboard":
                loggers.append(TensorBoardLogger(run_dir))
        except ImportError:
            log.warning("logger '%s' is enabled but its package is not installed; skipping it", name)
    return loggers


def _safe(name: str) -> str:
    """A file-name-safe form of a uid or model name."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(name))[:80]


def _with_kept_pages(turns: list[dict[str, Any]], images_dir: Path | None) -> list[dict[str, Any]]:
    """The turn records with each `page` (a corpus file) copied into `images_dir/pages/` and
    named by its path relative to the run; a page that cannot be copied keeps its own path."""
    if images_dir is None or not any("page" in turn for turn in turns):
        return turns
    out = []
    for turn in turns:
        source = turn.get("page")
        if source and Path(source).is_file():
            resolved = Path(source).resolve()
            digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]  # two corpora may share a name
            target = Path(images_dir) / "pages" / f"{_safe(resolved.stem)}_{digest}{resolved.suffix}"
            if not target.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                # each process its own partial file (every rank writes its rows' lines), then one
                # atomic rename: a reader never sees half a page, and two ranks never share a file
                partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.partial")
                shutil.copyfile(resolved, partial)
                partial.replace(target)
            turn = {**turn, "page": str(target.relative_to(Path(images_dir).parent))}
        out.append(turn)
    return out


class RolloutWriter:
    """rollouts.jsonl: one line per trajectory (the curriculum engine reads it). Each line begins
    `{"run": ..., "step": N, "uid": "...", "sample": N` and ends with `}`, written by `json.dumps`
    with its default separators: `grouprl view` indexes such a line by those leading fields
    without parsing it whole (any other line it parses: the order is a matter of speed, checked
    by tests/view/test_view_index.py)."""

    def __init__(self, path: Path, run: str):
        self.file = open(path, "a", buffering=1)
        self.run = run

    def write(self, step: int, trajectories: list[Trajectory], prompt_texts: dict[str, str], advantages=()) -> None:
        self.write_lines(self.lines(self.run, step, trajectories, prompt_texts, advantages=advantages))

    def write_lines(self, lines: list[str]) -> None:
        if lines:
            self.file.write("\n".join(lines) + "\n")

    @staticmethod
    def lines(
        run: str,
        step: int,
        trajectories: list[Trajectory],
        prompt_texts: dict[str, str],
        images_dir: Path | None = None,
        advantages: tuple[float, ...] | list[float] = (),
    ) -> list[str]:
        """The trajectories' records (JSON lines). Images reward models drew for a trajectory
        are copied to `images_dir/step_N/` and named in its record, and the page files its turns
        showed or cropped to `images_dir/pages/` (once a run: pages recur) and named in their
        turn records (`page`; paths relative to the run), so a run folder holds what its policy saw.
        `advantages`: each trajectory's (the learner's); none: the step made no update (null)."""
        lines = []
        for k, t in enumerate(trajectories):
            images = {}
            if t.artifacts and images_dir is not None:
                folder = Path(images_dir) / f"step_{step}"
                folder.mkdir(parents=True, exist_ok=True)
                for model, source in t.artifacts.items():
                    target = folder / f"{_safe(t.uid)}_{t.index}_{_safe(model)}{Path(source).suffix}"
                    shutil.copyfile(source, target)
                    images[model] = str(target.relative_to(Path(images_dir).parent))
            record = {
                "run": run,
                "step": step,
                "uid": t.uid,
                "sample": t.index,
                "prompt": prompt_texts.get(t.uid, ""),
                "response": t.response_text,
                "turns": _with_kept_pages(t.turns, images_dir),
                "retrieved": t.retrieved,
                "rewards": {k: clean(v) for k, v in t.rewards.items()},
                "reward": clean(t.reward),
                "advantage": clean(advantages[k]) if k < len(advantages) else None,
                "response_tokens": len(t.response_ids),
                "truncated": t.truncated,
                "finish_reason": t.finish_reason,
                "version": t.version,  # the policy version (updates done) that sampled it
                "ground_truth": t.sample.ground_truth,
                "time": time.time(),
            }
            if images:
                record["images"] = images
            if t.extra:  # what a TRL-style reward logged for it (log_extra)
                record["extra"] = {k: clean(v) if isinstance(v, float) else v for k, v in t.extra.items()}
            lines.append(json.dumps(record, default=str))
        return lines

    def close(self):
        self.file.close()
