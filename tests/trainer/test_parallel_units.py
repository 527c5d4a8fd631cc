"""The rank arithmetic without processes: which groups a rank holds, how metrics combine, and
the settings several ranks refuse (one line each)."""

import pytest

from grouprl.errors import UserError
from grouprl.trainer.parallel import Ranks, reduce_metrics


def test_each_rank_holds_its_part_of_every_mini_batch():
    # 8 groups, mini-batches of 4, 2 ranks: rank 0 takes groups 0,1 and 4,5; rank 1 takes 2,3 and 6,7
    assert Ranks(0, 2).share(8, block=4) == [0, 1, 4, 5]
    assert Ranks(1, 2).share(8, block=4) == [2, 3, 6, 7]
    assert Ranks(1, 2).share(8) == [4, 5, 6, 7]  # one mini-batch: contiguous halves
    shares = [Ranks(r, 4).share(12, block=4) for r in range(4)]
    assert sorted(g for s in shares for g in s) == list(range(12))  # every group once
    assert Ranks().share(5) == [0, 1, 2, 3, 4]


def test_batch_sizes_that_do_not_split_into_whole_groups_are_one_line():
    with pytest.raises(UserError, match=r"data.train_batch_size=6 must be a multiple of the number of ranks \(4\)"):
        Ranks(0, 4).share(6)
    with pytest.raises(UserError, match=r"actor.mini_batch_size=2 must be a multiple of the number of ranks \(4\)"):
        Ranks(0, 4).share(8, block=2)


def test_held_out_prompts_split_as_evenly_as_may_be():
    parts = [Ranks(r, 3).split(10) for r in range(3)]
    assert [list(p) for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]


class TwoRanks(Ranks):
    """Rank 0 of two, the other rank's values given: reduce/gather as torch.distributed would."""

    def __init__(self, other: dict):
        super().__init__(0, 2)
        object.__setattr__(self, "other", other)

    def gather(self, obj):
        return [obj, sorted(self.other)] if isinstance(obj, list) else [obj, self.other]

    def reduce(self, values, op="sum"):
        mine, theirs = list(values), [self.other[k] for k in sorted(self.other)]
        combine = {"sum": lambda a, b: a + b, "max": max, "min": min}[op]
        return [combine(a, b) for a, b in zip(mine, theirs)]


def test_metrics_combine_by_kind():
    mine = {"reward/mean": 0.2, "reward/errors": 1.0, "time/generate": 3.0, "response/length_max": 7.0,
            "adv/min": -1.0, "perf/tokens_per_s": 100.0, "perf/peak_rss_gb": 2.0, "actor/grad_norm": 0.5}  # fmt: skip
    other = {"reward/mean": 0.4, "reward/errors": 2.0, "time/generate": 5.0, "response/length_max": 9.0,
             "adv/min": -2.0, "perf/tokens_per_s": 80.0, "perf/peak_rss_gb": 3.0, "actor/grad_norm": 0.5}  # fmt: skip
    out = reduce_metrics(mine, TwoRanks(other))
    assert out == pytest.approx(
        {
            "reward/mean": 0.3,  # equal shares: the mean of means
            "reward/errors": 3.0,  # counts add up
            "time/generate": 5.0,  # the slowest rank
            "response/length_max": 9.0,
            "adv/min": -2.0,
            "perf/tokens_per_s": 180.0,  # throughput adds up
            "perf/peak_rss_gb": 3.0,
            "actor/grad_norm": 0.5,  # already global: the same on every rank
            "dist/world_size": 2.0,
        }
    )
    assert reduce_metrics({"reward/mean": 0.2}, Ranks())["dist/world_size"] == 1.0


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.quantization=4bit", r"model.quantization=4bit runs in one process only \(this run has 2 ranks\)"),
        ("data.train_batch_size=3", r"data.train_batch_size=3 must be a multiple of the number of ranks \(2\)"),
        (
            "rollout.max_staleness=1 rollout.engine_process=true rollout.engine_device=cuda:1",
            r"rollout.engine_device=cuda:1 would be every rank's engine device \(2 ranks\)",
        ),
    ],
)
def test_settings_several_ranks_refuse_are_one_line(override, message):
    from grouprl.config import load_config
    from grouprl.trainer.setup import check_parallel

    cfg = load_config(None, ["model.lora.rank=8", "model.gradient_checkpointing=true"])
    check_parallel(cfg, Ranks(0, 2))  # LoRA and recompute pass
    with pytest.raises(UserError, match=message):
        check_parallel(load_config(None, ["model.lora.rank=8", *override.split()]), Ranks(1, 2))


def test_a_shard_size_that_does_not_divide_the_ranks_is_one_line():
    from grouprl.trainer.parallel import device_mesh

    assert device_mesh(Ranks(0, 4), "cpu", -1) is None and device_mesh(Ranks(0, 4), "cpu", 4) is None
    with pytest.raises(UserError, match=r"actor.fsdp_size=3 must divide the number of ranks \(4\), or be -1"):
        device_mesh(Ranks(1, 4), "cpu", 3)


def test_the_optimizer_step_runs_with_the_threads_it_is_given():
    """Under FSDP's offload the step runs on host shards with the rank's share of the node's
    cores (torchrun starts each rank on one thread); the threads are as they were after."""
    import torch
    from test_update import CountingScheduler, actor_config

    from grouprl.devices import host_share
    from grouprl.trainer.update import PolicyUpdater, StepTensors

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            threads.append(torch.get_num_threads())
            return super().step(closure)

    threads: list[int] = []
    w = torch.nn.Parameter(torch.ones(2))
    before = torch.get_num_threads()
    updater = PolicyUpdater(actor_config(), temperature=1.0, pad_token_id=0, step_threads=before + 2)
    updater._gradients = lambda *a, **k: (w.sum().backward(), {})[1]  # any gradient: the step is what is watched
    mask = torch.ones(1, 1)
    tensors = StepTensors([[1]], torch.ones(1, 1, dtype=torch.long), mask.long(), mask, torch.zeros(1))
    updater.update(torch.nn.Linear(1, 1), Recording([w], lr=0.1), CountingScheduler(), tensors, 1, [w])
    assert threads == [before + 2] and torch.get_num_threads() == before
    assert host_share(2) >= 1 and host_share(10**6) == 1
