"""The training loop end to end on a tiny random model: the files it writes, the numbers in
them, a reward that must really improve, LoRA, and the KL reference."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from tiny import A_FRACTION, LOWER_FRACTION, tiny_model_dir, write_run_config

from grouprl.config import load_config
from grouprl.errors import ConfigError
from grouprl.trainer.trainer import Trainer

STEP_KEYS = [
    "reward/mean",
    "reward/a",
    "actor/pg_loss",
    "actor/clipfrac",
    "actor/grad_norm",
    "actor/lr",
    "batch/zero_std_groups",
    "time/generate",
    "time/reward",
    "time/update",
    "perf/tokens_per_s",
    "response/length_mean",
    "response/truncated_frac",
    "adv/mean",
]
ROLLOUT_FIELDS = [
    "run",
    "step",
    "uid",
    "sample",
    "prompt",
    "response",
    "turns",
    "rewards",
    "reward",
    "advantage",
    "response_tokens",
    "truncated",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def make_trainer(tmp_path, model_dir, *overrides, reward=LOWER_FRACTION) -> Trainer:
    """A Trainer on the tiny model; the default reward has spread inside groups, so every step updates."""
    return Trainer(load_config(write_run_config(tmp_path, model_dir, reward=reward), list(overrides)))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def frozen(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


# ------------------------------------------------------------------------- one short run
@pytest.fixture(scope="module")
def short_run(tmp_path_factory, model_dir):
    """3 steps, 2 prompts x 4 samples, evaluation before and after, final export."""
    root = tmp_path_factory.mktemp("short")
    trainer = make_trainer(root, model_dir)
    summary = trainer.fit()
    return trainer, summary, root / "runs" / "run"


def test_metrics_jsonl_has_the_documented_keys(short_run):
    trainer, _, run_dir = short_run
    lines = read_jsonl(run_dir / "metrics.jsonl")
    steps = [m for m in lines if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        missing = [k for k in STEP_KEYS if k not in m]
        assert missing == []
        assert all(isinstance(m[k], float) and math.isfinite(m[k]) for k in STEP_KEYS)
        assert m["actor/lr"] == pytest.approx(1e-2)  # constant schedule, no warm-up
        assert m["time/generate"] > 0 and m["time/update"] > 0 and m["perf/tokens_per_s"] > 0
        assert 0 <= m["actor/clipfrac"] <= 1 and 0 <= m["batch/zero_std_groups"] <= 1
    evals = [m for m in lines if "val/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 3]  # baseline and final
    assert trainer.step == 3


def test_rollouts_jsonl_matches_the_metrics(short_run):
    _, _, run_dir = short_run
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    metrics = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in m}
    assert len(rollouts) == 3 * 2 * 4
    questions = {
        json.loads(line)["id"]: json.loads(line)["question"]
        for line in (run_dir.parent.parent / "train.jsonl").open()
    }
    for r in rollouts:
        assert [k for k in ROLLOUT_FIELDS if k not in r] == []
        assert r["run"] == "run"
        assert r["prompt"] == questions[r["uid"]]
        # the reward written is the reward function of the response written
        response = r["response"]
        assert r["rewards"]["a"] == pytest.approx(sum(c.islower() for c in response) / max(len(response), 1))
        assert r["reward"] == pytest.approx(r["rewards"]["a"])
        assert 1 <= r["response_tokens"] <= 6
        assert r["truncated"] == (r["finish_reason"] == "length")
        if r["truncated"]:
            assert r["response_tokens"] == 6
    for step, m in metrics.items():
        rows = [r for r in rollouts if r["step"] == step]
        assert len(rows) == 8
        assert m["reward/mean"] == pytest.approx(sum(r["reward"] for r in rows) / 8)
        assert m["response/length_mean"] == pytest.approx(sum(r["response_tokens"] for r in rows) / 8)
        assert m["response/truncated_frac"] == pytest.approx(sum(r["truncated"] for r in rows) / 8)


def test_grpo_advantages_in_rollouts(short_run):
    _, _, run_dir = short_run
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    groups: dict = {}
    for r in rollouts:
        groups.setdefault((r["step"], r["uid"]), []).append(r)
    assert len(groups) == 3 * 2
    assert (
        sum(len({r["reward"] for r in rows}) > 1 for rows in groups.values()) >= 3
    )  # most groups have spread
    for rows in groups.values():
        assert sorted(r["sample"] for r in rows) == [0, 1, 2, 3]
        rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # unbiased std, as verl
        got = torch.tensor([r["advantage"] for r in rows], dtype=torch.float64)
        assert torch.allclose(got, expected, atol=1e-5)
        assert abs(float(got.sum())) < 1e-5


def test_final_model_loads_and_summary_line(short_run, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, summary, run_dir = short_run
    assert re.fullmatch(
        r"eval accuracy: baseline \d\.\d\d -> final \d\.\d\d \([+-]\d\.\d\d\) after 3 steps", summary["line"]
    )
    assert summary["baseline"] == trainer.history[0]["val/accuracy"]
    assert json.loads((run_dir / "summary.json").read_text())["line"] == summary["line"]
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    AutoTokenizer.from_pretrained(run_dir / "final")
    ours = trainer.parts.learn.model.state_dict()
    for name, value in final.state_dict().items():
        assert torch.equal(value, ours[name]), name
    assert json.loads((run_dir / "final" / "grouprl_meta.json").read_text())["step"] == 3
    assert load_config(run_dir / "config.yaml") == trainer.cfg


def test_weights_change_and_stay_finite(tmp_path, model_dir):
    trainer = make_trainer(tmp_path, model_dir)
    before = trainable(trainer.parts.learn.model)
    metrics, trajectories, _ = trainer.train_step()
    after = trainable(trainer.parts.learn.model)
    assert len(trajectories) == 8
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert metrics["actor/skipped_steps"] == 0.0


def test_summary_without_a_baseline(tmp_path, model_dir):
    """Also: trainer.save_last=false writes no checkpoint at the end (the periodic ones stay)."""
    trainer = make_trainer(
        tmp_path,
        model_dir,
        "trainer.val_before_train=false",
        "trainer.total_steps=3",
        "trainer.save_freq=2",
        "trainer.save_last=false",
        "trainer.save_final=false",
    )
    summary = trainer.fit()
    checkpoints = Path(summary["run_dir"]) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_2"]
    assert [h["step"] for h in trainer.history] == [3]
    assert summary["baseline"] is None
    assert re.fullmatch(
        r"eval accuracy: final \d\.\d\d after 3 steps \(no baseline evaluation\)", summary["line"]
    )


def test_schedule_counts_every_optimizer_step(tmp_path, model_dir):
    """2 steps x 2 epochs x 2 mini-batches = 8 optimizer steps: the cosine reaches its floor at the end."""
    trainer = make_trainer(
        tmp_path,
        model_dir,
        "trainer.total_steps=2",
        "actor.ppo_epochs=2",
        "actor.mini_batch_size=1",
        "actor.optim.scheduler=cosine",
        "actor.optim.min_lr_ratio=0.1",
    )
    metrics, _, _ = trainer.train_step()
    assert trainer.parts.learn.scheduler.last_epoch == 4
    assert trainer.parts.learn.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5))  # halfway
    trainer.train_step()
    assert trainer.parts.learn.scheduler.last_epoch == 8
    assert trainer.parts.learn.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.1)


def test_logged_lr_is_the_lr_the_update_used(tmp_path, model_dir):
    trainer = make_trainer(tmp_path, model_dir, "actor.optim.warmup_steps=4", "trainer.total_steps=8")
    metrics, _, _ = trainer.train_step()
    assert metrics["actor/lr"] == pytest.approx(1e-2 * 1 / 4)  # the first step runs at 1/warmup of the peak


# ------------------------------------------------------------------------- it learns
def test_a_tiny_model_learns_to_say_a(tmp_path, model_dir):
    """Reward = fraction of 'a' characters. A random 97-token model starts near 1%; with a high
    lr it must climb far above that within 16 steps (seeds 0-3 reach 0.8-0.97 in the last five)."""
    trainer = make_trainer(
        tmp_path,
        model_dir,
        "rollout.n_agent=8",
        "rollout.max_response_length=8",
        "actor.optim.lr=2e-2",
        "actor.policy_loss=gspo",
        "trainer.total_steps=16",
        "trainer.save_final=false",
        "trainer.save_best=false",
        "trainer.seed=0",
        reward=A_FRACTION,
    )
    summary = trainer.fit()
    rewards = [
        m["reward/mean"]
        for m in read_jsonl(tmp_path / "runs" / "run" / "metrics.jsonl")
        if "reward/mean" in m
    ]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.15
    assert last - first > 0.3, rewards
    assert summary["final"] > summary["baseline"] + 0.3  # greedy evaluation improved too


# ------------------------------------------------------------------------- LoRA
def test_lora_trains_adapters_only_and_exports_merged(tmp_path, model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(
        tmp_path,
        model_dir,
        "model.lora.rank=4",
        "actor.kl_loss_coef=0.1",
        "trainer.total_steps=2",
        "trainer.val_before_train=false",
    )
    assert trainer.parts.learn.reference.kind == "adapters" and trainer.parts.learn.reference.model is None  # no second copy of the model
    names = [n for n, p in trainer.parts.learn.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert len(trainer.parts.learn.params) == len(names)
    base_before = frozen(trainer.parts.learn.model)

    m1, _, _ = trainer.train_step()
    assert m1["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # LoRA B starts at 0: policy == reference
    m2, _, _ = trainer.train_step()
    assert m2["actor/kl_loss"] > 1e-6  # the adapters moved the policy away from the base
    base_after = frozen(trainer.parts.learn.model)
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    assert any(
        float(p.detach().abs().max()) > 0 for n, p in trainer.parts.learn.model.named_parameters() if "lora_B" in n
    )

    trainer.fit()  # already at total_steps: evaluates, checkpoints, exports
    run_dir = tmp_path / "runs" / "run"
    saved = load_file(str(run_dir / "checkpoints" / "step_2" / "model.safetensors"))
    assert sorted(saved) == sorted(names)
    assert not (run_dir / "checkpoints" / "step_2" / "ref_model.safetensors").exists()

    final_dir = run_dir / "final"
    assert not (final_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(final_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not all(torch.equal(v, base.state_dict()[k]) for k, v in merged.state_dict().items())
    ids = torch.tensor([[5, 9, 14, 20, 33, 41]])
    with torch.no_grad():
        want = trainer.parts.learn.model(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)  # merged == base + adapters
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-4)


def test_lora_with_ref_refresh_is_rejected_before_loading():
    with pytest.raises(ConfigError, match="ref_refresh_steps' needs full fine-tuning"):
        load_config(None, ["model.lora.rank=4", "actor.kl_loss_coef=0.1", "algorithm.ref_refresh_steps=2"])


# ------------------------------------------------------------------------- KL reference
def test_kl_loss_uses_a_frozen_copy(tmp_path, model_dir):
    trainer = make_trainer(tmp_path, model_dir, "actor.kl_loss_coef=0.1")
    ref = trainer.parts.learn.reference.model
    assert isinstance(ref, torch.nn.Module) and ref is not trainer.parts.learn.model
    assert not any(p.requires_grad for p in ref.parameters())
    policy_ptrs = {p.data_ptr() for p in trainer.parts.learn.model.parameters()}
    assert not any(p.data_ptr() in policy_ptrs for p in ref.parameters())  # a copy, not shared storage
    ref_before = {n: p.clone() for n, p in ref.named_parameters()}

    m1, _, _ = trainer.train_step()
    assert m1["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    m2, _, _ = trainer.train_step()
    assert m2["actor/kl_loss"] > 1e-6
    assert all(torch.equal(ref_before[n], p) for n, p in ref.named_parameters())
    assert any(not torch.equal(ref_before[n], p) for n, p in trainer.parts.learn.model.named_parameters())


def test_no_kl_no_reference(tmp_path, model_dir):
    assert not make_trainer(tmp_path, model_dir).parts.learn.reference.active


def test_kl_in_reward_is_logged_and_shapes_advantages(tmp_path, model_dir):
    trainer = make_trainer(tmp_path, model_dir, "algorithm.kl_coef=0.5", "algorithm.kl_penalty=k1")
    m1, t1, _ = trainer.train_step()
    assert m1["reward/kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    m2, t2, advantages = trainer.train_step()
    assert m2["reward/kl_penalty"] != pytest.approx(0.0, abs=1e-6)
    # advantages come from reward - kl_coef * KL, so they are not the plain GRPO ones
    rewards = torch.tensor([t.reward for t in t2]).view(-1, 4)
    plain = ((rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)).flatten()
    got = torch.tensor(advantages)
    assert not torch.allclose(got, plain, atol=1e-4)
    assert abs(float(got.view(-1, 4).sum(-1).abs().max())) < 1e-4


def test_ref_refresh_copies_the_policy(tmp_path, model_dir):
    trainer = make_trainer(tmp_path, model_dir, "actor.kl_loss_coef=0.1", "algorithm.ref_refresh_steps=2")

    def same() -> bool:  # the reference holds the policy's weights (its linear ones in bf16 under bf16 autocast)
        ref = dict(trainer.parts.learn.reference.model.named_parameters())
        return all(torch.equal(p.to(ref[n].dtype), ref[n]) for n, p in trainer.parts.learn.model.named_parameters())

    assert same()
    trainer.train_step()
    assert not same()
    trainer.train_step()
    assert same()
    m3, _, _ = trainer.train_step()
    assert m3["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # refreshed reference == policy


def test_the_engine_hears_of_every_weight_change(tmp_path, model_dir, monkeypatch):
    """After each update (before the next rollout) and after loading a checkpoint, the engine is
    told the policy's weights changed, with the weights as they then are."""
    from grouprl.rollout.engines.hf import HFEngine

    seen = []
    monkeypatch.setattr(
        HFEngine, "weights_updated", lambda self, model: seen.append(trainable(model)["model.norm.weight"])
    )
    trainer = make_trainer(tmp_path, model_dir, "trainer.total_steps=2", "trainer.val_before_train=false")
    assert seen == []  # a fresh start loads nothing
    before = trainable(trainer.parts.learn.model)["model.norm.weight"]
    trainer.fit()
    assert len(seen) == 2 and not torch.equal(seen[0], before)
    torch.testing.assert_close(seen[-1], trainable(trainer.parts.learn.model)["model.norm.weight"], rtol=0, atol=0)

    resumed = make_trainer(tmp_path, model_dir, "trainer.total_steps=3", "trainer.val_before_train=false")
    assert len(seen) == 3 and resumed.step == 2
    torch.testing.assert_close(seen[-1], seen[1], rtol=0, atol=0)


@pytest.mark.parametrize(
    "key, groups",
    [
        ("kind", {"val/accuracy/k1": 0.5, "val/accuracy/k2": 1.0}),
        ("data_source", {"val/accuracy/s_1": 0.5, "val/accuracy/s2": 2 / 3}),  # "s/1": no nested name
        ("kinds", {}),  # no held-out sample has it: a warning, no groups
    ],
)
def test_held_out_accuracy_is_also_logged_per_group(tmp_path, model_dir, key, groups, caplog):
    """trainer.val_breakdown: the reward here is the ground truth itself, so each group's mean is
    known by hand (kind k1: 1 and 0 -> 0.5; k2: 1 and 1 -> 1.0; a row without the key counts only
    in the whole); data_source groups the same way."""
    rows = [("k1", "1", "s/1"), ("k1", "0", "s2"), ("k2", "1", "s2"), ("k2", "1", "s2"), (None, "0", "s/1")]
    val = tmp_path / "val_verl.jsonl"
    val.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": gt},
        "data_source": source, "extra_info": {"kind": kind} if kind else {},
    }) + "\n" for i, (kind, gt, source) in enumerate(rows)))
    config = write_run_config(tmp_path, model_dir, reward="float(ground_truth)")
    trainer = Trainer(load_config(config, [f"data.val_files=[{val}]", f"trainer.val_breakdown={key}"]))
    out = trainer.evaluate()
    assert out["val/accuracy"] == pytest.approx(3 / 5)
    assert {k: v for k, v in out.items() if k.startswith("val/accuracy/")} == pytest.approx(groups)
    assert ("no held-out sample has it" in caplog.text) == (not groups)


def test_a_breakdown_key_with_too_many_values_is_refused_with_a_warning(tmp_path, model_dir, caplog):
    config = write_run_config(tmp_path, model_dir)
    trainer = Trainer(load_config(config, ["trainer.val_breakdown=kind"]))
    for i, sample in enumerate(trainer.parts.evaluate.samples):
        sample.extra_info["kind"] = f"k{i}"
    import grouprl.trainer.setup as run_setup

    run_setup.MAX_BREAKDOWN_GROUPS, saved = 3, run_setup.MAX_BREAKDOWN_GROUPS
    try:
        key = run_setup.breakdown_key("kind", trainer.parts.evaluate.samples)
        trainer.evaluator.p = dataclasses.replace(trainer.evaluator.p, breakdown=key)  # what evaluation is given
    finally:
        run_setup.MAX_BREAKDOWN_GROUPS = saved
    assert "has 4 values in the held-out data" in caplog.text
    assert not [k for k in trainer.evaluate() if k.startswith("val/accuracy/")]


@pytest.mark.parametrize("loss", ["cispo", "sapo", "gmpo"])
def test_the_other_losses_update_the_policy(tmp_path, model_dir, loss):
    """CISPO, SAPO and GMPO (tests/algorithms: against verl's formulas) through a whole step."""
    clip = ["actor.clip_low=0.4", "actor.clip_high=0.4"] if loss == "gmpo" else ["actor.clip_low=0.2", "actor.clip_high=0.28"]
    trainer = make_trainer(tmp_path, model_dir, f"actor.policy_loss={loss}", *clip)
    before = trainable(trainer.parts.learn.model)
    metrics, _, _ = trainer.train_step()
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(before[n], p) for n, p in trainable(trainer.parts.learn.model).items())
