"""The two halves of a step on their own: Collector.collect and Learner.learn driven directly,
on a tiny model whose engine is a fake (fixed responses, weight pushes that take a set time),
with expected values worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import A_FRACTION, tiny_model_dir, write_run_config

from grouprl.config import load_config
from grouprl.rollout.engines.base import Generation, RolloutEngine
from grouprl.rollout.engines.streams import RowStreams, mix_seed
from grouprl.rollout.single_turn import SingleTurn
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.learner import Learner
from grouprl.trainer.parallel import Ranks
from grouprl.trainer.setup import build
from grouprl.trainer.step import Collector
from grouprl.trainer.step_batch import Group, Loaded, StepBatch
from grouprl.trainer.update import build_step_tensors

# each call answers every prompt's n = 4 samples with these, in order; A_FRACTION scores the
# share of "a" in the text
RESPONSES = ["aab", "bbb", "aaa", "abab"]
REWARDS = [2 / 3, 0.0, 1.0, 0.5]
PUSH_S = 0.25  # what the fake engine's every weight push takes


class FakeEngine:
    """The rollout engine interface over fixed responses: every prompt's n samples are
    RESPONSES (then <eos>); it keeps each call's prompts and its sampling streams' first draw,
    and counts its pushes in `push_seconds` as an engine with its own copy of the weights does."""

    reads_trainer_weights = False  # it keeps its own copy: pushes are counted, not gathered
    last_sleep_freed_bytes = 0
    policy_version = None  # never told one: a synchronous run

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_ids, self.pad_token_id = [tokenizer.eos_token_id], tokenizer.pad_token_id
        self.prefill_tokens = 0
        self.push_seconds = 0.0
        self.calls: list[dict] = []
        self.phases: list[str] = []
        self.flat: set[tuple[int, int]] = set()  # (call, prompt) answered "bbb" n times: rewards all equal

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts, n, params, generator=None, on_group_done=None, images=None):
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        self.calls.append({"prompts": prompts, "n": n, "draws": generator.uniform().tolist(), "autocast": autocast})
        out = []
        for i in range(len(prompts)):
            flat = (len(self.calls) - 1, i) in self.flat
            group = [self._generation("bbb" if flat else RESPONSES[j % len(RESPONSES)]) for j in range(n)]
            if on_group_done is not None:
                on_group_done(i, group)
            out += group
        return out

    def _generation(self, text: str) -> Generation:
        ids = self.tokenizer.convert_tokens_to_ids(list(text)) + [self.tokenizer.eos_token_id]
        return Generation(token_ids=ids, text=text, finish_reason="eos")

    def open_session(self, prompts, n, reuse_cache=True, images=None):
        raise NotImplementedError("single-turn runs only")

    def weights_updated(self, model, version=None) -> None:
        self.push_seconds += PUSH_S

    def offer_weights(self, version, weights) -> None:
        raise NotImplementedError("synchronous runs offer nothing between turns")

    def begin_rollout(self) -> None:
        self.phases.append("begin")

    def end_rollout(self) -> None:
        self.phases.append("end")

    def close(self) -> None:
        self.phases.append("close")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("step")
    return write_run_config(root, tiny_model_dir(root / "model"), reward=A_FRACTION)


def parts_for(config, *overrides):
    """A run's real parts (setup.build) with the fake engine in place of the built-in one."""
    parts = build(load_config(config, ["data.val_files=[]", *overrides]))
    engine = FakeEngine(parts.learn.model, parts.tokenizer)
    assert isinstance(engine, RolloutEngine)  # it keeps to the interface the loop asks of engines
    collect = dataclasses.replace(parts.collect, engine=engine, runner=SingleTurn(engine))
    return dataclasses.replace(parts, collect=collect, learn=dataclasses.replace(parts.learn, engine=engine))


def test_collect_returns_the_steps_groups_scored_in_one_finished_batch(config):
    parts = parts_for(config)
    collector = Collector(parts.cfg, parts.collect)
    batch = collector.collect(step=2)
    engine = parts.collect.engine
    assert engine.phases == ["begin", "end"]  # one rollout, the engine awake around it
    assert [len(call["prompts"]) for call in engine.calls] == [2]  # data.train_batch_size prompts, n = 4
    assert (batch.step, batch.version, batch.dropped_groups, batch.pushed_before, batch.loaded) == (2, 2, 0, 0.0, None)
    assert batch.places == [0, 1] and [g.prompt for g in batch.groups] == engine.calls[0]["prompts"]
    for group in batch.groups:
        assert [t.response_text for t in group.trajectories] == RESPONSES
        assert all(t.sample is group.sample and t.prompt_ids == group.prompt and t.version == 2 for t in group.trajectories)
        assert [t.reward for t in group.trajectories] == pytest.approx(REWARDS, abs=1e-12)
    assert batch.trajectories == batch.real_trajectories and len(batch.trajectories) == 8
    assert batch.metrics["reward/mean"] == pytest.approx(sum(REWARDS) / 4, abs=1e-12)
    assert batch.metrics["train/epoch"] == 0.0 and batch.metrics["time/generate"] >= 0.0
    assert not any(k.startswith("rollout/staleness") for k in batch.metrics)  # a synchronous batch
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.metrics = {}  # nothing writes a batch once collected
    with pytest.raises(TypeError):
        batch.metrics["reward/mean"] = 1.0


def test_a_steps_rollouts_sample_from_streams_keyed_by_step_and_rollout(config):
    """Every row's stream is keyed by (seed, step, the step's rollout) and its place in the
    batch; `rollout(stream=...)` names them, as collect does for its first rollout."""
    parts = parts_for(config, "trainer.seed=7")
    collector = Collector(parts.cfg, parts.collect)
    batch = collector.collect(step=5)
    want = RowStreams(mix_seed(7, 5, 0), range(8)).uniform().tolist()
    assert parts.collect.engine.calls[0]["draws"] == want
    samples, prompts = [g.sample for g in batch.groups], [g.prompt for g in batch.groups]
    collector.rollout(samples, prompts, 4, stream=(5, 0))  # the same streams again
    collector.rollout(samples, prompts, 4, stream=(5, 1))  # the step's second rollout (a refill)
    assert parts.collect.engine.calls[1]["draws"] == want
    assert parts.collect.engine.calls[2]["draws"] == RowStreams(mix_seed(7, 5, 1), range(8)).uniform().tolist() != want


def test_generation_runs_under_autocast_only_where_the_engine_computes_with_the_trainers_model(config):
    """bf16 generation: the built-in engine (the trainer's model, in this thread) runs under
    the rollout's autocast; an engine with a copy of its own (vLLM, an engine process) computes
    in the dtype it was made with, so nothing here wraps it."""
    parts = parts_for(config, "actor.dtype=bfloat16")
    assert parts.collect.rollout_dtype == torch.bfloat16
    collector = Collector(parts.cfg, parts.collect)
    samples, prompts = collector.next_prompts()
    collector.rollout(samples, prompts, 4)
    parts.collect.engine.reads_trainer_weights = True  # as the built-in engine
    collector.rollout(samples, prompts, 4)
    assert [call["autocast"] for call in parts.collect.engine.calls] == [None, torch.bfloat16]
    assert not torch.is_autocast_enabled("cpu")


def test_dynamic_filtering_refills_from_the_steps_next_streams(config):
    """A group whose rewards are all equal leaves; the refill is the step's second rollout, its
    rows keyed by their places in the refill's own draw, and the batch keeps B groups."""
    parts = parts_for(config, "data.sampler=curriculum", "curriculum.dynamic_filter=true")
    parts.collect.engine.flat = {(0, 0)}  # the first prompt's group teaches nothing
    batch = Collector(parts.cfg, parts.collect).collect(step=4)
    first, refill = parts.collect.engine.calls
    assert len(first["prompts"]) == 2 and len(refill["prompts"]) >= 1
    k = len(refill["prompts"])
    assert refill["draws"] == RowStreams(mix_seed(0, 4, 1), range(4 * k)).uniform().tolist()
    assert first["draws"] == RowStreams(mix_seed(0, 4, 0), range(8)).uniform().tolist()
    assert batch.places == [0, 1] and batch.dropped_groups == 0
    assert [g.prompt for g in batch.groups] == [first["prompts"][1], refill["prompts"][0]]
    assert batch.metrics["batch/generated_groups"] == 2 + k and batch.metrics["batch/zero_std_dropped"] >= 1


def test_an_asynchronous_batch_carries_its_staleness_and_its_weights_push(config):
    """A batch generated ahead (version 1, learned at step 3) reports how stale it is and the
    wait and push the pipeline measured; its push is that one, not the counter of the trainer's
    engine (which here counts pushes too)."""
    parts = parts_for(config)
    collector = Collector(parts.cfg, parts.collect, judge_tallies_per_batch=False)
    batch = collector.finish(collector.start(3, version=1, loaded=Loaded(waited=0.5, push=0.125)))
    assert batch.pushed_before is None and all(t.version == 1 for t in batch.trajectories)
    assert {k: batch.metrics[k] for k in ("rollout/staleness_mean", "rollout/staleness_max", "rollout/policy_version")} == {
        "rollout/staleness_mean": 2.0,
        "rollout/staleness_max": 2.0,
        "rollout/policy_version": 1.0,
    }
    assert batch.metrics["time/wait_weights"] == 0.5 and "time/weight_push" not in batch.metrics
    learned = Learner(parts.cfg, parts.learn).learn(batch).metrics
    assert learned["time/weight_push"] == 0.125 and "perf/engine_freed_gb" not in learned
    assert parts.collect.engine.push_seconds == PUSH_S  # the engine was pushed to all the same


def test_learn_updates_as_the_updater_does_on_tensors_built_by_hand(config):
    """learn = GRPO advantages (by hand here) + one PolicyUpdater.update on the batch's
    tensors: the weights come out as those of the same update run by hand on a second copy of
    the run. It returns what it measured and leaves the batch as it was."""
    parts, reference = parts_for(config), parts_for(config)
    batch = Collector(parts.cfg, parts.collect).collect(step=0)
    collected = dict(batch.metrics)
    result = Learner(parts.cfg, parts.learn).learn(batch)
    learned = result.metrics
    assert batch.metrics == collected and "reward/mean" not in learned  # its own figures only

    r = torch.tensor(REWARDS, dtype=torch.float32)
    eps = parts.cfg.algorithm.adv_epsilon
    advantages = ((r - r.mean()) / (r.std() + eps)).tolist() * 2  # both groups answered alike
    assert list(result.advantages) == pytest.approx(advantages, abs=1e-6)
    assert learned["adv/mean"] == pytest.approx(0.0, abs=1e-6)
    assert learned["adv/max"] == pytest.approx(max(advantages), abs=1e-6)
    assert learned["response/length_mean"] == pytest.approx(sum(len(s) + 1 for s in RESPONSES) / 4)
    assert learned["batch/zero_std_groups"] == 0.0 and learned["response/truncated_frac"] == 0.0
    assert learned["actor/lr"] == pytest.approx(parts.cfg.actor.optim.lr)
    # the push: the engine's counter from collect's start to after the update
    assert learned["time/weight_push"] == PUSH_S and learned["perf/engine_freed_gb"] == 0.0

    tensors = build_step_tensors(
        batch.trajectories, reference.learn.device, mask_truncated=False, pad_token_id=reference.learn.engine.pad_token_id
    )
    tensors = dataclasses.replace(tensors, advantages=torch.tensor(advantages, dtype=torch.float32))
    p = reference.learn
    before = {n: w.detach().clone() for n, w in p.model.named_parameters()}
    p.updater.update(p.policy, p.optimizer, p.scheduler, tensors, 2, p.params)
    ours, theirs = dict(parts.learn.model.named_parameters()), dict(p.model.named_parameters())
    assert sum(not torch.equal(ours[n], before[n]) for n in ours) >= len(ours) - 1  # the update moved them
    for name, weight in ours.items():
        torch.testing.assert_close(weight, theirs[name], rtol=0, atol=1e-7)


def test_share_out_gives_each_rank_its_part_and_pads_the_short_one(config):
    """Three kept groups over two ranks (one mini-batch): rank 0 takes places 0 and 1, rank 1
    place 2 and a pad, a copy of the group with the fewest tokens whose loss mask is all zero;
    learn leaves the pad out of what it reports."""
    parts = parts_for(config)
    kept = [Group(10 + k, parts.collect.train_samples[k], [5, 6, k], rows([5, 6, k], k)) for k in (2, 0, 1)]  # the 2nd: fewest tokens
    shares = []
    for rank in (0, 1):
        ranked = dataclasses.replace(parts.collect, ranks=Ranks(rank=rank, world=2))
        shares.append(Collector(parts.cfg, ranked).share_out(kept))
    assert [g.place for g in shares[0]] == [0, 1] and shares[0][0].sample is kept[0].sample
    assert [g.place for g in shares[1]] == [2, None]
    pad = shares[1][1]
    assert pad.sample is kept[1].sample and pad.prompt == kept[1].prompt
    assert [t.response_ids for t in pad.trajectories] == [t.response_ids for t in kept[1].trajectories]
    assert all(t.loss_mask == [0] * len(t.response_ids) for t in pad.trajectories)
    assert all(t.loss_mask == [1] * len(t.response_ids) for t in kept[1].trajectories)  # the original is untouched
    batch = StepBatch(step=0, version=0, groups=shares[1], dropped_groups=0, reward_errors=0, metrics={}, started=0.0)
    assert batch.places == [2] and batch.real_trajectories == kept[2].trajectories and len(batch.trajectories) == 4
    assert [len(t.response_ids) for t in batch.real_trajectories] == [2, 3]  # the group placed 2 (k = 1)


def rows(prompt: list[int], k: int) -> list[Trajectory]:
    """A group of two trajectories with k + 1 and k + 2 response tokens."""
    return [
        Trajectory(sample=None, index=j, prompt_ids=prompt, response_ids=[7] * (k + 1 + j), loss_mask=[1] * (k + 1 + j))
        for j in range(2)
    ]


def test_records_stop_changing_when_their_stage_ends(config):
    """A trajectory is sealed once scored (its fields, lists and dicts refuse writes) and the
    update's tensors are frozen: learn adds nothing to the batch it was given."""
    from grouprl.rollout.trajectory import SealedError

    parts = parts_for(config)
    batch = Collector(parts.cfg, parts.collect).collect(step=0)
    t = batch.trajectories[0]
    assert t.sealed and t.rewards and t.response_ids
    for write in (
        lambda: setattr(t, "reward", 1.0),
        lambda: setattr(t, "version", 9),
        lambda: t.rewards.__setitem__("correct", 1.0),
        lambda: t.response_ids.append(1),
        lambda: t.loss_mask.__setitem__(0, 0),
        lambda: t.extra.update(x=1),
    ):
        with pytest.raises(SealedError):
            write()
    snapshot = [(u.reward, dict(u.rewards), list(u.response_ids), u.version) for u in batch.trajectories]
    learner = Learner(parts.cfg, parts.learn)
    tensors, _, _ = learner.step_tensors(batch)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tensors.advantages = None
    learner.learn(batch)
    assert [(u.reward, dict(u.rewards), list(u.response_ids), u.version) for u in batch.trajectories] == snapshot
    copy = dataclasses.replace(t, loss_mask=[0] * len(t.loss_mask))  # a pad: a new record, unsealed
    assert not copy.sealed and copy.response_ids == t.response_ids and copy.loss_mask != t.loss_mask


def test_each_metric_of_a_step_has_one_writer(config, monkeypatch):
    """A step's metrics are joined from parts (metric_parts.merge); every part of a collect and
    a learn is recorded and no key comes from two of them; the reward means come from the
    batch summary alone (a scoring reports its tallies only)."""
    import grouprl.trainer.learner as learner_module
    import grouprl.trainer.step as step_module
    from grouprl.trainer.metric_parts import MetricClash, merge

    with pytest.raises(MetricClash, match="reward/mean"):
        merge({"reward/mean": 0.5, "a": 1.0}, {"reward/mean": 0.5})
    parts_seen: list[set[str]] = []

    def recording(*parts):
        parts_seen.extend(set(p) for p in parts if p)
        return merge(*parts)

    monkeypatch.setattr(step_module, "merge", recording)
    monkeypatch.setattr(learner_module, "merge", recording)
    parts = parts_for(config)
    batch = Collector(parts.cfg, parts.collect).collect(step=0)
    learned = Learner(parts.cfg, parts.learn).learn(batch).metrics
    writers: dict[str, int] = {}
    for keys in parts_seen:
        for key in keys:
            writers[key] = writers.get(key, 0) + 1
    # a part merged again as a whole (the settled metrics inside finish's) is one writer seen twice;
    # the leaves: every key of the batch and of learn reached through exactly one leaf part
    leaves = [keys for keys in parts_seen if not any(keys < other for other in parts_seen)]
    assert set().union(*leaves) >= set(batch.metrics) | set(learned)
    for key in set(batch.metrics) | set(learned):
        assert sum(key in leaf for leaf in leaves) == 1, key
    scored = parts.collect.reward.score([dataclasses.replace(t, rewards={}, extra={}) for t in batch.trajectories[:4]])
    assert not any(k in scored for k in ("reward/mean", "reward/std")) and "reward/errors" in scored
    assert batch.metrics["reward/mean"] == pytest.approx(sum(REWARDS) / 4, abs=1e-12)
