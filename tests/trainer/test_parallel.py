"""Several ranks (torchrun, gloo on CPU, FSDP2) give the run of one process: the same prompts
drawn, the same samples, rewards, advantages, loss and gradient norm at every step, the same
weights afterwards; a checkpoint saved on 2 ranks resumes on 1 (and on 2) as an uninterrupted
run continues.

The settings make the ranks' work differ: 3-row micro-batches over a rank's 8 rows (3 + 3 + 2),
two optimizer steps per step (mini-batches of 2 groups, one per rank), a sharded KL reference,
and held-out prompts split over the ranks."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_model_dir, write_run_config

from helpers import ADAM_NOISE, REORDERED, run_grouprl, train_here

pytestmark = pytest.mark.slow

SETTINGS = [
    "data.train_batch_size=4",
    "rollout.n_agent=4",
    "rollout.max_response_length=8",
    "actor.micro_batch_size=3",
    "actor.mini_batch_size=2",
    "actor.dtype=float32",
    "actor.kl_loss_coef=0.1",
    "trainer.total_steps=3",
    "trainer.save_best=false",
]


def train(config, ranks: int, *overrides):
    if ranks == 1:  # the same numbers as a process of its own on one thread (seconds sooner)
        return train_here(config, *SETTINGS, *overrides)
    return run_grouprl(ranks, "train", str(config), *SETTINGS, *overrides)


def records(run_dir):
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [
        (r["step"], r["uid"], r["sample"], r["response"], r["reward"], round(r["advantage"], 6))
        for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())
    ]
    return {m["step"]: m for m in metrics if "actor/grad_norm" in m}, rollouts


def final_weights(run_dir):
    return load_file(str(run_dir / "final" / "model.safetensors"))  # whole, gathered from the ranks


@pytest.fixture
def setup(parallel_setup):  # conftest.py: shared with test_ray_launch.py
    return parallel_setup


def reference_run(config, root):
    """The one-process run of SETTINGS (the default loss mode), made once for every test here."""
    run = root / "runs" / "seq-mean-token-mean-1"
    if not run.is_dir():
        train(config, 1, "actor.loss_agg_mode=seq-mean-token-mean", f"trainer.experiment_name={run.name}")
    return run


@pytest.mark.parametrize("mode,sharding", [("seq-mean-token-mean", "all"), ("token-mean", "replicated")])
def test_two_ranks_equal_one(setup, mode, sharding):
    """`replicated` (actor.fsdp_size=1): each rank holds the whole model, gradients all-reduced
    (the hybrid mesh's replicate dimension); `all`: one copy sharded over both ranks. The two
    modes normalise by global counts of their own (tokens; sequences), the sharding is each's."""
    root, config = setup
    one = root / "runs" / f"{mode}-1"
    if not one.is_dir():
        train(config, 1, f"actor.loss_agg_mode={mode}", f"trainer.experiment_name={one.name}")
    two = root / "runs" / f"{mode}-2-{sharding}"
    size = "actor.fsdp_size=1" if sharding == "replicated" else "actor.fsdp_size=-1"
    # sharded: the reference and AdamW's state go through the host-memory moves between their
    # uses (FSDP2's own re-registration of its shards; on a CPU the host is the device)
    parked = ["actor.reference_offload=true", "actor.optimizer_offload=true"] if sharding == "all" else []
    train(config, 2, f"actor.loss_agg_mode={mode}", size, *parked, f"trainer.experiment_name={two.name}")
    assert_same_run(one, two, root / "model")
    state = [records(run)[0][3]["perf/state_gb"] for run in (one, two)]
    # this rank's weights and optimizer state: half of them when sharded over two ranks
    assert state[1] == pytest.approx(state[0] if sharding == "replicated" else state[0] / 2, rel=0.02)


def test_dynamic_filter_on_two_ranks_equals_one(tmp_path):
    """curriculum.dynamic_filter with refills split over the ranks (7 prompts: 4 + 3) and the
    kept groups shared out again: the same groups kept, samples, rewards and updates as one
    process. A rare reward makes most groups flat, so every step refills."""
    model = tiny_model_dir(tmp_path / "model")
    rare = "float(sum(c.islower() for c in response) / max(len(response), 1) > 0.5)"
    config = write_run_config(tmp_path, model, reward=rare)
    settings = ["data.sampler=curriculum", "curriculum.dynamic_filter=true", "curriculum.max_oversample=2.75"]
    settings.append("trainer.total_steps=2")
    for ranks in (1, 2):
        train(config, ranks, *settings, f"trainer.experiment_name=filter-{ranks}")
    runs = [tmp_path / "runs" / f"filter-{ranks}" for ranks in (1, 2)]
    (one, one_rollouts), (two, two_rollouts) = records(runs[0]), records(runs[1])
    assert two_rollouts == one_rollouts and len(one_rollouts) == 2 * 16
    assert [one[s]["batch/generated_groups"] for s in (1, 2)] == [11.0] * 2  # 4 drawn + 7 refilled
    for step in (1, 2):
        assert two[step]["batch/zero_std_dropped"] == one[step]["batch/zero_std_dropped"] > 0
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert two[step][key] == pytest.approx(one[step][key], **REORDERED), (step, key)


def assert_same_run(one_dir, two_dir, model_dir):
    """The 2-rank run in `two_dir` is the 1-rank run in `one_dir` (both from the model in
    `model_dir`): rollouts, metrics per step, final weights, evaluation, and the export."""
    runs = {1: one_dir, 2: two_dir}
    (one_metrics, one_rollouts), (two_metrics, two_rollouts) = records(runs[1]), records(runs[2])
    assert two_rollouts == one_rollouts  # same prompts, samples, rewards, advantages, in order
    assert len(one_rollouts) == 3 * 16 and len({r[3] for r in one_rollouts}) > 10
    assert sorted(one_metrics) == sorted(two_metrics) == [1, 2, 3]
    for step in (1, 2, 3):
        one, two = one_metrics[step], two_metrics[step]
        assert two["dist/world_size"] == 2 and one["dist/world_size"] == 1
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/clipfrac"):
            if key in one:
                assert two[key] == pytest.approx(one[key], **REORDERED), (step, key)
    w1, w2 = final_weights(runs[1]), final_weights(runs[2])
    assert w1.keys() == w2.keys()
    start = load_file(str(model_dir / "model.safetensors"))
    moved = max(float((w1[n] - start[n]).abs().max()) for n in w1 if n in start)
    assert moved > 1e-3  # training changed the weights, so the comparison below means something
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=ADAM_NOISE)
    # the evaluation (held-out prompts split over the ranks) agrees too
    evals = [
        [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val/accuracy" in line]
        for run in (runs[1], runs[2])
    ]
    assert [e["val/accuracy"] for e in evals[0]] == pytest.approx([e["val/accuracy"] for e in evals[1]])
    # the final export is one whole Hugging Face folder
    assert (runs[2] / "final" / "config.json").is_file()


@pytest.mark.parametrize("resume_ranks", [1])  # on two: test_one_step_off_policy_on_two_ranks_..._resumes
def test_saved_on_two_ranks_resumes_on_one_or_two(setup, resume_ranks, caplog):
    root, config = setup
    reference = reference_run(config, root)
    name = f"resumed-on-{resume_ranks}"
    train(config, 2, f"trainer.experiment_name={name}", "trainer.total_steps=2")
    saved = root / "runs" / name / "checkpoints" / "step_2"
    assert (saved / "manifest.json").is_file()
    # each rank wrote its own shards (DCP); nothing was gathered into one file
    assert sorted(f.name for f in (saved / "sharded").iterdir()) == [
        f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)
    ]
    assert not (saved / "model.safetensors").exists()
    with caplog.at_level("INFO", logger="grouprl"):
        train(config, resume_ranks, f"trainer.experiment_name={name}")
    assert f"resumed from {saved} at step 2" in caplog.text
    _, want = records(reference)
    _, got = records(root / "runs" / name)
    assert got == want
    w_ref, w_got = final_weights(reference), final_weights(root / "runs" / name)
    for n in w_ref:
        torch.testing.assert_close(w_got[n], w_ref[n], rtol=0, atol=ADAM_NOISE)


def test_one_step_off_policy_on_two_ranks_equals_one_and_resumes(setup):
    """rollout.max_staleness=1 (fixed lag): each rank's rollout thread samples from a whole copy
    of the policy loaded with the weights of step s-1 (gathered from the shards when published),
    its collectives (here the curriculum's: every scored group, gathered from the ranks, while
    the update of the step before runs) over a group of its own beside the update's; the
    held-out evaluation gathers the policy's shards on the trainer's. LoRA adapters with
    recomputed activations under FSDP2 (frozen base weights sharded beside trainable ones, the
    reference = the adapters disabled, snapshots of the adapters alone; the export merges the
    gathered adapters into a whole folder; the shards saved are adapters only). The run is the one-process
    asynchronous run; resumed on two ranks from the checkpoint of step 2, whose batch 3 was in
    flight (sampled from version 1's weights, which the checkpoint keeps), it ends as the
    uninterrupted one, also with each rank's engine in a process of its own."""
    import shutil

    root, config = setup
    settings = [
        "rollout.max_staleness=1", "data.sampler=curriculum", "trainer.save_freq=1", "trainer.keep_last=5",
        "model.lora.rank=4", "model.gradient_checkpointing=true", "actor.optim.lr=1e-2",
    ]  # fmt: skip
    runs = {ranks: root / "runs" / f"async-{ranks}" for ranks in (1, 2)}
    for ranks, run in runs.items():
        train(config, ranks, *settings, f"trainer.experiment_name={run.name}")
    assert_same_run(runs[1], runs[2], root / "model")
    steps = records(runs[2])[0]
    assert [steps[s]["rollout/policy_version"] for s in (1, 2, 3)] == [0, 0, 1]
    saved = load_file(str(runs[2] / "checkpoints" / "step_3" / "sharded" / "shard-00001-model-00001-of-00001.safetensors"))
    assert saved and all("lora_" in k for k in saved if k.startswith("model/"))  # adapters only
    state = json.loads((runs[2] / "checkpoints" / "step_2" / "trainer.json").read_text())
    assert sorted(state["ahead_weights"]) == ["1"]  # batch 3's version, in flight at step 2
    assert steps[3]["rollout/mismatch_max"] > 1e-3  # sampled by the weights of step 1, learned at step 3
    # the run killed after its second checkpoint: batch 3 (version 1's weights) was in flight
    resumed = root / "runs" / "async-2-resumed"
    shutil.copytree(runs[2], resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_3")
    shutil.rmtree(resumed / "final")
    (resumed / "checkpoints" / "latest").write_text("step_2\n")
    # resumed with each rank's engine in a process of its own: where generation runs changes no number
    done = train(config, 2, *settings, "rollout.engine_process=true", f"trainer.experiment_name={resumed.name}")
    assert "resumed from" in done.stderr + done.stdout and "holds no weights" not in done.stderr
    want_metrics, want = records(runs[2])
    got_metrics, got = records(resumed)
    assert got == want
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "rollout/mismatch_max"):
        assert got_metrics[3][key] == pytest.approx(want_metrics[3][key], **REORDERED), key
    w_want, w_got = final_weights(runs[2]), final_weights(resumed)
    for n in w_want:
        torch.testing.assert_close(w_got[n], w_want[n], rtol=0, atol=ADAM_NOISE)
