"""The training loop, top to bottom (`Trainer.fit`, then `train_step`): each step collects a
batch (draw B prompts, n samples each, generate, score) and learns from it (advantages,
ppo_epochs x mini-batches x micro-batches, AdamW, the weight push); then its logs, evaluation and
checkpoint. The parts come from setup.py (grouped by stage, parts.py), the step's halves from
step.py (collect) and learner.py (learn), evaluation from evaluation.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import yaml

from grouprl.config import Config, to_dict
from grouprl.rewards.failures import JudgeUnavailableError, RewardUnavailableError
from grouprl.rollout.engines.process import EngineProcessEnded
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from grouprl.trainer.evaluation import Evaluator, Progress
from grouprl.trainer.export import export_model
from grouprl.trainer.image_report import write_report
from grouprl.trainer.learner import Learner
from grouprl.trainer.loggers import ConsoleLogger, RolloutWriter, make_loggers
from grouprl.trainer.memory import PeakMeter
from grouprl.trainer.metric_parts import merge
from grouprl.trainer.pipeline import RolloutPipeline
from grouprl.trainer.setup import build
from grouprl.trainer.step import Collector, reduce_step_metrics
from grouprl.trainer.step_batch import NOT_LEARNED, Learned, StepBatch

log = logging.getLogger(__name__)

def drop_lines_after(path: Path, step: int) -> None:
    """Keep only the jsonl records of steps <= `step` (atomic rewrite; a torn last line goes too)."""
    if not path.is_file():
        return
    kept, changed = [], False
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line).get("step", 0) <= step
        except json.JSONDecodeError:
            keep = False
        changed |= not keep
        if keep:
            kept.append(line)
    if changed:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)



def resume_when(e: RewardUnavailableError) -> str:
    """When resuming a run a reward stopped can help."""
    return "once the judge answers" if isinstance(e, JudgeUnavailableError) else "once the reward is fixed"

class Trainer:
    def __init__(self, cfg: Config):
        PeakMeter.reset_host()  # the start-up phase's peak: a CPU's from here, CUDA's since the process began
        # the run's parts, held here only (trainer.parts.<part>, a stage's as trainer.parts.collect.<part>, ...;
        # cfg and ranks also as properties)
        self.parts = parts = build(cfg)  # a mistake in the data, rewards or settings fails here, one line
        cfg = parts.cfg  # what depends on the devices settled (memory.plan_run)
        # each phase's measured peak (perf/peak_gb/<phase>): start-up's logged with the first step
        self._startup_peak: dict[str, float] = parts.meter.measure("startup")
        self.collector = Collector(cfg, parts.collect)  # a step's first half: its batch
        self.learner = Learner(cfg, parts.learn)  # its second half: the update
        self.evaluator = Evaluator(cfg, parts.evaluate, self.collector)
        self.checkpoints = CheckpointManager(parts.run_dir, cfg.trainer.keep_last, barrier=parts.ranks.barrier)
        self.step = 0
        self._groups: list[int] = []  # this rank's groups of the last step (their places in the batch)
        self.history: list[dict] = []  # evaluation results by step
        self.best_metric = -math.inf
        self.counters = {
            "skipped_steps": 0,
            "reward_errors": 0,
            "dropped_groups": 0,
            "steps_without_update": 0,
        }
        # what a checkpoint taken on Ctrl-C must restore (see fit)
        self._pre_step_state: dict | None = None
        # rollout.max_staleness > 0: generation ahead of the update (started by the first step);
        # a resumed fixed-lag run's weights of the older versions its first batches sample from
        self.pipeline: RolloutPipeline | None = None
        self._ahead_weights: dict[int, dict[str, torch.Tensor]] = {}
        self._step_clock: float | None = None  # asynchronous: when the last step ended
        self._resume()

    @property
    def cfg(self) -> Config:
        """The run's settings, `auto` ones made concrete for the devices (parts.Parts.cfg); the
        run's other parts are `self.parts`."""
        return self.parts.cfg

    @property
    def ranks(self):
        """This process's place among the run's ranks (parts.Parts.ranks)."""
        return self.parts.ranks

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train: a baseline evaluation (trainer.val_before_train), then step after step until
        trainer.total_steps or the time limit, each step's phases in order (collect, learn, log,
        evaluate, checkpoint), then the last evaluation, checkpoint and export. The summary."""
        c = self.cfg.trainer
        logs = self._open_logs()
        try:
            self._sweep_once()  # before the baseline evaluation, which may write best/
            if c.val_before_train and self.step == 0 and self.parts.evaluate.samples:
                val = self._evaluate_and_keep_best(logs)
                logs.say(f"baseline eval: {_fmt(val)}")
                logs.log(val, self.step)
            started = time.perf_counter()  # max_time_minutes counts training, not the baseline
            while self.step < self.parts.total_steps and not self._out_of_time(started, logs.say):
                # collect (draw B prompts, roll out n samples of each, score them), then learn
                # (advantages, the update, the weight push): the step's metrics and trajectories
                metrics, trajectories, advantages = self.train_step()
                if c.log_rollouts:  # log: each trajectory, with its advantage (rollouts.jsonl)
                    logs.rollouts(self, trajectories, advantages)
                if self._evaluation_due():  # evaluate: the held-out metrics join the step's
                    metrics = merge(metrics, self._evaluate_and_keep_best(logs))
                logs.log(metrics, self.step)  # log: the step's metrics (metrics.jsonl, console, ...)
                if c.save_freq and self.step % c.save_freq == 0:  # checkpoint
                    self.save_checkpoint()
            self._end_of_training(logs)
        except KeyboardInterrupt:
            self._interrupted(logs.say)
            raise
        finally:
            self._close(logs)
        return self._finish(logs.say)

    def train_step(self) -> tuple[dict[str, float], list[Trajectory], tuple[float, ...]]:
        """One step's two halves in order: collect its batch (draw B prompts, roll out n samples
        of each, score them: step.Collector), learn from it (advantages, the update, the weight
        push: learner.Learner). Returns the step's metrics (one value each over the ranks), this
        rank's trajectories and their advantages."""
        self._open_step()  # the state an interrupt from here saves; generation ahead started
        batch, peaks, waited = self._collect()  # collect: this rank's groups, scored (a StepBatch)
        learned = self._learn(batch)  # learn: the update and the push (what it measured)
        self.step += 1
        if self.pipeline is not None:  # generation ahead: the batches that sample from these weights may start
            self.pipeline.publish(self.step, self.parts.learn.model)
        metrics = merge(batch.metrics, peaks, learned.metrics, self._step_time(batch, waited))
        metrics = reduce_step_metrics(metrics, self.ranks)
        self._close_step(batch, learned)  # counters, the reference's refresh, the state an interrupt saves
        return metrics, batch.real_trajectories, learned.advantages

    # ------------------------------------------------------------------ a step's parts, in order
    def _open_step(self) -> None:
        """Before a step: the sweep of writes a killed run left unfinished (once), generation
        ahead of the update started (asynchronous runs, at their first step), and the state a
        checkpoint taken before this step's update restores (see _interrupted)."""
        self._sweep_once()
        if self.parts.ahead is not None and self.pipeline is None:
            self._start_pipeline()
        self._pre_step_state = self._trainer_state()

    def _collect(self) -> tuple[StepBatch, dict[str, float], float]:
        """The step's batch, collected now or taken from generation ahead; the generation phase's
        memory peak (synchronous runs: asynchronous ones generate beside the update, whose peak
        is the one; start-up's comes with the first step); and the seconds it took to come."""
        waited = time.perf_counter()
        meter = self.parts.meter if self.pipeline is None else None
        if meter is not None:
            meter.start()
        batch = self._batch()
        waited = time.perf_counter() - waited
        peaks = {**(meter.measure("generation") if meter is not None else {}), **self._startup_peak}
        self._startup_peak = {}
        return batch, peaks, waited

    def _learn(self, batch: StepBatch) -> Learned:
        """The update on the batch, and the push; none where every group was dropped (judge
        failures, on every rank alike)."""
        if not batch.groups:
            log.warning("step %d: every group was dropped (judge failures); no update", self.step + 1)
            return NOT_LEARNED
        return self.learner.learn(batch)

    def _close_step(self, batch: StepBatch, learned: Learned) -> None:
        """After a step: the run's counters (the same on every rank), the reference's refresh
        (algorithm.ref_refresh_steps), and the state an interrupt from here on (evaluating,
        logging, saving) saves: this step's, with this step's weights."""
        self._groups = batch.places
        self.counters["dropped_groups"] += batch.dropped_groups
        self.counters["steps_without_update"] += int(not batch.groups)
        self.counters["skipped_steps"] += learned.skipped_steps  # the same on every rank
        self.counters["reward_errors"] += int(self.ranks.reduce([float(batch.reward_errors)])[0])  # every rank's
        refresh = self.cfg.algorithm.ref_refresh_steps
        if refresh and self.step % refresh == 0:
            self.parts.learn.reference.refresh(self.parts.learn.model)
        self._pre_step_state = self._trainer_state()

    def _step_time(self, batch: StepBatch, waited: float) -> dict[str, float]:
        """time/step: from the batch's start to now, the update and its push done; asynchronous
        runs generate beside the update, so theirs is step to step (and time/wait_batch the
        time the update waited for its batch)."""
        now = time.perf_counter()
        if self.pipeline is None:
            return {"time/step": now - batch.started}
        since, self._step_clock = self._step_clock, now
        return {"time/step": now - since, "time/wait_batch": waited}

    def _batch(self) -> StepBatch:
        """This step's batch; a judge that stopped answering (on every rank alike) or an engine
        process that ended stops the run after saving the last finished step (this one is redone
        on resume). An engine process is one rank's: with several ranks the others are not there
        to save with, and the last periodic checkpoint stands."""
        try:
            if self.pipeline is not None:
                return self.pipeline.take(self.step)
            return self.collector.collect(self.step)
        except (RewardUnavailableError, EngineProcessEnded) as e:
            pre = self._pre_step_state
            once = e.resume if isinstance(e, EngineProcessEnded) else resume_when(e)
            if isinstance(e, EngineProcessEnded) and self.parts.ranks.distributed:
                raise
            if pre is not None and pre["step"] > 0:
                path = self.save_checkpoint(pre)
                raise type(e)(f"{e}; saved {path}: run the same command to resume {once}") from None
            raise type(e)(f"{e}; nothing trained yet to save") from None

    def _sweep_once(self) -> None:
        """Before this process writes anything (fit's start, or a first step run on its own): the
        temp folders of writes a killed run left unfinished go, removed by the first rank while
        the others wait (no rank writes before the sweep is done)."""
        if not self.checkpoints.swept:
            self.checkpoints.sweep((self.parts.run_dir / "final", self.parts.run_dir / "best"), remove=self.parts.ranks.main)
            self.parts.ranks.barrier()

    def _start_pipeline(self) -> None:
        """Generation ahead of the update, from this step on (a resumed run's batches again)."""
        self.pipeline = RolloutPipeline(
            self.cfg, self.parts.collect, self.parts.ahead, self.step, self.parts.total_steps, snapshots=self._ahead_weights
        )
        self.pipeline.start(self.step, self.parts.learn.model)
        self._ahead_weights = {}  # the pipeline holds them now
        self._step_clock = time.perf_counter()

    def close_pipeline(self) -> None:
        """Stop generating ahead (fit does it when it ends)."""
        if self.pipeline is not None:
            self.pipeline.close()

    def _out_of_time(self, started: float, say) -> bool:
        """trainer.max_time_minutes of training reached (said once, as the loop stops)."""
        limit = self.cfg.trainer.max_time_minutes
        if not limit or time.perf_counter() - started <= limit * 60:
            return False
        say(f"time limit of {limit:g} min reached at step {self.step} (training time; the baseline evaluation is not counted)")
        return True

    def _evaluation_due(self) -> bool:
        """Every trainer.test_freq steps, with held-out data; not after the last step (fit's
        end evaluates that one)."""
        freq = self.cfg.trainer.test_freq
        return bool(freq) and self.step % freq == 0 and self.step < self.parts.total_steps and bool(self.parts.evaluate.samples)

    def _end_of_training(self, logs: _Logs) -> None:
        """The last step's evaluation (unless it had one), the last checkpoint (trainer.save_last)
        and the final export (trainer.save_final)."""
        c = self.cfg.trainer
        if self.parts.evaluate.samples and (not self.history or self.history[-1]["step"] != self.step):
            logs.log(self._evaluate_and_keep_best(logs), self.step)
        if c.save_last:
            self.save_checkpoint()
        if c.save_final:
            self._export(self.parts.run_dir / "final", merge_lora=True, meta={"step": self.step})

    def _close(self, logs: _Logs) -> None:
        """What the run holds open: generation ahead, the logs, streamed scoring (closed for
        good: a later step scores after generating) and the rewards' clients."""
        self.close_pipeline()
        logs.close()
        self.collector.stop_streaming()
        self.parts.collect.reward.close()

    # ------------------------------------------------------------------ evaluation and exports
    def evaluate(self, answers: Path | None = None, progress: Progress | None = None) -> dict[str, float]:
        """The held-out metrics of the current weights (evaluation.Evaluator), kept in `history`;
        `answers`: a folder for answers.jsonl and metrics.json."""
        out = self.evaluator.evaluate(self.step, answers=answers, progress=progress)
        if out:
            self.history.append({"step": self.step, **out})
        return out

    def _evaluate_and_keep_best(self, logs: _Logs) -> dict[str, float]:
        try:
            val = self.evaluate(progress=logs.progress)
        except RewardUnavailableError as e:  # the steps trained so far are kept
            if self.step == 0:
                raise type(e)(f"{e}; nothing trained yet to save") from None
            path = self.save_checkpoint()
            raise type(e)(f"{e}; saved {path}: run the same command to resume {resume_when(e)}") from None
        self._maybe_save_best(val)
        return val

    def _maybe_save_best(self, val: dict[str, float]) -> None:
        if not self.cfg.trainer.save_best or "val/accuracy" not in val:
            return
        if val["val/accuracy"] > self.best_metric:
            self.best_metric = val["val/accuracy"]
            self._export(self.parts.run_dir / "best", merge_lora=False, meta={"step": self.step, **val})

    def _export(self, target: Path, *, merge_lora: bool, meta: dict) -> None:
        """A Hugging Face folder of the policy, written once, by rank 0 (sharded: gathered a
        layer at a time, every rank taking part)."""
        export_model(
            self.parts.learn.policy,
            self.parts.tokenizer,
            target,
            merge_lora=merge_lora,
            meta=meta,
            processor=self.parts.vision,
            write=self.parts.ranks.main,
        )
        self.parts.ranks.barrier()

    # ------------------------------------------------------------------ state
    def _trainer_state(self) -> dict:
        state = {
            "step": self.step,
            "sampler": self.parts.collect.sampler.state_dict(),
            "rng": rng_state(),
            "history": list(self.history),  # copies: a snapshot taken before a step stays as it was
            "best_metric": self.best_metric,
            "counters": dict(self.counters),
            "total_steps": self.parts.total_steps,
        }
        if self.parts.ahead is not None:  # batches generated ahead are made again after a resume
            if self.pipeline is not None:
                ahead = self.pipeline.state(self.step)
            else:
                ahead = {"sampler": state["sampler"], "weights": self._ahead_weights}
            state["sampler"] = ahead["sampler"]
            state["ahead_weights"] = {str(v): w for v, w in ahead["weights"].items()}
        return state

    def _resume(self) -> None:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return
        path = Path(t.resume_from_path) if t.resume_mode == "path" else self.checkpoints.latest()
        if path is None:
            return
        learn = self.parts.learn
        with self._parked_present():  # loaded where they live during the update, parked after
            state = CheckpointManager.load(
                path, learn.policy, learn.optimizer, learn.scheduler, ref_model=learn.reference.frozen_model
            )
        self.step = state["step"]
        self.parts.collect.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.history = state["history"]
        self.best_metric = state["best_metric"]
        self.counters = state["counters"]
        self._ahead_weights = {int(v): w for v, w in state.get("ahead_weights", {}).items()}
        learn.engine.weights_updated(learn.model)
        log.info("resumed from %s at step %d", path, self.step)

    def save_checkpoint(self, trainer_state: dict | None = None) -> Path:
        learn = self.parts.learn
        state = trainer_state or self._trainer_state()
        with self._parked_present():  # saved as the update sees them (sharded saves gather on the device)
            path = self.checkpoints.save(
                state["step"],
                learn.policy,
                learn.optimizer,
                learn.scheduler,
                state,
                ref_model=learn.reference.frozen_model,
                write=self.parts.ranks.main,
            )
        self.parts.ranks.barrier()  # no rank goes on (or resumes) before the checkpoint is complete
        return path

    @contextlib.contextmanager
    def _parked_present(self):
        """For a save or load: the reference and the optimizer state on the device inside (they
        live in host memory between their uses with actor.reference_offload / optimizer_offload,
        their tensors empty on the device)."""
        with self.parts.learn.reference.present(), self.parts.learn.optimizer_parked.present():
            yield

    # ------------------------------------------------------------------ logs and the run's end
    def _open_logs(self) -> _Logs:
        """The run folder's logs; lines a crashed run wrote after its last checkpoint are dropped
        (the resumed run redoes them; resume_mode=disable starts them afresh). With several
        ranks, the first one writes them."""
        c = self.cfg.trainer
        self.parts.run_dir.mkdir(parents=True, exist_ok=True)
        keep_until = -1 if c.resume_mode == "disable" else self.step
        main = self.parts.ranks.main
        if main:
            for name in ("metrics.jsonl", "rollouts.jsonl"):
                drop_lines_after(self.parts.run_dir / name, keep_until)
            (self.parts.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
        loggers = (
            make_loggers(
                c.loggers,
                self.parts.run_dir,
                total_steps=self.parts.total_steps,
                start_step=self.step,
                project=c.project_name,
                experiment=c.experiment_name,
                config=to_dict(self.cfg),
            )
            if main
            else []
        )
        writer = RolloutWriter(self.parts.run_dir / "rollouts.jsonl", c.experiment_name) if c.log_rollouts and main else None
        return _Logs(loggers, writer, main)

    def _interrupted(self, say) -> None:
        """Ctrl-C. While generating or scoring, the weights are those of the last finished step:
        save them with the state from before this step, so nothing finished is lost and a resumed
        run redraws the same batch. After a step (evaluating, logging, saving), `_pre_step_state`
        is that step's own state (set at the end of train_step). Mid-update, the weights are in
        between: nothing is saved."""
        pre = self._pre_step_state
        if self.learner.updating:
            say("interrupted during an update: resume from the last saved checkpoint")
        elif pre is not None and pre["step"] > 0:
            path = self.save_checkpoint(pre)
            say(f"interrupted: saved {path}; run the same command to resume")
        else:
            say("interrupted before a step finished: nothing new to save")

    def _finish(self, say) -> dict:
        """The summary (and the before/after image report, where evaluations drew images)."""
        summary = self.summary()
        images, main = self.evaluator.images, self.parts.ranks.main
        if main and self.evaluator.originals is not None and len(images) >= 2:
            (first, before), (last, after) = images[0], images[-1]
            summary["image_report"] = write_report(
                self.parts.run_dir / "report", self.evaluator.originals, before, after, (first, last)
            )
            say(summary["image_report"] + f" (report: {self.parts.run_dir / 'report' / 'grid.png'})")
        if main:
            (self.parts.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        say(summary["line"])
        self.parts.ranks.close()
        return summary

    def summary(self) -> dict:
        first = self.history[0] if self.history else {}
        last = self.history[-1] if self.history else {}
        # a baseline is an evaluation of the starting model (none with val_before_train=false)
        base = first.get("val/accuracy") if first.get("step") == 0 else None
        final = last.get("val/accuracy")
        if base is not None and final is not None:
            line = f"eval accuracy: baseline {base:.2f} -> final {final:.2f} ({final - base:+.2f}) after {self.step} steps"
        elif final is not None:
            line = f"eval accuracy: final {final:.2f} after {self.step} steps (no baseline evaluation)"
        else:
            line = f"trained {self.step} steps (no held-out split to evaluate)"
        return {
            "line": line,
            "steps": self.step,
            "baseline": base,
            "final": final,
            "history": self.history,
            "counters": self.counters,
            "run_dir": str(self.parts.run_dir),
        }


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k.split('/', 1)[-1]}={v:.3f}" for k, v in metrics.items() if not k.startswith("time/"))


class _Logs:
    """A run's loggers (metrics.jsonl, console, wandb, ...) and rollouts.jsonl writer."""

    def __init__(self, loggers: list, writer: RolloutWriter | None, main: bool):
        self.loggers, self.writer = loggers, writer
        console = next((lg for lg in loggers if isinstance(lg, ConsoleLogger)), None)
        self.say = console.print if console else print if main else lambda *a: None
        self.progress = console.chunk if console else None  # progress inside an evaluation
        self.prompt_text: dict[str, str] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def rollouts(self, trainer: Trainer, trajectories: list[Trajectory], advantages: tuple[float, ...]) -> None:
        """Every rank's trajectories of the step, in the batch's order (by group, then sample),
        with their advantages (empty where the step made no update)."""
        c = trainer.cfg
        for t in trajectories:
            self.prompt_text.setdefault(t.uid, t.sample.messages[-1].get("content", ""))
        lines = RolloutWriter.lines(
            c.trainer.experiment_name, trainer.step, trajectories, self.prompt_text, trainer.parts.run_dir / "images",
            advantages=advantages,
        )
        n = c.rollout.n_agent
        groups = trainer._groups if trainer.parts.ranks.distributed else range(len(lines) // n + 1)
        mine = [(groups[k // n], k % n, line) for k, line in enumerate(lines)]
        every = sorted(y for part in trainer.parts.ranks.gather(mine) for y in part)
        if self.writer is not None:
            self.writer.write_lines([x[2] for x in every])

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
        if self.writer is not None:
            self.writer.close()
