"""The online curriculum sampler: bucket weights, passes, updates and re-bucketing, exact
resume; the dynamic-filter selection; the config section."""

import json
from collections import Counter

import pytest

from grouprl.config import CurriculumConfig, load_config
from grouprl.curriculum.filtering import keep_groups, prompts_to_draw, select_groups
from grouprl.curriculum.online import OnlineCurriculum
from grouprl.data.sample import Sample
from grouprl.errors import ConfigError


def cfg(**overrides):
    return CurriculumConfig(**overrides)


def prior(score, std=0.1, n=5):
    return {"score": score, "std": std, "n": n, "bucket": "?", "rank": 0}


# ---------------------------------------------------------------------------- drawing
def test_a_single_pool_is_walked_in_order_one_pass_after_another():
    sampler = OnlineCurriculum(
        ["a", "b", "c"], 3, cfg(weights={"edge": 1.0}), priors=[prior(0.2), prior(0.6), prior(0.4)]
    )
    assert sampler.pool_members("edge") == [1, 2, 0]  # easy-to-hard: 0.6, 0.4, 0.2
    assert [sampler.next_batch() for _ in range(3)] == [[1, 2, 0]] * 3
    assert sampler.epoch == 3 and sampler.steps_for_epochs(2) == 2


def test_a_refill_within_a_step_draws_k_more_without_counting_a_step():
    """The Sampler protocol's `more(k)` is the curriculum's draw: k prompts, the step unchanged."""
    make = lambda: OnlineCurriculum(["a", "b", "c"], 3, cfg(weights={"edge": 1.0}), priors=[prior(0.2), prior(0.6), prior(0.4)])  # noqa: E731
    sampler, reference = make(), make()
    assert sampler.learns_from_rewards
    sampler.next_batch(), reference.next_batch()
    assert sampler.more(2) == reference.draw(2) and len(sampler.more(1)) == 1
    assert sampler.state_dict()["step"] == 1


def test_every_prompt_once_per_pass_even_across_batch_boundaries():
    uids = [f"p{i}" for i in range(10)]
    sampler = OnlineCurriculum(
        uids, 4, cfg(weights={"edge": 1.0}), priors=[prior(0.1 + i / 20) for i in range(10)]
    )
    drawn = [sampler.next_batch() for _ in range(5)]  # 20 draws = two passes
    assert all(len(set(batch)) == 4 for batch in drawn)
    assert Counter(i for batch in drawn for i in batch) == Counter({i: 2 for i in range(10)})
    assert drawn[0] == [9, 8, 7, 6]  # easiest first
    # batch 3 ends pass 1 (1, 0) and opens pass 2 with prompts not in it (9, 8)
    assert drawn[2] == [1, 0, 9, 8]


def test_a_batch_larger_than_its_pools_repeats_only_when_it_must():
    sampler = OnlineCurriculum(
        ["a", "b", "c"],
        8,
        cfg(weights={"edge": 1.0, "mastered": 0.0}),
        priors=[prior(0.3), prior(0.5), prior(0.9)],
    )
    batch = sampler.next_batch()  # edge holds a and b; mastered has weight 0
    assert batch == [1, 0, 1, 0, 1, 0, 1, 0]


def test_bucket_weights_are_followed_and_empty_buckets_give_way():
    # 30 mastered, 40 edge, 30 unsolvable prompts
    scores = [0.9] * 30 + [0.5] * 40 + [0.0] * 30
    weights = {"mastered": 0.1, "edge": 0.8, "unsolvable": 0.1, "unseen": 0.5}
    sampler = OnlineCurriculum(
        [f"u{i}" for i in range(100)], 4, cfg(weights=weights), seed=11, priors=[prior(s) for s in scores]
    )
    bucket = ["mastered"] * 30 + ["edge"] * 40 + ["unsolvable"] * 30
    counts = Counter(bucket[i] for _ in range(250) for i in sampler.next_batch())
    # 1000 draws; the empty unseen pool's weight is shared out: 10% / 80% / 10%, sd ~ 9.5 / 12.6
    assert abs(counts["edge"] - 800) < 4 * 12.6
    assert abs(counts["mastered"] - 100) < 4 * 9.5 and abs(counts["unsolvable"] - 100) < 4 * 9.5
    # the same seed draws the same stream
    again = OnlineCurriculum(
        [f"u{i}" for i in range(100)], 4, cfg(weights=weights), seed=11, priors=[prior(s) for s in scores]
    )
    assert Counter(bucket[i] for _ in range(250) for i in again.next_batch()) == counts


def test_without_any_weighted_prompt_every_prompt_is_equally_likely():
    sampler = OnlineCurriculum([f"u{i}" for i in range(6)], 6, cfg(weights={"edge": 1.0}), seed=3)
    assert sorted(sampler.next_batch()) == list(range(6))  # all unseen: one full permutation


# ---------------------------------------------------------------------------- feedback
def test_update_tracks_the_moving_average_and_all_rewards():
    sampler = OnlineCurriculum(["a", "b"], 1, cfg(ema=0.5))
    sampler.update("a", [1.0, 0.0, 1.0, 0.0])
    sampler.update(0, [1.0, 1.0, 1.0, 1.0])
    stats = sampler.stats("a")
    assert stats["score"] == 0.75  # 0.5, then 0.5 * 0.5 + 0.5 * 1.0
    assert (stats["visits"], stats["count"], stats["mean"]) == (2, 8, 0.75)
    assert stats["std"] == pytest.approx((0.75 - 0.75**2) ** 0.5, abs=1e-12)
    assert stats["latest_flat"] is True and stats["bucket"] == "unseen"  # until the next re-bucket
    assert sampler.stats(1)["score"] is None


def test_rebucketing_counts_promotions_demotions_and_newly_classified():
    sampler = OnlineCurriculum(
        ["p0", "p1", "p2", "p3"],
        2,
        cfg(ema=1.0, rebucket_every=2, rule="mean"),
        priors=[prior(0.05), prior(0.5), prior(0.9), None],
    )
    assert [sampler.stats(i)["bucket"] for i in range(4)] == ["unsolvable", "edge", "mastered", "unseen"]
    sampler.next_batch()
    sampler.update("p0", [1.0, 1.0, 0.0, 1.0])  # 0.75: unsolvable -> mastered
    sampler.update("p2", [0.0, 0.0, 0.0, 0.0])  # 0.0: mastered -> unsolvable
    sampler.update("p3", [0.5, 0.25])  # unseen -> edge
    sampler.next_batch()
    assert sampler.metrics()["curriculum/rebuckets"] == 0.0  # re-bucketing happens before step 3
    sampler.next_batch()
    metrics = sampler.metrics()
    assert [sampler.stats(i)["bucket"] for i in range(4)] == ["mastered", "edge", "unsolvable", "edge"]
    assert {
        k: metrics[f"curriculum/{k}"] for k in ("promotions", "demotions", "classified", "rebuckets")
    } == {
        "promotions": 1.0,
        "demotions": 1.0,
        "classified": 1.0,
        "rebuckets": 1.0,
    }
    assert {k: metrics[f"curriculum/{k}"] for k in ("mastered", "edge", "unsolvable", "unseen")} == {
        "mastered": 1.0,
        "edge": 2.0,
        "unsolvable": 1.0,
        "unseen": 0.0,
    }


def test_rule_mixed_moves_a_flat_edge_prompt_out():
    sampler = OnlineCurriculum(["a", "b"], 1, cfg(rule="mixed", ema=1.0))
    sampler.update("a", [0.6, 0.6, 0.6])  # all alike, nearer easy (0.7) than hard (0.1)
    sampler.update("b", [0.6, 0.0, 0.6])
    sampler.rebucket()
    assert (sampler.stats("a")["bucket"], sampler.stats("b")["bucket"]) == ("mastered", "edge")


def test_seeded_from_build_output_samples():
    samples = [
        Sample("x", [{"role": "user", "content": "q"}], extra_info={"curriculum": prior(0.4, std=0.0)}),
        Sample(
            "y", [{"role": "user", "content": "q"}], extra_info={"extra_info": {"curriculum": prior(0.6)}}
        ),
        Sample("z", [{"role": "user", "content": "q"}]),
    ]
    sampler = OnlineCurriculum.from_samples(samples, 2, cfg(rule="mean"))
    assert [sampler.stats(u)["bucket"] for u in "xyz"] == ["edge", "edge", "unseen"]
    assert sampler.pool_members("edge") == [1, 0]
    assert sampler.stats("y")["std"] == pytest.approx(0.1) and sampler.stats("y")["count"] == 5
    unseeded = OnlineCurriculum.from_samples(samples, 2, cfg(init_from_build=False))
    assert unseeded.metrics()["curriculum/unseen"] == 3.0


# ---------------------------------------------------------------------------- resume
def reward_of(uid: str, visit: int) -> list[float]:
    """A deterministic group of 4 rewards that drifts with visits (prompts get easier)."""
    k = int(uid[1:])
    base = (k % 7) / 7 + 0.08 * visit
    return [min(1.0, base + 0.1 * (j % 2) * (k % 3)) for j in range(4)]


def run(sampler, steps, visits):
    batches = []
    for _ in range(steps):
        batch = sampler.next_batch()
        extra = sampler.draw(2)  # over-sampling inside the step
        for index in batch + extra:
            uid = sampler.uids[index]
            visits[uid] = visits.get(uid, 0) + 1
            sampler.update(uid, reward_of(uid, visits[uid]))
        selection = select_groups(
            [reward_of(sampler.uids[i], visits[sampler.uids[i]]) for i in batch + extra], 4
        )
        sampler.note_selection(selection)
        batches.append((batch, extra))
    return batches


@pytest.mark.parametrize("order", ["easy-to-hard", "spread", "random"])
def test_resume_draws_exactly_what_an_uninterrupted_run_draws(order):
    config = cfg(
        order=order,
        rebucket_every=3,
        ema=0.5,
        rule="mixed",
        weights={"mastered": 0.1, "edge": 0.6, "unsolvable": 0.1, "unseen": 0.2},
    )
    uids = [f"u{i}" for i in range(23)]
    whole = OnlineCurriculum(uids, 4, config, seed=5)
    visits: dict[str, int] = {}
    expected = run(whole, 30, visits)

    first = OnlineCurriculum(uids, 4, config, seed=5)
    resumed_visits: dict[str, int] = {}
    head = run(first, 13, resumed_visits)
    state = json.loads(json.dumps(first.state_dict()))  # survives a text checkpoint exactly
    second = OnlineCurriculum(uids, 4, config, seed=999)  # the saved seed wins
    second.load_state_dict(state)
    tail = run(second, 17, resumed_visits)
    assert head + tail == expected
    assert second.state_dict() == whole.state_dict()
    assert second.metrics() == whole.metrics()
    assert whole.metrics()["curriculum/rebuckets"] == 9.0  # before steps 4, 7, ..., 28


def test_state_of_another_dataset_is_refused():
    state = OnlineCurriculum(["a", "b"], 1).state_dict()
    with pytest.raises(ConfigError, match="different dataset"):
        OnlineCurriculum(["a", "c"], 1).load_state_dict(state)
    with pytest.raises(ConfigError, match="different dataset"):
        OnlineCurriculum(["a", "b", "c"], 1).load_state_dict(state)


def test_constructor_checks():
    with pytest.raises(ConfigError, match="unique uids"):
        OnlineCurriculum(["a", "a"], 1)
    with pytest.raises(ConfigError, match="at least one sample"):
        OnlineCurriculum([], 1)
    with pytest.raises(ConfigError, match="batch_size >= 1"):
        OnlineCurriculum(["a"], 0)


# ---------------------------------------------------------------------------- dynamic filter
def test_keep_groups_marks_groups_with_a_spread():
    assert keep_groups([[1.0, 0.0], [0.5, 0.5, 0.5], [0.2], [], [0.0, 0.0, 1e-9]]) == [
        True,
        False,
        False,
        False,
        True,
    ]


def test_prompts_to_draw_asks_for_the_missing_groups_within_the_cap():
    assert prompts_to_draw([], 4, 2.0) == 4
    spread, flat = [0.0, 1.0], [1.0, 1.0]
    # 2 of 4 informative: 2 missing / (2/4) = 4 more, capped at 8 - 4
    assert prompts_to_draw([spread, flat, spread, flat], 4, 2.0) == 4
    # 3 of 4 informative: 1 missing / 0.75 -> 2 (ceil of 1.33)
    assert prompts_to_draw([spread, spread, flat, spread], 4, 2.0) == 2
    assert prompts_to_draw([flat] * 4, 4, 2.0) == 4  # none informative: the rest of the budget
    assert prompts_to_draw([flat] * 4, 4, 1.5) == 2
    assert prompts_to_draw([flat] * 8, 4, 2.0) == 0  # cap reached
    assert prompts_to_draw([spread] * 4, 4, 2.0) == 0  # enough
    assert prompts_to_draw([flat] * 4, 4, 1.0) == 0  # no over-sampling allowed


def test_select_groups_keeps_the_batch_size():
    spread, flat = [0.0, 1.0], [0.5, 0.5]
    selection = select_groups([flat, spread, spread, flat, spread, spread, spread], 4)
    assert selection.keep == [1, 2, 4, 5]
    assert (selection.zero_variance_dropped, selection.zero_variance_kept) == (2, 0)
    assert (selection.informative_dropped, selection.extra_prompts) == (1, 3)
    short = select_groups([flat, spread, flat, flat, spread, flat], 4)  # only 2 informative
    assert short.keep == [0, 1, 2, 4]  # the earliest flat groups fill the batch
    assert (short.zero_variance_dropped, short.zero_variance_kept, short.extra_prompts) == (2, 2, 2)
    assert select_groups([spread, flat], 4).keep == [0, 1]


def test_counters_from_selections():
    sampler = OnlineCurriculum(["a"], 1)
    sampler.note_selection(select_groups([[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]], 1))
    metrics = sampler.metrics()
    assert (metrics["curriculum/zero_variance_avoided"], metrics["curriculum/extra_prompts"]) == (2.0, 2.0)


# ---------------------------------------------------------------------------- config
def test_config_section_and_its_checks():
    config = load_config(
        None, ["data.sampler=curriculum", "curriculum.weights={edge: 1.0}", "curriculum.ema=0.25"]
    )
    assert config.data.sampler == "curriculum" and config.curriculum.weights == {"edge": 1.0}
    assert config.curriculum.ema == 0.25 and config.curriculum.rule == "mixed"
    for override, message in [
        ("curriculum.hard=0.9", "curriculum.hard"),
        ("curriculum.ema=0", "curriculum.ema"),
        ("curriculum.rebucket_every=0", "curriculum.rebucket_every"),
        ("curriculum.max_oversample=0.5", "curriculum.max_oversample"),
        ("curriculum.weights={easy: 1.0}", "unknown bucket 'easy'"),
        ("curriculum.weights={edge: -1}", "curriculum.weights.edge"),
        ("curriculum.weights={edge: 0}", "weight > 0"),
        ("curriculum.order=shortest", "curriculum.order"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
