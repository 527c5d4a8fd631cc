"""Asynchronous training (`rollout.max_staleness` = k > 0): generation runs ahead of the update,
at most k steps, so that the judge's latency and the update no longer hold generation up.

    generator thread   for j = first, first + 1, ...: wait for the weights batch j samples from,
                       load them into the generation copy of the policy, Collector.start(j)
                       (draw, generate; rewards stream in while it runs)
    scorer thread      each started batch in order: Collector.finish (wait for its rewards,
                       judge failures, dropped groups, the curriculum's tracker) -> ready
    the trainer        take(step) -> Learner.learn -> publish(step + 1, model)

Which weights batch j samples from (`rollout.async_schedule`):
- fixed_lag: version max(0, j - k) exactly, whatever the timing: the run is deterministic (the
  same seed gives the same batches, updates and weights), and a checkpoint that keeps the
  weights of the versions its in-flight batches need resumes it exactly (`state`).
- newest: the newest published version at the batch's start (at least j - k), and an agent
  batch takes a version published while it runs between two turns (a partial rollout: each turn
  records its version). The pipeline offers each published version to the engine
  (`RolloutEngine.offer_weights`), which loads it where none of its turns runs; the agent learns
  which version a turn sampled from from the turn's generation, not from the trainer.
Either way no batch is more than k versions older than the update that trains on it: generation
waits for the weights it needs (`time/wait_weights`), never trains anything staler.

Published versions are snapshots of the trainable weights (a LoRA run's adapters only), kept
while a batch not yet learned needs them (fixed_lag: k + 1 at most; newest: the newest).
With a reward-dependent sampler (the online curriculum) batch j is drawn only after batch j-1's
rewards taught the tracker, so draws stay deterministic; generation then waits for the judge.

Several ranks: every rank runs the same pipeline on its own groups. The copy is whole on each
rank (snapshots are gathered from the shards by `publish`, which every rank calls after each
step), and the threads' collectives go over a group of their own (parts.Ahead.ranks), so they
never interleave with the update's on the trainer's group.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

import torch

from grouprl.devices import use_device
from grouprl.trainer.parallel import full_tensor
from grouprl.trainer.parts import Ahead, CollectParts
from grouprl.trainer.step import Collector
from grouprl.trainer.step_batch import Loaded, StepBatch

log = logging.getLogger(__name__)

STILL_WAITING_S = 300.0  # the trainer waiting this long for a batch says so (and again after as long)


def trainable_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the weights an update changes (by name), detached; several ranks: whole
    (gathered from the shards: every rank calls this)."""
    return {name: full_tensor(p.detach()).clone() for name, p in model.named_parameters() if p.requires_grad}


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


class RolloutPipeline:
    """Batches generated and scored ahead of the update (see the module docstring)."""

    def __init__(
        self,
        cfg,
        collect: CollectParts,
        ahead: Ahead,
        first_step: int,
        total_steps: int,
        snapshots: dict[int, dict] | None = None,
    ):
        """`collect`: the trainer's collect parts (its sampler, prompts and rewards), `ahead` the
        generation side that takes the place of its engine and runner; `first_step`: the next
        step to learn; `snapshots`: the weights of versions below `first_step` that its first
        batches need (a resumed fixed-lag run's, from the checkpoint)."""
        self.cfg = cfg
        self.k = cfg.rollout.max_staleness
        self.fixed = cfg.rollout.async_schedule == "fixed_lag"
        self.generation_copy, self.engine = ahead.generation_copy, ahead.engine
        self.device = collect.device
        # the rollout runs on the copy (whole on every rank: no gathering of the policy's shards)
        # and its collectives go over the rollout threads' own group (parts.Ahead.ranks). The
        # generator thread's only collectives (dynamic filtering's refills) run while the scorer
        # waits for that batch, so the two threads never use the group at once
        generation = dataclasses.replace(
            collect, engine=ahead.engine, runner=ahead.runner, policy=ahead.generation_copy, ranks=ahead.ranks
        )
        # batches overlap: one's judge calls are still out when the next starts, so a batch's
        # start does not reset the judges' tallies (each check counts the calls since the last)
        self.collector = Collector(cfg, generation, judge_tallies_per_batch=False)
        self.sampler = collect.sampler
        self.reward_dependent = collect.sampler.learns_from_rewards
        # partial rollouts: newer weights offered to the engine, taken between an agent's turns
        self.offer_between_turns = cfg.agent.enabled and not self.fixed
        self.first, self.total = first_step, total_steps
        self.cond = threading.Condition()
        self.snapshots: dict[int, dict[str, torch.Tensor]] = dict(snapshots or {})
        # fixed_lag: the oldest version a batch may take. A resumed run whose checkpoint has no
        # weights for the versions its first batches would sample from (a synchronous run's, a
        # newest run's, or one made with a smaller k) starts the lag afresh from its own weights
        self.floor = 0
        wanted = {max(0, j - self.k) for j in range(first_step, min(first_step + self.k, total_steps))}
        missing = sorted(v for v in wanted if v < first_step and v not in self.snapshots)
        if self.fixed and missing:
            log.warning(
                "the checkpoint holds no weights of version(s) %s, which batches %d.. would sample from "
                "(rollout.max_staleness=%d): they sample from the resumed weights (version %d) instead",
                ", ".join(map(str, missing)), first_step, self.k, first_step,
            )  # fmt: skip
            self.floor = first_step
        self.newest = max(self.snapshots, default=-1)
        self.sampler_before: dict[int, dict] = {}  # step -> the sampler's state before its draw
        self.started = first_step  # the next batch to start
        self.scored = first_step  # batches up to here are scored
        self.learned = first_step  # the trainer's steps so far
        self.queue: collections.deque = collections.deque()  # started, not yet scored (Pending)
        self.ready: dict[int, StepBatch] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.threads = [
            threading.Thread(target=self._guard(self._generate), name="grouprl-generate", daemon=True),
            threading.Thread(target=self._guard(self._score), name="grouprl-score", daemon=True),
        ]

    # ------------------------------------------------------------------ the trainer's side
    def start(self, version: int, model: torch.nn.Module) -> None:
        """Publish the current weights (`version`: the steps learned) and start the threads."""
        self.publish(version, model)
        for thread in self.threads:
            thread.start()

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """The update made `version`: a snapshot for the batches that will sample from it."""
        snapshot = trainable_snapshot(model)
        with self.cond:
            self.learned = version
            self.snapshots[version] = snapshot
            self.newest = max(self.newest, version)
            self._prune()
            for j in [j for j in self.sampler_before if j < version]:  # batches learned: no checkpoint redraws them
                del self.sampler_before[j]
            self.cond.notify_all()
        if self.offer_between_turns:
            self.engine.offer_weights(version, snapshot)

    def take(self, step: int) -> StepBatch:
        """Batch `step`, once generated and scored (a fault on the other threads is raised here);
        its staleness and its weights' wait and push are in it (Collector.finish). A wait of
        STILL_WAITING_S or more says so in the log, with where the threads are."""
        since = report = time.monotonic()
        with self.cond:
            while step not in self.ready and self.error is None:
                self.cond.wait(timeout=1.0)
                if time.monotonic() - report >= STILL_WAITING_S:
                    report = time.monotonic()
                    self._still_waiting(step, report - since)
            if self.error is not None:
                raise self.error
            return self.ready.pop(step)

    def _still_waiting(self, step: int, seconds: float) -> None:
        threads = ", ".join(f"{t.name} {'running' if t.is_alive() else 'ended'}" for t in self.threads)
        log.warning(
            "step %d has waited %.0f s for its batch: the next batch to start is %d, the next to be scored %d "
            "(%s); generation or the rewards (a judge?) are slow, or stuck",
            step, seconds, self.started, self.scored, threads,
        )  # fmt: skip

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint taken after `step` steps needs to go on as this run would: the
        sampler as it was before batch `step` was drawn (its draw and the later ones are made
        again) and, fixed_lag, the weights of the older versions those batches sample from."""
        with self.cond:
            sampler = self.sampler_before.get(step)
            if sampler is None:  # not drawn yet: the sampler has not moved past it
                sampler = self.sampler.state_dict()
            versions = sorted({self.needed(j) for j in range(step, min(step + self.k, self.total))} - {step})
            weights = {v: self.snapshots[v] for v in versions if self.fixed and v in self.snapshots}
        return {"sampler": sampler, "weights": weights}

    def close(self) -> None:
        """Stop after the batch each thread is on (daemon threads: nothing waits for them long)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for thread in self.threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=10)
        self.engine.close()  # rollout.engine_process: it ends with the run (an in-process engine: nothing)

    # ------------------------------------------------------------------ schedule
    def needed(self, step: int) -> int:
        """fixed_lag: the version batch `step` samples from."""
        return max(self.floor, step - self.k)

    def _prune(self) -> None:
        """Keep the snapshots a batch not yet learned may need (fixed_lag: to start it, or to
        make it again after a resume from a checkpoint taken now) or the newest."""
        if self.fixed:
            last = min(max(self.started, self.learned) + self.k + 1, self.total)
            keep = {self.needed(j) for j in range(self.learned, last)}
            keep.add(self.newest)
        else:
            keep = {self.newest}
        for v in [v for v in self.snapshots if v not in keep]:
            del self.snapshots[v]

    def _load(self, version: int, snapshot: dict[str, torch.Tensor]) -> None:
        """The generation copy takes `version`'s weights (generator thread, between requests);
        the engine samples from them next (vLLM: pushed into its own copy)."""
        if self.engine.policy_version == version:
            return
        params = dict(self.generation_copy.named_parameters())
        with torch.no_grad():
            for name, tensor in snapshot.items():
                params[name].copy_(tensor)
        self.engine.weights_updated(self.generation_copy, version)

    # ------------------------------------------------------------------ threads
    def _guard(self, fn):
        def run():
            try:
                # a new thread starts on cuda:0: this rank's device, or rank > 0 would generate
                # (and save and restore the generators) on another rank's GPU
                use_device(self.device)
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the trainer, raised by take()
                with self.cond:
                    self.error = e
                    self.cond.notify_all()

        return run

    def _generate(self) -> None:
        for j in range(self.first, self.total):
            waited = time.perf_counter()
            with self.cond:
                while not self.stopping:
                    ready = self.needed(j) in self.snapshots if self.fixed else self.newest >= j - self.k
                    if ready and (not self.reward_dependent or self.scored >= j):
                        break
                    self.cond.wait(timeout=1.0)
                if self.stopping:
                    return
                version = self.needed(j) if self.fixed else self.newest
                snapshot = self.snapshots[version]
                waited = time.perf_counter() - waited
                self.sampler_before[j] = self.sampler.state_dict()
                self.started = j + 1
                self._prune()
            loading = time.perf_counter()
            self._load(version, snapshot)
            pending = self.collector.start(j, version, Loaded(waited=waited, push=time.perf_counter() - loading))
            with self.cond:
                if self.stopping:
                    return
                self.queue.append(pending)
                self.cond.notify_all()

    def _score(self) -> None:
        for j in range(self.first, self.total):
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait(timeout=1.0)
                if self.stopping:
                    return
                pending = self.queue.popleft()
            batch = self.collector.finish(pending)
            with self.cond:
                self.ready[j] = batch
                self.scored = j + 1
                self.cond.notify_all()
