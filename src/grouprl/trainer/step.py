"""One training step in two halves with one object between them:

    Collector.collect(step) -> StepBatch     draw, rollout, score (streamed), curriculum,
                                             dynamic filtering, dropped groups
    Learner.learn(batch)    -> Learned       (learner.py) tensors, old/ref log-probs, advantages,
                                             the update, the engine-trainer mismatch, the push

A StepBatch (step_batch.py) owns this rank's groups of one step (`Group`: its place in the
step's whole batch, sample, prompt, trajectories), the policy version that sampled them and what
collecting measured; collect builds it once, at its end, and nothing writes it after. Learn
builds the update's tensors once and returns what it measured; the trainer reduces the step's
metrics over the ranks.
Several ranks: every rank collects its own groups (the same prompts drawn everywhere, each its
block) and learns on them; decisions that change which groups train (dynamic filtering, judge
failures) are taken over every rank's groups, so the ranks stay in step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from types import MappingProxyType

from grouprl.config import Config
from grouprl.curriculum.filtering import prompts_to_draw, select_groups
from grouprl.data import Sample
from grouprl.errors import ModelLoadError
from grouprl.rewards.composite import groups_to_drop
from grouprl.rewards.failures import rewards_down
from grouprl.rewards.streaming import batch_summary, combine
from grouprl.rollout.engines import SamplingParams, rollout_phase
from grouprl.rollout.engines.streams import RowStreams, mix_seed
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.metric_parts import merge
from grouprl.trainer.models import autocast
from grouprl.trainer.parallel import gathered, reduce_metrics
from grouprl.trainer.parts import CollectParts
from grouprl.trainer.step_batch import (
    Generated,
    Group,
    Loaded,
    Pending,
    Settled,
    StepBatch,
    staleness,
)

log = logging.getLogger(__name__)

EVALUATION_STREAM = 2**62  # a step number no run reaches: evaluation's own streams



def policy_for_generation(engine, policy):
    """Several ranks: the built-in engine generating with the trainer's own model needs its
    weights whole for the rollout (`gathered`); an engine with its own copy (vLLM) needs nothing
    of them, and the ranks do not hold the whole model beside it. (`policy`: the asynchronous
    rollout's own whole copy, or the trainer's policy.)"""
    return gathered(policy) if engine.reads_trainer_weights else contextlib.nullcontext()


def reduce_step_metrics(metrics: dict[str, float], ranks) -> dict[str, float]:
    """One value per metric over the ranks (reduce_metrics); reward and judge metrics are
    combined from every rank's (counts summed, means averaged where a rank has one), so a key
    only some ranks have (a judge's scores where one rank's calls all failed) is no error."""
    if not ranks.distributed:
        return reduce_metrics(metrics, ranks)
    scored = {k: v for k, v in metrics.items() if k.startswith(("reward/", "judge/"))}
    rest = {k: v for k, v in metrics.items() if k not in scored}
    return merge(reduce_metrics(rest, ranks), combine(ranks.gather((1.0, scored))))


@dataclasses.dataclass(frozen=True)
class Scored:
    """A trajectory's rewards alone, as the batch summary reads them."""

    reward: float
    rewards: dict[str, float]


class Collector:
    """Draws a step's prompts, rolls them out (single-turn or agent) and scores them."""

    def __init__(self, cfg: Config, parts: CollectParts, judge_tallies_per_batch: bool = True):
        """`parts`: what collect reads (the sampler and prompts, the engine and runner, the
        rewards, the ranks); `judge_tallies_per_batch`: a batch's start resets the judges'
        tallies (the calls of an evaluation before it are not its own); off where batches overlap."""
        self.cfg, self.p = cfg, parts
        self.judge_tallies_per_batch = judge_tallies_per_batch
        self.ranks = parts.ranks
        self.runner = parts.runner

    def stop_streaming(self) -> None:
        """Streamed scoring closed for good (the run ends): a later rollout is scored after it
        generates."""
        if self.p.streaming is not None:
            self.p.streaming.close()
            self.p = dataclasses.replace(self.p, streaming=None)

    # ------------------------------------------------------------------ rollout
    def sampling_params(self, evaluation: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_response_length,
            temperature=r.val_temperature if evaluation else r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            stop=list(r.stop),
            ignore_eos=r.ignore_eos and not evaluation,
        )

    def rollout(
        self,
        samples: list[Sample],
        prompts: list[list[int]],
        n: int,
        evaluation=False,
        on_group: Callable[[list[Trajectory]], None] | None = None,
        first_group: int | list[int] = 0,
        stream: tuple[int, int] = (0, 0),
    ) -> list[Trajectory]:
        """n trajectories per prompt, prompt-major; `on_group(group)` gets each prompt's n
        trajectories as soon as they are all complete (streaming rewards). `first_group`: the
        index of `prompts[0]` in the step's whole batch (over all ranks), or every prompt's.
        `stream`: (step, rollout of that step) whose sampling streams a training rollout draws
        from (a step's refills are its rollouts 1, 2, ...); evaluation has streams of its own."""
        # every trajectory samples from its own stream, keyed by (seed, step, rollout) and its
        # place in the step's batch: the tokens do not depend on batching, ranks or a resume;
        # evaluation has streams of its own, so evaluating does not change what training samples
        seed = self.cfg.trainer.seed
        stream_seed = mix_seed(seed, EVALUATION_STREAM) if evaluation else mix_seed(seed, *stream)
        groups = first_group if isinstance(first_group, list) else [first_group + i for i in range(len(prompts))]
        generator = RowStreams(stream_seed, [g * n + j for g in groups for j in range(n)])
        images = self.p.encoder.images_of(samples)
        with_images = {"images": images} if images is not None else {}
        # autocast only where the engine computes here, with the trainer's model (an engine with a
        # copy of its own, vLLM or an engine process, computes in the dtype it was made with)
        in_here = self.p.rollout_dtype if self.p.engine.reads_trainer_weights else None
        with policy_for_generation(self.p.engine, self.p.policy), autocast(self.p.device, in_here):
            try:
                return self.runner.run(
                    samples,
                    prompts,
                    n,
                    self.sampling_params(evaluation),
                    generator,
                    on_group_done=(lambda i, group: on_group(group)) if on_group is not None else None,
                    **with_images,
                )
            except ModelLoadError as e:  # the engine saw a prompt's images otherwise: name the sample
                prompt = getattr(e, "prompt", None)
                if prompt is None or self.cfg.agent.enabled:  # an agent's later turns index rows
                    raise
                raise ModelLoadError(f"sample {samples[prompt].uid!r}: {e}") from None

    def next_prompts(self, extra: int = 0) -> tuple[list[Sample], list[list[int]]]:
        """The step's prompts, or `extra` more of them (dynamic filtering) from the curriculum."""
        p = self.p
        want = extra or self.cfg.data.train_batch_size
        samples, prompts = [], []
        first = not extra
        while len(samples) < want:  # skipped (over-long) prompts are redrawn
            if first:
                drawn, first = p.sampler.next_batch(), False
            else:  # a refill is part of the same step (it does not count one)
                drawn = p.sampler.more(want - len(samples))
            for i in drawn:
                if p.train_prompts[i] is not None and len(samples) < want:
                    samples.append(p.train_samples[i])
                    prompts.append(p.train_prompts[i])
        return samples, prompts

    # ------------------------------------------------------------------ one step's batch
    def collect(self, step: int, version: int | None = None) -> StepBatch:
        """The step's groups, generated and scored (an engine that sleeps between rollouts wakes
        for it). Raises RewardUnavailableError, on every rank alike, when a judge stopped answering or a
        reward component failed too often."""
        return self.finish(self.start(step, version))

    def start(self, step: int, version: int | None = None, loaded: Loaded | None = None) -> Pending:
        """The first half of collect: draw the step's prompts and generate, their rewards in
        flight (streamed) or to be taken by `finish`. With dynamic filtering, whose refills need
        the rewards, the whole batch is done here. `version`: the policy version whose weights
        generate (default: `step`, the synchronous loop's); `loaded`: how they reached the
        generation copy (asynchronous training)."""
        p = self.p
        started = time.perf_counter()
        pushed = None if p.engine.reads_trainer_weights else p.engine.push_seconds  # an engine with its own copy
        if self.judge_tallies_per_batch:
            p.reward.failure_report()  # an evaluation's judge calls are not this step's
        samples, prompts = self.next_prompts()  # the whole step's, the same on every rank
        # this rank's whole groups: its part of every mini-batch, so that each optimizer step
        # sees the groups it sees in one process
        mine = self.ranks.share(len(samples), block=self.cfg.actor.mini_batch_size or len(samples))
        pending = Pending(
            step=step,
            version=step if version is None else version,
            groups=[Group(g, samples[g], prompts[g], []) for g in mine],
            started=started,
            # asynchronous: the weights went into the generation copy before the batch started
            # (`loaded`); the engine learn pushes to is another one
            pushed_before=pushed if loaded is None else None,
            loaded=loaded,
            epoch=float(p.sampler.epoch),  # the draw's (later batches may be drawn already when it is scored)
        )
        with rollout_phase(p.engine):
            pending.generated = self._generate(pending, pending.groups, mine)
            if p.sampler.learns_from_rewards and self.cfg.curriculum.dynamic_filter:
                pending.settled = self._settle(pending)  # refills: generated within this rollout
                pending.epoch = float(p.sampler.epoch)  # after the refills' draws
        return pending

    def finish(self, pending: Pending) -> StepBatch:
        """The second half: wait for the rewards, then judge failures, dropped groups and the
        curriculum's tracker; the StepBatch learn takes."""
        settled = pending.settled if pending.settled is not None else self._settle(pending)
        real = [t for g in settled.groups if g.place is not None for t in g.trajectories]
        metrics = merge(
            settled.metrics,
            self.p.reward.step_metrics(),  # reward models: items, batches, busy time, queue
            {"train/epoch": pending.epoch},
            self.p.prompt_stats,
            staleness(pending.step, pending.version, real, pending.loaded) if pending.loaded is not None else {},
        )
        return StepBatch(
            step=pending.step,
            version=pending.version,
            groups=settled.groups,
            dropped_groups=settled.dropped_groups,
            reward_errors=int(settled.metrics.get("reward/errors", 0)),  # the scoring tallies' count
            metrics=MappingProxyType(metrics),
            started=pending.started,
            pushed_before=pending.pushed_before,
            loaded=pending.loaded,
        )

    def _generate(self, pending: Pending, groups: list[Group], rows: list[int]) -> Generated:
        """Roll out `groups` (drawn, no trajectories yet): the step's next rollout, whose streams
        are keyed by `rows` (each group's place in this rollout's draw); their rewards stream in
        while generation goes on."""
        n, p = self.cfg.rollout.n_agent, self.p
        t0 = time.perf_counter()
        if hasattr(p.reward, "progress"):  # TRL-style rewards read it as trainer_state
            p.reward.progress = dataclasses.replace(p.reward.progress, global_step=pending.step, epoch=float(pending.epoch or 0.0))
        stream = p.streaming.open() if p.streaming is not None else None

        def stamped(group: list[Trajectory]) -> list[Trajectory]:
            """The version that sampled them, before they go to be scored (and are sealed); an
            agent's trajectories carry their first turn's already."""
            for t in group:
                if t.version is None:
                    t.version = pending.version
            return group

        on_group = (lambda group: stream.submit(stamped(group))) if stream is not None else None
        trajectories = self.rollout(
            [g.sample for g in groups],
            [g.prompt for g in groups],
            n,
            on_group=on_group,
            first_group=rows,
            stream=(pending.step, pending.rollouts),
        )
        pending.rollouts += 1
        return Generated(stamped(trajectories), stream, t0, time.perf_counter(), dict(self.runner.stats))

    def _score(self, generated: Generated, clock: dict[str, float]) -> dict[str, float]:
        """Wait for (or take) the rewards of generated trajectories; a judge that stopped
        answering stops the run, on every rank alike."""
        c, p = self.cfg, self.p
        if generated.stream is not None:
            finished = generated.stream.finish(generated.end)
            metrics = dict(finished.metrics)
            clock["reward_hidden"] += finished.hidden_s
            clock["reward"] += finished.reward_s
        else:
            t1 = time.perf_counter()
            metrics = p.reward.score(generated.trajectories)
            clock["reward"] += time.perf_counter() - t1
        clock["generate"] += generated.end - generated.start
        for key, value in generated.stats.items():  # the agent's split of its time: over every rollout
            if key.startswith("time/"):
                clock[key.removeprefix("time/")] = clock.get(key.removeprefix("time/"), 0.0) + value
        metrics = merge(metrics, {k: v for k, v in generated.stats.items() if not k.startswith("time/")})
        # a judge that stopped answering, or a reward that fails on most calls, stops the run
        # (on every rank alike) rather than train it on fallback values
        r = c.reward
        down = rewards_down(self.ranks.gather(p.reward.failure_report()), r.max_consecutive_failures, r.max_failed_share)
        if down is not None:
            raise down
        return metrics

    def _whole(self, groups: list[Group]) -> list[Group]:
        """Every rank's groups, in batch order."""
        return sorted((g for part in self.ranks.gather(groups) for g in part), key=lambda g: g.place)

    def _settle(self, pending: Pending) -> Settled:
        """Score the pending batch's groups (and, with dynamic filtering, refill until enough
        groups differ). Groups a failed judge dropped (on_failure: drop_group) leave the batch on
        every rank alike (decided over every rank's groups), and the kept groups are shared out
        again, each rank its part of every mini-batch (`share_out`)."""
        c, n, p = self.cfg, self.cfg.rollout.n_agent, self.p
        clock = {"generate": 0.0, "reward": 0.0, "reward_hidden": 0.0}

        def generate_and_score(drawn: list[Group], rows: list[int]) -> tuple[list[Group], dict[str, float]]:
            generated = self._generate(pending, drawn, rows)
            groups = [dataclasses.replace(g, trajectories=generated.trajectories[i * n : (i + 1) * n]) for i, g in enumerate(drawn)]  # fmt: skip
            return groups, self._score(generated, clock)

        trajectories = pending.generated.trajectories
        groups = [dataclasses.replace(g, trajectories=trajectories[i * n : (i + 1) * n]) for i, g in enumerate(pending.groups)]  # fmt: skip
        metrics = self._score(pending.generated, clock)
        dropped = 0
        curriculum = p.sampler.learns_from_rewards
        if curriculum and c.curriculum.dynamic_filter:
            kept, metrics, dropped = self._filter_groups(groups, metrics, generate_and_score)
            groups = self.share_out(kept)
        else:
            groups, metrics, dropped = self._drop_failed(groups, metrics, curriculum)
        times = {"time/generate": clock["generate"], "time/reward": clock["reward"]}
        if p.streaming is not None:  # reward work that overlapped generation (not waited for)
            times["time/reward_hidden"] = clock["reward_hidden"]
        for key in ("engine", "tools"):  # an agent's: the engine generating, some tool call in flight
            if key in clock:
                times[f"time/{key}"] = clock[key]
        return Settled(groups, dropped, merge(metrics, self._summary(groups), p.sampler.metrics(), times))

    def _summary(self, groups: list[Group]) -> dict[str, float]:
        """The batch's reward means: written here only, over every rank's kept groups in batch
        order (each rank's rewards gathered, not its trajectories), so they are the same on
        every rank and the same as one process's."""
        mine = [(g.place, [(t.reward, dict(t.rewards)) for t in g.trajectories]) for g in groups if g.place is not None]
        rows = [row for _, group in sorted(x for part in self.ranks.gather(mine) for x in part) for row in group]
        return batch_summary([Scored(reward, rewards) for reward, rewards in rows])

    def _drop_failed(self, groups: list[Group], metrics: dict[str, float], curriculum: bool):
        """A judge failed under on_failure=drop_group: the group leaves the batch on every rank,
        and the kept groups are shared out again. The curriculum's tracker learns from every
        scored group. Returns this rank's groups, the metrics and the groups dropped."""
        p = self.p
        dropped = set()
        if p.reward.drops:
            dropped = set().union(*self.ranks.gather(groups_to_drop([t for g in groups for t in g.trajectories])))
        if curriculum:  # on every rank in the same order
            mine = [(g.place, g.sample.uid, [t.reward for t in g.trajectories]) for g in groups if g.sample.uid not in dropped]
            for _, uid, rewards in sorted(x for part in self.ranks.gather(mine) for x in part):
                p.sampler.update(uid, rewards)
        if not dropped:
            return groups, metrics, 0
        own = sum(g.sample.uid in dropped for g in groups)  # summed over the ranks in the metrics
        batch = self._whole(groups)
        kept = [g for g in batch if g.sample.uid not in dropped]
        metrics["batch/dropped_groups"] = float(own)
        return self.share_out(kept), metrics, len(batch) - len(kept)

    def share_out(self, kept: list[Group]) -> list[Group]:
        """This rank's part of every mini-batch of `kept` (the whole batch's groups in order,
        each placed again by its index in `kept`). A mini-batch whose groups do not split evenly
        over the ranks is padded: the ranks short of a group get a copy of the kept group with
        the fewest tokens, with an all-zero loss mask, which adds no term to the loss and no
        token or row to its denominators, so the update is the one of one process on the kept
        groups. Pads (place None) come last; learn leaves them out of everything it reports."""
        size = self.cfg.actor.mini_batch_size or len(kept)
        places = []
        for start in range(0, len(kept), size):
            k = -(-min(size, len(kept) - start) // self.ranks.world)  # this rank's part, rounded up
            places += [start + self.ranks.rank * k + i for i in range(k)]
        chosen = [dataclasses.replace(kept[g], place=g) for g in places if g < len(kept)]
        pads = len(places) - len(chosen)
        if pads:
            smallest = min(kept, key=lambda g: sum(len(t.response_ids) for t in g.trajectories))
            for _ in range(pads):
                pad = [dataclasses.replace(t, loss_mask=[0] * len(t.loss_mask)) for t in smallest.trajectories]
                chosen.append(Group(None, smallest.sample, smallest.prompt, pad))
        return chosen

    def _filter_groups(self, groups: list[Group], metrics: dict[str, float], generate_and_score):
        """curriculum.dynamic_filter: over-sample prompts (at most max_oversample x B) until B
        groups whose rewards are not all equal, over every rank's groups; a group a failed judge
        dropped (on_failure=drop_group) counts as drawn, never as kept. Refills are split over
        the ranks like the first draw. Returns the kept groups of the whole batch in draw order,
        for the caller to share out again (each rank its part of every mini-batch, so the run
        equals one process's), the step's metrics and the groups dropped."""
        c, B = self.cfg, self.cfg.data.train_batch_size
        sampler = self.p.sampler
        scored = [(len(groups) * c.rollout.n_agent, metrics)]  # every scoring's metrics: counts add up
        own = [g.place for g in groups]  # the places of the groups this rank generated

        def rewards():  # a dropped group's: none (no signal)
            dropped = groups_to_drop([t for g in batch for t in g.trajectories])
            return [[] if g.sample.uid in dropped else [t.reward for t in g.trajectories] for g in batch]

        batch = self._whole(groups)
        while (k := prompts_to_draw(rewards(), B, c.curriculum.max_oversample)) > 0:
            more_samples, more_prompts = self.next_prompts(extra=k)  # the same on every rank
            part = list(self.ranks.split(k))
            drawn = [Group(len(batch) + i, more_samples[i], more_prompts[i], []) for i in part]
            more, more_metrics = generate_and_score(drawn, part)
            scored.append((len(more) * c.rollout.n_agent, more_metrics))
            own += [g.place for g in drawn]
            batch += self._whole(more)
        found = rewards()
        for g, group in zip(batch, found):  # every scored group teaches the tracker
            if group:
                sampler.update(g.sample.uid, group)
        usable = [i for i, group in enumerate(found) if group]
        selection = select_groups([found[i] for i in usable], B)
        sampler.note_selection(selection)
        kept = [batch[usable[i]] for i in selection.keep]
        counted = ("reward/errors", "reward/gated/", "reward/not_applicable/", "judge/")  # over every scoring of the step
        metrics = combine([(w, {k: v for k, v in m.items() if k.startswith(counted)}) for w, m in scored])
        metrics["batch/generated_groups"] = float(len(batch))
        metrics["batch/zero_std_dropped"] = float(selection.zero_variance_dropped)
        if len(usable) < len(batch):
            metrics["batch/dropped_groups"] = float(sum(not found[g] for g in own))  # summed over the ranks
        return kept, metrics, len(batch) - len(usable)
