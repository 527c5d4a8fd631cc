import json
import random

import numpy as np
import pytest
import torch

from grouprl.data import PromptSampler
from grouprl.errors import ConfigError


def draw(sampler, batches):
    return [sampler.next_batch() for _ in range(batches)]


def test_sequential_is_file_order_across_epoch_boundaries():
    sampler = PromptSampler(5, 2, "sequential", seed=3)
    assert draw(sampler, 5) == [[0, 1], [2, 3], [4, 0], [1, 2], [3, 4]]
    assert sampler.epoch == 2
    assert sampler.state_dict() == {
        "epoch": 2,
        "position": 0,
        "seed": 3,
        "mode": "sequential",
        "num_samples": 5,
    }


def test_batch_larger_than_the_dataset_wraps_around():
    sampler = PromptSampler(3, 7, "sequential", seed=0)
    assert sampler.next_batch() == [0, 1, 2, 0, 1, 2, 0]
    assert (sampler.epoch, sampler.state_dict()["position"]) == (2, 1)


def test_random_epochs_are_permutations_fixed_by_seed_and_epoch():
    sampler = PromptSampler(10, 4, "random", seed=7)
    stream = sum(draw(sampler, 5), [])  # 20 indices = exactly two epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] == sampler.epoch_order(0) and stream[10:] == sampler.epoch_order(1)
    assert stream[:10] != stream[10:]  # a fresh shuffle each epoch
    assert stream[:10] != list(range(10))
    assert PromptSampler(10, 4, "random", seed=8).epoch_order(0) != sampler.epoch_order(0)


def test_random_order_ignores_the_global_rngs():
    orders = []
    for global_seed in (0, 1):
        random.seed(global_seed)
        np.random.seed(global_seed)
        torch.manual_seed(global_seed)
        orders.append(draw(PromptSampler(9, 4, "random", seed=-2), 6))
    assert orders[0] == orders[1]
    assert PromptSampler(9, 4, "random", seed=2).epoch_order(0) != PromptSampler(
        9, 4, "random", seed=-2
    ).epoch_order(0)


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_resumed_sampler_draws_what_the_uninterrupted_one_draws(mode):
    # N=6, B=4: cuts after k batches land mid-epoch (k=1: position 4) and exactly on
    # an epoch boundary (k=3: 12 indices = epoch 2, position 0).
    reference = draw(PromptSampler(6, 4, mode, seed=11), 12)
    positions = set()
    for cut in range(10):
        before = PromptSampler(6, 4, mode, seed=11)
        draw(before, cut)
        state = json.loads(json.dumps(before.state_dict()))  # as a checkpoint would store it
        positions.add((state["epoch"], state["position"]))
        resumed = PromptSampler(6, 4, mode, seed=999)  # the saved seed wins
        resumed.load_state_dict(state)
        assert resumed.epoch == state["epoch"]
        assert draw(resumed, 12 - cut) == reference[cut:], cut
    assert (2, 0) in positions and (0, 4) in positions


def test_state_from_another_dataset_or_mode_is_refused():
    state = PromptSampler(6, 2, "random", seed=1).state_dict()
    with pytest.raises(ConfigError, match="saved for 6 samples, the dataset now has 7"):
        PromptSampler(7, 2, "random", seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="saved in mode 'random'"):
        PromptSampler(6, 2, "sequential", seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="out of range"):
        PromptSampler(6, 2, "random", seed=1).load_state_dict({**state, "position": 6})


@pytest.mark.parametrize(
    "num_samples, batch_size, epochs, steps",
    [(10, 4, 1, 2), (10, 4, 2, 5), (10, 4, 0.5, 1), (3, 8, 1, 1), (10, 4, 0, 0), (100, 1, 0.29, 29)],
)
def test_steps_for_epochs_is_floor_of_epochs_times_n_over_b(num_samples, batch_size, epochs, steps):
    assert PromptSampler(num_samples, batch_size).steps_for_epochs(epochs) == steps


def test_steps_for_epochs_never_draws_past_the_epochs():
    sampler = PromptSampler(10, 4, "sequential")
    draw(sampler, sampler.steps_for_epochs(2))
    assert sampler.epoch == 2 and sampler.state_dict()["position"] == 0
    assert PromptSampler(10, 4).steps_per_epoch == 2


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((0, 2, "random"), "at least one sample"),
        ((5, 0, "random"), "batch_size >= 1"),
        ((5, 2, "shuffle"), "mode"),
    ],
)
def test_bad_arguments(args, fragment):
    with pytest.raises(ConfigError, match=fragment):
        PromptSampler(*args)


def test_a_plain_sampler_answers_the_sampler_protocol_and_learns_nothing():
    """What the loop asks of every sampler (grouprl.data.Sampler): a refill within a step takes
    the next batch's indices, and rewards, selections and metrics change nothing."""
    from grouprl.data import Sampler

    s = PromptSampler(5, 2, "sequential")
    assert isinstance(s.learns_from_rewards, bool) and not s.learns_from_rewards
    assert s.next_batch() == [0, 1]
    assert s.more(1) == [2, 3]  # its next whole batch: the caller takes what it needs
    before = s.state_dict()
    s.update("q0", [1.0, 0.0])
    s.note_selection(None)
    assert s.metrics() == {} and s.state_dict() == before and s.next_batch() == [4, 0]
    members = [m for m in dir(Sampler) if not m.startswith("_")]
    assert all(hasattr(s, m) for m in members), [m for m in members if not hasattr(s, m)]
