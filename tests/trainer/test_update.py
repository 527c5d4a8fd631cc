"""PolicyUpdater against a hand-built loss on the whole mini-batch.

The reference takes per-token log-probs and entropy from the full logits of each row
(helpers.reference_log_probs), then the (already tested) pure algorithm functions:

    loss = policy_loss(lp, old, A, loss_mask; agg) - entropy_coef * agg(entropy)
           + kl_loss_coef * agg(kl(lp, ref))

and its gradient must equal what PolicyUpdater accumulates over micro-batches, whatever
their size. The batch: 2 prompts x 4 samples, responses of 1 to 6 tokens, observation
tokens (loss_mask 0) inside two responses, one truncated row, ratios away from 1 so that
clipping acts. The model is float64 with float64 RMSNorms (helpers.exact_float64_norms), so
gradients match the reference to rtol 1e-8 and micro-batch sizes agree with each other to 1e-10.
"""

import copy
import dataclasses
import math

import pytest
import torch

from grouprl.algorithms import AGG_MODES, aggregate_loss, kl_estimate, policy_loss, rollout_correction
from grouprl.config import ActorConfig, OptimConfig
from grouprl.data.sample import Sample
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.update import PolicyUpdater, build_step_tensors
from helpers import exact_float64_norms, random_prompts, reference_log_probs, tiny_model_and_tokenizer

TEMPERATURE = 0.9
# per prompt: (response length, observation span or None, finish_reason)
RESPONSES = [
    [(3, None, "eos"), (5, (2, 4), "eos"), (1, None, "eos"), (4, None, "length")],
    [(6, (1, 3), "stop"), (2, None, "eos"), (5, None, "eos"), (3, None, "eos")],
]
N_ROWS = sum(len(group) for group in RESPONSES)


def make_trajectories(vocab_size: int, seed: int = 0, opening: int = 0) -> list[Trajectory]:
    """Two groups (RESPONSES); with `opening`, both prompts start with the same that many tokens."""
    start = random_prompts([opening], vocab_size, seed=seed + 7)[0] if opening else []
    prompts = [start + p for p in random_prompts([4, 7], vocab_size, seed=seed)]
    gen = torch.Generator().manual_seed(seed + 1)
    advantages = torch.randn(N_ROWS, generator=gen).tolist()
    trajectories = []
    for g, group in enumerate(RESPONSES):
        sample = Sample(uid=f"prompt-{g}", messages=[{"role": "user", "content": str(g)}])
        for j, (length, observation, finish) in enumerate(group):
            loss_mask = [1] * length
            if observation is not None:
                loss_mask[observation[0] : observation[1]] = [0] * (observation[1] - observation[0])
            trajectories.append(
                Trajectory(
                    sample=sample,
                    index=j,
                    prompt_ids=list(prompts[g]),
                    response_ids=torch.randint(3, vocab_size, (length,), generator=gen).tolist(),
                    loss_mask=loss_mask,
                    finish_reason=finish,
                    extra={"advantage": advantages[len(trajectories)]},  # the test's own column
                )
            )
    return trajectories


def tensors_of(rows: list[Trajectory], device="cpu", **kwargs):
    """build_step_tensors with each row's advantage (make_trajectories keeps it in `extra`)."""
    return build_step_tensors(rows, device, advantages=[t.extra["advantage"] for t in rows], **kwargs)


class GradRecorder:
    """Stands in for the optimizer: records the accumulated gradient at each step, changes nothing."""

    def __init__(self, params):
        self.params = list(params)
        self.steps: list[list[torch.Tensor]] = []

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.steps.append(
            [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        )


class CountingScheduler:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1

    def get_last_lr(self):
        return [0.1]


def actor_config(**overrides) -> ActorConfig:
    fields = dict(
        policy_loss="ppo",
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        loss_agg_mode="token-mean",
        micro_batch_size=N_ROWS,
        mini_batch_size=0,
        entropy_coef=0.0,
        kl_loss_coef=0.0,
        kl_loss_type="k3",
        logits_chunk_size=4,
        optim=OptimConfig(grad_clip=0.0),
    )
    fields.update(overrides)
    return ActorConfig(**fields)


def accumulated_grads(model, tensors, cfg, num_prompts=2, with_old=False, **updater_args):
    """Run PolicyUpdater.update with a recording optimizer: (per-step gradients, metrics), and
    with `with_old` the log-probs the update took as old (None when it was given them)."""
    updater = PolicyUpdater(cfg, temperature=TEMPERATURE, pad_token_id=0, **updater_args)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = GradRecorder(params)
    done = updater.update(model, optimizer, CountingScheduler(), tensors, num_prompts, params)
    model.eval()
    return (optimizer.steps, done.metrics, done.old_log_probs) if with_old else (optimizer.steps, done.metrics)


def hand_built_loss(model, tensors, cfg, rows=None, rollout_is=None, norm_length=None):
    """`rollout_is`: (level, cap) of truncated importance weights, or (level, cap, "mask") of
    masking, against `tensors.rollout_log_probs`, from the old log-probs (the detached current
    ones if none); masking takes what leaves [1 / cap, cap] out of the loss mask itself."""
    rows = list(range(len(tensors.prompt_ids))) if rows is None else rows
    batch = tensors.rows(rows)
    lp, ent = reference_log_probs(
        model, batch.prompt_ids, batch.response_ids, batch.response_mask, TEMPERATURE
    )
    mask = tensors.loss_mask[rows].double()
    old = tensors.old_log_probs[rows].double() if tensors.old_log_probs is not None else lp.detach()
    weights = None
    if rollout_is is not None:
        level, cap, mode = (*rollout_is, "truncate")[:3]
        weights, keep, _ = rollout_correction(
            level, "mask" if mode == "zero-weight" else mode, old, tensors.rollout_log_probs[rows].double(),
            mask, upper=cap,
        )
        if mode == "zero-weight":  # the rejected keep a zero weight but stay in the mask (a wrong masking)
            weights = weights * keep
        else:
            mask = mask * keep
    loss, _ = policy_loss(
        cfg.policy_loss,
        lp,
        old,
        tensors.advantages[rows].double(),
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        agg_mode=cfg.loss_agg_mode,
        token_weights=weights,
        norm_length=norm_length,
    )
    loss = loss - cfg.entropy_coef * aggregate_loss(ent, mask, cfg.loss_agg_mode, norm_length=norm_length)
    if cfg.kl_loss_coef > 0 and tensors.ref_log_probs is not None:
        kl = kl_estimate(lp, tensors.ref_log_probs[rows].double(), cfg.kl_loss_type)
        loss = loss + cfg.kl_loss_coef * aggregate_loss(kl, mask, cfg.loss_agg_mode, norm_length=norm_length)
    return loss


def hand_built_grads(model, tensors, cfg, rows=None, rollout_is=None, norm_length=None):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = hand_built_loss(model, tensors, cfg, rows, rollout_is, norm_length)
    return list(torch.autograd.grad(loss, params))


def assert_grads_close(actual, expected, rtol):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=rtol * float(e.abs().max()))


def max_relative_difference(a_list, b_list) -> float:
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(a_list, b_list))


@pytest.fixture(scope="module")
def model():
    model, _ = tiny_model_and_tokenizer(dtype=torch.float64, seed=5)
    return exact_float64_norms(model)


@pytest.fixture(scope="module")
def tensors(model):
    """Step tensors with old log-probs 0.3-ish away from the current ones (clipping acts) and a
    reference policy further away (the KL term has a gradient)."""
    tensors = tensors_of(make_trajectories(model.config.vocab_size), mask_truncated=True, pad_token_id=0)
    with torch.no_grad():
        lp, _ = reference_log_probs(
            model, tensors.prompt_ids, tensors.response_ids, tensors.response_mask, TEMPERATURE
        )
    gen = torch.Generator().manual_seed(11)
    real = tensors.response_mask.bool()
    old = torch.where(real, lp + 0.3 * torch.randn(lp.shape, generator=gen, dtype=lp.dtype), 0.0).float()
    ref = torch.where(real, lp + 0.5 * torch.randn(lp.shape, generator=gen, dtype=lp.dtype), 0.0).float()
    return dataclasses.replace(tensors, old_log_probs=old, ref_log_probs=ref)


def test_build_step_tensors():
    trajectories = make_trajectories(50)
    trajectories.append(
        Trajectory(
            sample=trajectories[0].sample, index=9, prompt_ids=[3, 4], finish_reason="length", extra={"advantage": 0.5}
        )
    )  # an empty response
    for mask_truncated in (True, False):
        t = tensors_of(trajectories, mask_truncated=mask_truncated, pad_token_id=7)
        assert build_step_tensors(trajectories, "cpu", mask_truncated=mask_truncated, pad_token_id=7).advantages is None
        assert t.response_ids.shape == t.response_mask.shape == t.loss_mask.shape == (N_ROWS + 1, 6)
        assert t.prompt_ids == [tr.prompt_ids for tr in trajectories]
        torch.testing.assert_close(t.advantages, torch.tensor([tr.extra["advantage"] for tr in trajectories]))
        for i, tr in enumerate(trajectories):
            r = len(tr.response_ids)
            assert t.response_ids[i, :r].tolist() == tr.response_ids and (t.response_ids[i, r:] == 7).all()
            assert t.response_mask[i].tolist() == [1] * r + [0] * (6 - r)
            masked = mask_truncated and tr.truncated
            assert t.loss_mask[i].tolist() == ([0.0] * r if masked else tr.loss_mask) + [0.0] * (6 - r)
        assert t.loss_mask[1].tolist() == [1, 1, 0, 0, 1, 0]  # observation tokens stay out
        assert (t.loss_mask[3].sum() == 0) == mask_truncated  # the truncated row


@pytest.mark.parametrize(
    "mode, policy", [(mode, "ppo") for mode in sorted(AGG_MODES)] + [("seq-mean-token-mean", "gspo")]
)
def test_micro_batches_accumulate_to_the_mini_batch_gradient(model, tensors, mode, policy):
    cfg = actor_config(loss_agg_mode=mode, policy_loss=policy, entropy_coef=0.05, kl_loss_coef=0.2)
    expected = hand_built_grads(model, tensors, cfg)
    results = {}
    for micro in (1, 3, N_ROWS):
        steps, metrics = accumulated_grads(
            model, tensors, actor_config(**{**cfg.__dict__, "micro_batch_size": micro})
        )
        assert len(steps) == 1 and metrics["actor/skipped_steps"] == 0
        assert_grads_close(steps[0], expected, 1e-8)
        results[micro] = (steps[0], metrics)
    for micro in (1, 3):
        assert max_relative_difference(results[micro][0], results[N_ROWS][0]) < 1e-10
    # the mini-batch's metrics do not depend on how it was cut into micro-batches
    assert results[1][1].keys() == results[N_ROWS][1].keys()
    for key, value in results[N_ROWS][1].items():
        if key != "actor/grad_norm":
            for micro in (1, 3):
                assert results[micro][1][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, micro)
    assert results[1][1]["actor/grad_norm"] == pytest.approx(results[N_ROWS][1]["actor/grad_norm"], rel=1e-10)
    # and they are the mini-batch's: the loss value matches the hand-built one
    with torch.no_grad():
        assert results[N_ROWS][1]["actor/loss"] == pytest.approx(
            float(hand_built_loss(model, tensors, cfg)), rel=1e-9, abs=1e-12
        )


def test_clipping_is_active_so_the_comparison_means_something(model, tensors):
    _, metrics = accumulated_grads(model, tensors, actor_config())
    assert 0.1 < metrics["actor/clipfrac"] < 0.9


def test_each_mini_batch_steps_on_its_own_groups(model, tensors):
    cfg = actor_config(mini_batch_size=1, micro_batch_size=3, loss_agg_mode="seq-mean-token-mean")
    steps, _ = accumulated_grads(model, tensors, cfg)
    assert len(steps) == 2
    assert_grads_close(steps[0], hand_built_grads(model, tensors, cfg, rows=[0, 1, 2, 3]), 1e-8)
    assert_grads_close(steps[1], hand_built_grads(model, tensors, cfg, rows=[4, 5, 6, 7]), 1e-8)
    steps2, _ = accumulated_grads(model, tensors, actor_config(**{**cfg.__dict__, "ppo_epochs": 2}))
    assert len(steps2) == 4  # the recorder leaves the weights alone: epoch 2 repeats epoch 1
    assert max_relative_difference(steps2[2], steps[0]) < 1e-12


@pytest.mark.parametrize(
    "ppo_epochs, mini_batch_size, num_prompts, needed",
    [
        (1, 0, 4, False),  # one step on the whole batch: the current policy is the old one
        (1, 4, 4, False),
        (1, 8, 4, False),
        (1, 2, 4, True),  # the second mini-batch comes after an optimizer step
        (1, 2, 3, True),  # 2 + 1 prompts: two steps as well
        (1, 3, 4, True),
        (2, 0, 4, True),  # epoch 2 comes after a step
    ],
)
def test_needs_old_log_probs(ppo_epochs, mini_batch_size, num_prompts, needed):
    updater = PolicyUpdater(
        actor_config(ppo_epochs=ppo_epochs, mini_batch_size=mini_batch_size), temperature=1.0, pad_token_id=0
    )
    assert updater.needs_old_log_probs(num_prompts) is needed


def test_detached_current_log_probs_equal_explicit_old_log_probs(model, tensors):
    """ppo_epochs=1, one mini-batch: the update without old log-probs (current ones, detached)
    is the update with old log-probs scored beforehand."""
    cfg = actor_config(micro_batch_size=3, entropy_coef=0.05, kl_loss_coef=0.2)
    updater = PolicyUpdater(cfg, temperature=TEMPERATURE, pad_token_id=0)
    assert not updater.needs_old_log_probs(2)
    weights = {}
    for explicit in (False, True):
        policy = copy.deepcopy(model)
        step = dataclasses.replace(tensors, old_log_probs=updater.score_all(policy, tensors) if explicit else None)
        params = list(policy.parameters())
        optimizer = torch.optim.SGD(params, lr=0.5)
        updater.update(policy, optimizer, CountingScheduler(), step, 2, params)
        weights[explicit] = [p.detach().clone() for p in params]
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(weights[True], model.parameters()))
    assert moved > 1e-3
    for a, b in zip(weights[False], weights[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_nan_advantage_skips_the_step(model, tensors):
    policy = copy.deepcopy(model)
    params = list(policy.parameters())
    before = [p.detach().clone() for p in params]
    step = dataclasses.replace(tensors, advantages=tensors.advantages.clone())
    step.advantages[1] = float("nan")
    scheduler = CountingScheduler()
    optimizer = torch.optim.SGD(params, lr=0.5)
    updater = PolicyUpdater(actor_config(micro_batch_size=3), temperature=TEMPERATURE, pad_token_id=0)
    metrics = updater.update(policy, optimizer, scheduler, step, 2, params).metrics
    assert metrics["actor/skipped_steps"] == 1
    assert scheduler.steps == 0
    assert all(p.grad is None for p in params)  # nothing left over for the next step
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    assert all(math.isfinite(v) for k, v in metrics.items() if k not in ("actor/pg_loss", "actor/loss"))
    # the same batch with a finite advantage does step
    metrics = updater.update(policy, optimizer, scheduler, tensors, 2, params).metrics
    assert metrics["actor/skipped_steps"] == 0 and scheduler.steps == 1
    assert any(not torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_nan_advantage_of_a_row_without_loss_tokens_does_not_skip_the_step(model, tensors):
    assert tensors.loss_mask[3].sum() == 0  # the masked truncated row
    step = dataclasses.replace(tensors, advantages=tensors.advantages.clone())
    step.advantages[3] = float("nan")
    steps, metrics = accumulated_grads(model, step, actor_config())
    assert metrics["actor/skipped_steps"] == 0
    assert_grads_close(steps[0], accumulated_grads(model, tensors, actor_config())[0][0], 1e-12)


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_masked_positions_contribute_nothing(model, tensors, mode):
    """Old and reference log-probs under loss_mask == 0 (observations, the masked truncated row)
    may be anything: the gradient does not change."""
    cfg = actor_config(loss_agg_mode=mode, entropy_coef=0.05, kl_loss_coef=0.2)
    steps, _ = accumulated_grads(model, tensors, cfg)
    outside = tensors.loss_mask == 0
    garbage = dataclasses.replace(
        tensors,
        old_log_probs=tensors.old_log_probs.masked_fill(outside, 30.0),
        ref_log_probs=tensors.ref_log_probs.masked_fill(outside, -30.0),
    )
    garbage_steps, _ = accumulated_grads(model, garbage, cfg)
    assert max_relative_difference(garbage_steps[0], steps[0]) < 1e-12
    # the loss mask is what matters: let the observation tokens in and the gradient moves
    unmasked = dataclasses.replace(tensors, loss_mask=tensors.response_mask.float())
    unmasked_steps, _ = accumulated_grads(model, unmasked, cfg)
    assert max_relative_difference(unmasked_steps[0], steps[0]) > 1e-3


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_masked_truncated_row_is_as_if_absent(model, mode):
    trajectories = make_trajectories(model.config.vocab_size)
    truncated = [i for i, t in enumerate(trajectories) if t.truncated]
    assert truncated == [3]  # not the longest row: removing it keeps the padded width
    cfg = actor_config(loss_agg_mode=mode, entropy_coef=0.05)
    grads = {}
    for name, rows, mask_truncated in (
        ("masked", trajectories, True),
        ("absent", [t for t in trajectories if not t.truncated], True),
        ("kept", trajectories, False),
    ):
        tensors = tensors_of(rows, mask_truncated=mask_truncated, pad_token_id=0)
        grads[name] = accumulated_grads(model, tensors, cfg)[0]
        assert len(grads[name]) == 1
    assert max_relative_difference(grads["masked"][0], grads["absent"][0]) < 1e-10
    assert max_relative_difference(grads["kept"][0], grads["absent"][0]) > 1e-3


def test_entropy_and_kl_terms_change_the_gradient_as_built_by_hand(model, tensors):
    params = [p for p in model.parameters() if p.requires_grad]
    base = actor_config(loss_agg_mode="seq-mean-token-mean")
    plain = accumulated_grads(model, tensors, base)[0][0]
    mask = tensors.loss_mask.double()
    lp, ent = reference_log_probs(
        model, tensors.prompt_ids, tensors.response_ids, tensors.response_mask, TEMPERATURE
    )
    entropy_grad = torch.autograd.grad(
        aggregate_loss(ent, mask, base.loss_agg_mode), params, retain_graph=True
    )
    for kl_type in ("k3", "k1", "k2"):
        kl = kl_estimate(lp, tensors.ref_log_probs.double(), kl_type)
        kl_grad = torch.autograd.grad(aggregate_loss(kl, mask, base.loss_agg_mode), params, retain_graph=True)
        cfg = actor_config(**{**base.__dict__, "kl_loss_coef": 0.4, "kl_loss_type": kl_type})
        with_kl = accumulated_grads(model, tensors, cfg)[0][0]
        assert_grads_close([a - b for a, b in zip(with_kl, plain)], [0.4 * g for g in kl_grad], 1e-8)
    with_entropy = accumulated_grads(model, tensors, actor_config(**{**base.__dict__, "entropy_coef": 0.3}))[
        0
    ][0]
    # a bonus: the loss goes down as the entropy goes up
    assert_grads_close([a - b for a, b in zip(with_entropy, plain)], [-0.3 * g for g in entropy_grad], 1e-8)
    # no reference log-probs: no KL term, whatever the coefficient
    no_ref = dataclasses.replace(tensors, ref_log_probs=None)
    steps, metrics = accumulated_grads(model, no_ref, actor_config(**{**base.__dict__, "kl_loss_coef": 0.4}))
    assert max_relative_difference(steps[0], plain) < 1e-12 and "actor/kl_loss" not in metrics


@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize("micro_batch_tokens", [1, 12, 30, 10_000])
def test_token_budget_micro_batches_accumulate_to_the_mini_batch_gradient(
    model, tensors, shared_prefix, micro_batch_tokens
):
    """Budgets from one row per micro-batch (groups split, prompt reused) to the whole batch at once."""
    cfg = actor_config(
        loss_agg_mode="seq-mean-token-mean",
        entropy_coef=0.05,
        kl_loss_coef=0.2,
        micro_batch_tokens=micro_batch_tokens,
        shared_prefix=shared_prefix,
    )
    expected = hand_built_grads(model, tensors, cfg)
    steps, metrics = accumulated_grads(model, tensors, cfg)
    assert len(steps) == 1
    assert_grads_close(steps[0], expected, 1e-8)
    with torch.no_grad():
        assert metrics["actor/loss"] == pytest.approx(float(hand_built_loss(model, tensors, cfg)), rel=1e-9)


def test_a_split_group_runs_its_prompt_once(model, tensors):
    """micro_batch_size 3 cuts each group of 4 into 3 + 1 rows; the prompt still runs once per
    group in the update's forward (and once in scoring), never once per micro-batch."""
    fed = []
    hook = model.get_decoder().embed_tokens.register_forward_pre_hook(
        lambda m, args: fed.append(args[0].tolist())
    )
    try:
        updater = PolicyUpdater(actor_config(micro_batch_size=3), temperature=TEMPERATURE, pad_token_id=0)
        updater.score_all(model, tensors)
        scored = list(fed)
        fed.clear()
        accumulated_grads(model, tensors, actor_config(micro_batch_size=3))
    finally:
        hook.remove()
    prompts = sorted({tuple(p) for p in tensors.prompt_ids})
    for calls in (scored, fed):
        prefix_calls = sorted(tuple(ids[0]) for ids in calls if len(ids) == 1 and tuple(ids[0]) in prompts)
        assert prefix_calls == prompts  # each prompt exactly once
        # each micro-batch's responses (3 rows or 1) run packed in one row, with no padding
        responses = [ids for ids in calls if not (len(ids) == 1 and tuple(ids[0]) in prompts)]
        assert [len(ids) for ids in responses] == [1, 1, 1, 1]
        assert sum(len(ids[0]) for ids in responses) == int(tensors.response_mask.sum())


def test_bf16_autocast_keeps_float32_weights_and_gradients_close_to_float32():
    """Mixed precision: forward in bf16 (the LM head's logits upcast), gradients land on the
    float32 master weights, and the numbers stay within bf16's precision of the float32 ones."""
    model, _ = tiny_model_and_tokenizer(dtype=torch.float32, seed=5)
    tensors = tensors_of(make_trajectories(model.config.vocab_size), mask_truncated=True, pad_token_id=0)
    cfg = actor_config(loss_agg_mode="seq-mean-token-mean")
    results = {}
    for compute_dtype in (None, torch.bfloat16):
        updater = PolicyUpdater(cfg, temperature=TEMPERATURE, pad_token_id=0, compute_dtype=compute_dtype)
        with torch.no_grad():
            lp = updater.score_all(model, tensors)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = GradRecorder(params)
        updater.update(model, optimizer, CountingScheduler(), tensors, 2, params)
        results[compute_dtype] = (lp, optimizer.steps[0])
    lp32, g32 = results[None]
    lp16, g16 = results[torch.bfloat16]
    assert lp16.dtype == torch.float32 and all(g.dtype == torch.float32 for g in g16)
    real = tensors.response_mask.bool()
    difference = (lp16 - lp32)[real].abs().max()
    assert 0 < difference < 0.05  # bf16 really ran, and within its ~3 significant digits
    cosine = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in g16]), torch.cat([g.flatten() for g in g32]), dim=0)
    assert cosine > 0.99


@pytest.mark.parametrize("trim", [True, False])
def test_free_heap_pages_are_released_before_each_backward_and_inside_it_when_asked(model, tensors, monkeypatch, trim):
    import grouprl.cpu as cpu_module
    import grouprl.cpu.allocator as allocator_module

    events = []
    monkeypatch.setattr(cpu_module, "release_free_memory", lambda: events.append("trim") or True)
    monkeypatch.setattr(allocator_module, "release_free_memory", lambda: events.append("layer") or True)
    monkeypatch.setattr(allocator_module, "_glibc", lambda: object())  # as on glibc, also elsewhere
    real_backward = torch.Tensor.backward
    monkeypatch.setattr(
        torch.Tensor, "backward", lambda self, *a, **k: events.append("backward") or real_backward(self, *a, **k)
    )
    cfg = actor_config(micro_batch_size=3, update_malloc_trim=trim, update_trim_every_layers=1)
    steps, _ = accumulated_grads(model, tensors, cfg)
    # two groups of four rows in micro-batches of at most three: 3 + 1 rows per group, each
    # micro-batch's backward through the 2 layers, then the group's prompt's backward
    layers = ["layer", "layer"]
    per_group = ["trim", "backward", *layers, "trim", "backward", *layers, *layers]
    assert events == (per_group * 2 if trim else ["backward"] * 4)
    assert max_relative_difference(steps[0], hand_built_grads(model, tensors, cfg)) < 1e-8


@pytest.mark.parametrize("micro_batch_size", [N_ROWS, 3])
def test_prompts_sharing_an_opening_run_it_once_with_the_same_gradient(model, micro_batch_size, monkeypatch):
    """Both groups' prompts start with the same 20 tokens: the update runs them once (also when
    micro-batches split the groups) and the gradient is the full-sequence one; the no-grad
    scoring pass too gives the full-sequence log-probs."""
    import grouprl.trainer.update as update_module

    tensors = tensors_of(make_trajectories(model.config.vocab_size, opening=20), mask_truncated=True, pad_token_id=0)
    openings = []
    real_prefix_forward = update_module.prefix_forward
    monkeypatch.setattr(
        update_module,
        "prefix_forward",
        lambda model, prompts, pad, opening=None, *rest: openings.append(prompts if opening is None else "rest")
        or real_prefix_forward(model, prompts, pad, opening, *rest),
    )
    cfg = actor_config(micro_batch_size=micro_batch_size, policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")
    steps, _ = accumulated_grads(model, tensors, cfg)
    assert openings[0] == [tensors.prompt_ids[0][:20]]  # the opening, once per mini-batch
    # split groups run their prompts' rest once on it (whole groups do so inside the log-probs)
    assert openings[1:] == (["rest", "rest"] if micro_batch_size == 3 else [])
    assert max_relative_difference(steps[0], hand_built_grads(model, tensors, cfg)) < 1e-8

    openings.clear()
    updater = PolicyUpdater(cfg, temperature=TEMPERATURE, pad_token_id=0)
    scored = updater.score_all(model, tensors)
    assert openings[0] == [tensors.prompt_ids[0][:20]]
    with torch.no_grad():
        lp, _ = reference_log_probs(model, tensors.prompt_ids, tensors.response_ids, tensors.response_mask, TEMPERATURE)
    torch.testing.assert_close(scored, lp.to(scored.dtype), rtol=0, atol=1e-10)

    off, _ = accumulated_grads(model, tensors, actor_config(**{**cfg.__dict__, "shared_opening": False}))
    assert max_relative_difference(off[0], steps[0]) < 1e-8


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("on_policy", [True, False])
def test_rollout_importance_weights_scale_the_loss(model, tensors, level, on_policy):
    """An engine's samples (rollout log-probs 0.2-ish away from the trainer's): each token's
    loss is weighted by min(exp(old - rollout), cap), computed per micro-batch from the old
    log-probs (on-policy: the update's own detached ones), whatever the micro-batch size. On
    policy, the update hands back the log-probs it used as old (for the mismatch metrics), and
    writes nothing into the tensors it was given."""
    with torch.no_grad():
        lp, _ = reference_log_probs(model, tensors.prompt_ids, tensors.response_ids, tensors.response_mask, TEMPERATURE)
    gen = torch.Generator().manual_seed(13)
    rollout = torch.where(
        tensors.response_mask.bool(), lp + 0.2 * torch.randn(lp.shape, generator=gen, dtype=lp.dtype), 0.0
    ).float()
    step = dataclasses.replace(
        tensors, rollout_log_probs=rollout, old_log_probs=None if on_policy else tensors.old_log_probs
    )
    cfg = actor_config(loss_agg_mode="seq-mean-token-mean", entropy_coef=0.05)
    cap = {"token": 1.1, "sequence": 1.1, "geometric": 1.02}[level]
    weights, _, metrics = rollout_correction(
        level, "truncate", lp if on_policy else step.old_log_probs.double(), step.rollout_log_probs.double(),
        step.loss_mask, upper=cap,
    )
    assert 0.1 < metrics["capped_frac"] < 0.9  # some weights capped, some not: both branches act
    expected = hand_built_grads(model, step, cfg, rollout_is=(level, cap))
    plain = hand_built_grads(model, step, cfg)
    assert max_relative_difference(expected, plain) > 1e-2  # the weights matter
    for micro in (1, 3, N_ROWS):
        run = step  # frozen: the update cannot write it
        steps, _, old = accumulated_grads(
            model, run, actor_config(**{**cfg.__dict__, "micro_batch_size": micro}),
            with_old=True, rollout_is=level, rollout_is_cap=cap,
        )
        assert_grads_close(steps[0], expected, 1e-6)  # float32 rollout/old log-probs inside
        assert run.old_log_probs is step.old_log_probs  # given or None: the tensors are not written
        if on_policy:
            real = step.response_mask.bool()
            torch.testing.assert_close(old[real].double(), lp[real], rtol=0, atol=1e-6)
        else:
            assert old is None


@pytest.mark.parametrize("level, cap", [("token", 1.15), ("sequence", 1.5), ("geometric", 1.06)])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_importance_masking_takes_samples_out_of_the_loss_and_its_denominator(model, tensors, level, cap, mode):
    """Mask mode: tokens (token level) or whole sequences whose ratio pi_old / pi_rollout leaves
    [1 / cap, cap] leave the loss mask before the update, so the mini-batch's token count (or
    sequence count) no longer counts them; the rest are weighted by their ratio. The gradient
    equals the hand-built loss over the kept mask, whatever the micro-batch size; a zero weight
    that leaves them counted in the denominator gives another gradient."""
    gen = torch.Generator().manual_seed(17)  # old log-probs given (mask mode needs them before the update)
    real = tensors.response_mask.bool()
    step = dataclasses.replace(tensors, rollout_log_probs=torch.where(
        real, tensors.old_log_probs + 0.2 * torch.randn(tensors.old_log_probs.shape, generator=gen), 0.0
    ))  # fmt: skip
    cfg = actor_config(loss_agg_mode=mode, entropy_coef=0.05)
    _, keep, metrics = rollout_correction(
        level, "mask", step.old_log_probs.double(), step.rollout_log_probs.double(), step.loss_mask, upper=cap
    )
    assert 0.1 < metrics["masked_frac"] < 0.9  # some samples leave, some stay: both branches act
    if level != "token":
        assert ((keep * step.loss_mask).sum(-1) == 0).any()  # a whole sequence left: fewer rows
    expected = hand_built_grads(model, step, cfg, rollout_is=(level, cap, "mask"))
    zero_weight_only = hand_built_grads(model, step, cfg, rollout_is=(level, cap, "zero-weight"))
    assert max_relative_difference(expected, zero_weight_only) > 1e-2
    for micro in (1, 3, N_ROWS):
        updater = PolicyUpdater(
            actor_config(**{**cfg.__dict__, "micro_batch_size": micro}), temperature=TEMPERATURE, pad_token_id=0,
            rollout_is=level, rollout_is_mode="mask", rollout_is_cap=cap,
        )
        assert updater.needs_old_log_probs(2, step)  # masking decides before the update
        loss_mask, policy_mask = updater.reject(step, step.old_log_probs)
        run = dataclasses.replace(step, loss_mask=loss_mask, policy_mask=policy_mask)
        assert torch.equal(run.policy_mask, step.loss_mask)  # the mask as sampled, for the metrics
        torch.testing.assert_close(run.loss_mask, step.loss_mask * keep.float())
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = GradRecorder(params)
        updater.update(model, optimizer, CountingScheduler(), run, 2, params)
        model.eval()
        assert_grads_close(optimizer.steps[0], expected, 1e-6)


def test_importance_masking_needs_the_rejection_before_the_update(model, tensors):
    step = dataclasses.replace(tensors, rollout_log_probs=tensors.old_log_probs.clone())
    updater = PolicyUpdater(actor_config(), temperature=TEMPERATURE, pad_token_id=0, rollout_is="token",
                            rollout_is_mode="mask", rollout_is_cap=1.5)
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match="reject"):
        updater.update(model, GradRecorder(params), CountingScheduler(), step, 2, params)
    model.eval()


def test_sum_norm_divides_by_the_configured_length_whatever_the_batch_width(model, tensors):
    """seq-mean-token-sum-norm with a constant: the gradient is the token sum / the constant,
    and padding the batch wider (a longer response elsewhere) does not change it."""
    cfg = actor_config(loss_agg_mode="seq-mean-token-sum-norm", entropy_coef=0.05)
    expected = hand_built_grads(model, tensors, cfg, norm_length=40.0)
    by_width = hand_built_grads(model, tensors, cfg)  # / the padded width 6
    assert max_relative_difference(expected, by_width) > 1e-2
    for micro in (1, N_ROWS):
        steps, _ = accumulated_grads(
            model, tensors, actor_config(**{**cfg.__dict__, "micro_batch_size": micro}), norm_length=40.0
        )
        assert_grads_close(steps[0], expected, 1e-8)
    pad = lambda t: torch.nn.functional.pad(t, (0, 4))  # noqa: E731
    wide = dataclasses.replace(
        tensors,
        response_ids=pad(tensors.response_ids), response_mask=pad(tensors.response_mask), loss_mask=pad(tensors.loss_mask),
        old_log_probs=pad(tensors.old_log_probs), ref_log_probs=pad(tensors.ref_log_probs),
    )  # fmt: skip
    steps, _ = accumulated_grads(model, wide, cfg, norm_length=40.0)
    assert_grads_close(steps[0], expected, 1e-8)
