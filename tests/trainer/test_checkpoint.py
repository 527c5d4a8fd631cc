"""Checkpoints: a resumed run repeats the uninterrupted one exactly; pruning, the `latest`
marker, atomic writes, and the resume modes."""

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tiny import LOWER_FRACTION, tiny_model_dir, write_run_config

import grouprl.trainer.checkpoint as checkpoint_module
from grouprl.config import load_config
from grouprl.errors import UserError
from grouprl.trainer.checkpoint import CheckpointManager
from grouprl.trainer.trainer import Trainer

# Everything that a resumed run must restore matters here: a warm-up over the first two
# optimizer steps (scheduler state; a fresh scheduler would warm up again), two mini-batches
# per step (optimizer state, old log-probs), and a KL reference refreshed every step (the
# reference's weights). The schedule after warm-up is constant, so a run of 2 steps extended
# to 4 follows the same lrs as a run of 4.
RESUME_SETTINGS = [
    "trainer.total_steps=4",
    "trainer.save_freq=2",
    "actor.mini_batch_size=1",
    "actor.optim.warmup_steps=3",
    "actor.kl_loss_coef=0.5",
    "algorithm.ref_refresh_steps=1",
    "trainer.save_best=false",
    "trainer.save_final=false",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def config(root, model_dir, *overrides):
    return load_config(write_run_config(root, model_dir, reward=LOWER_FRACTION), list(overrides))


def rollout_records(run_dir):
    """What each step sampled and generated, in file order."""
    return [
        (r["step"], r["uid"], r["sample"], r["response"], round(r["advantage"], 5))
        for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())
    ]


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("a")
    trainer = Trainer(config(root, model_dir, *RESUME_SETTINGS, "trainer.experiment_name=a"))
    trainer.fit()
    return trainer, root / "runs" / "a"


@pytest.mark.parametrize("how", ["stopped_at_2", "interrupted_in_step_3", "interrupted_in_eval_after_2"])
def test_resumed_run_repeats_the_uninterrupted_one(tmp_path, model_dir, uninterrupted, monkeypatch, how):
    trainer_a, run_a = uninterrupted
    settings = [*RESUME_SETTINGS, "trainer.experiment_name=b"]
    if how == "stopped_at_2":  # a run of 2 steps (it saves at its end), then the same run asked for 4
        first = Trainer(config(tmp_path, model_dir, *settings, "trainer.total_steps=2"))
        first.fit()
    elif how == "interrupted_in_step_3":
        first = Trainer(config(tmp_path, model_dir, *settings))
        real_rollout = first.collector.rollout

        def rollout_then_ctrl_c(*args, **kwargs):
            if first.step == 2 and not kwargs.get("evaluation"):
                raise KeyboardInterrupt  # Ctrl-C while step 3 generates
            return real_rollout(*args, **kwargs)

        monkeypatch.setattr(first.collector, "rollout", rollout_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            first.fit()
    else:  # Ctrl-C during the evaluation that follows step 2 (greedy: it draws no random numbers)
        first = Trainer(config(tmp_path, model_dir, *settings, "trainer.test_freq=2", "trainer.save_freq=0"))
        real_evaluate = first.evaluate

        def evaluate_then_ctrl_c(**kwargs):
            if first.step == 2:
                raise KeyboardInterrupt
            return real_evaluate(**kwargs)

        monkeypatch.setattr(first, "evaluate", evaluate_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            first.fit()
    run_b = tmp_path / "runs" / "b"
    assert CheckpointManager(run_b, 2).latest() == run_b / "checkpoints" / "step_2"

    second = Trainer(config(tmp_path, model_dir, *settings))  # resume_mode=auto by default
    assert second.step == 2
    second.fit()
    assert second.step == 4

    records_a, records_b = rollout_records(run_a), rollout_records(run_b)
    assert [r[0] for r in records_b] == [1] * 8 + [2] * 8 + [3] * 8 + [4] * 8
    assert records_b == records_a  # same prompts, same responses, same advantages, every step
    final_a, final_b = weights(trainer_a.parts.learn.model), weights(second.parts.learn.model)
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.allclose(final_a[name], final_b[name], atol=1e-6, rtol=0), name
    ref_a, ref_b = dict(trainer_a.parts.learn.reference.model.named_parameters()), dict(second.parts.learn.reference.model.named_parameters())
    assert all(torch.allclose(ref_a[n], ref_b[n], atol=1e-6, rtol=0) for n in ref_a)
    assert second.parts.learn.optimizer.param_groups[0]["lr"] == pytest.approx(trainer_a.parts.learn.optimizer.param_groups[0]["lr"])


def test_ctrl_c_during_an_update_saves_nothing(tmp_path, model_dir, monkeypatch, capsys):
    trainer = Trainer(config(tmp_path, model_dir, "trainer.total_steps=3", "trainer.val_before_train=false"))
    real_update = trainer.parts.learn.updater.update

    def update_then_ctrl_c(*args, **kwargs):
        if trainer.step == 1:
            raise KeyboardInterrupt
        return real_update(*args, **kwargs)

    monkeypatch.setattr(trainer.parts.learn.updater, "update", update_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert "interrupted during an update: resume from the last saved checkpoint" in capsys.readouterr().out
    assert CheckpointManager(tmp_path / "runs" / "run", 2).latest() is None


def test_ctrl_c_before_the_first_step_saves_nothing(tmp_path, model_dir, monkeypatch, capsys):
    trainer = Trainer(config(tmp_path, model_dir))

    def ctrl_c(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "evaluate", ctrl_c)  # during the baseline evaluation
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert "interrupted before a step finished: nothing new to save" in capsys.readouterr().out
    assert not (tmp_path / "runs" / "run" / "checkpoints").exists()


def test_the_resumed_step_changes_the_weights(uninterrupted, tmp_path, model_dir):
    """Guard against a vacuous match: the checkpointed weights differ from the start and the end."""
    trainer_a, run_a = uninterrupted
    start = weights(Trainer(config(tmp_path, model_dir, "trainer.resume_mode=disable")).parts.learn.model)
    step_2 = load_file(str(run_a / "checkpoints" / "step_2" / "model.safetensors"))
    end = weights(trainer_a.parts.learn.model)
    assert step_2.keys() == end.keys()
    assert any(not torch.equal(step_2[n], start[n]) for n in end)
    assert any(not torch.equal(step_2[n], end[n]) for n in end)


# ------------------------------------------------------------------------- layout on disk
def test_keep_last_and_latest(uninterrupted):
    _, run_a = uninterrupted
    root = run_a / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_4"]
    assert (root / "latest").read_text() == "step_4\n"
    for step in ("step_2", "step_4"):
        assert sorted(p.name for p in (root / step).iterdir()) == [
            "manifest.json",
            "model.safetensors",
            "optim.pt",
            "ref_model.safetensors",
            "trainer.json",
            "trainer.safetensors",
        ]


def test_keep_last_prunes_older_checkpoints(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        manager.save(step, model, optimizer, scheduler, {"step": step})
    assert sorted(p.name for p in manager.complete()) == ["step_4", "step_5"]
    assert manager.latest() == tmp_path / "checkpoints" / "step_5"


def test_latest_ignores_incomplete_folders(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(3, model, optimizer, scheduler, {"step": 3})
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_9-x1y2").mkdir()  # a write that died before its rename
    (root / ".tmp-step_9-x1y2" / "manifest.json").write_text("{}")
    (root / "step_7").mkdir()  # a folder without its manifest (written last)
    (root / "step_7" / "model.safetensors").write_bytes(b"")
    assert manager.latest() == root / "step_3"
    (root / "latest").write_text("step_7\n")  # a marker naming an incomplete folder
    assert manager.latest() == root / "step_3"
    (root / "latest").unlink()  # no marker: the newest complete folder
    manager.save(5, model, optimizer, scheduler, {"step": 5})
    (root / "latest").unlink()
    assert manager.latest() == root / "step_5"
    assert CheckpointManager(tmp_path / "nothing", 2).latest() is None


def test_a_save_that_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, model, optimizer, scheduler, {"step": 1})

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint_module.torch, "save", disk_full)
    with pytest.raises(OSError):
        manager.save(2, model, optimizer, scheduler, {"step": 2})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]
    assert manager.latest() == root / "step_1"


def test_checkpoint_round_trip_restores_weights_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    path = CheckpointManager(tmp_path, 2).save(1, model, optimizer, scheduler, {"step": 1, "note": "x"})

    other = torch.nn.Linear(3, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    other_sched = torch.optim.lr_scheduler.LambdaLR(other_opt, lambda s: 1.0 / (s + 1))
    state = CheckpointManager.load(path, other, other_opt, other_sched)
    assert state == {"step": 1, "note": "x"}
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], exp_avg)
    assert other_sched.last_epoch == 1 and other_opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_loading_into_a_different_model_is_a_user_error(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    path = CheckpointManager(tmp_path, 2).save(1, model, optimizer, scheduler, {"step": 1})
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match="checkpoint does not match the model: 2 unknown tensors"):
        CheckpointManager.load(path, other, torch.optim.AdamW(other.parameters()), scheduler)


# ------------------------------------------------------------------------- resume modes
def test_resume_modes(uninterrupted, tmp_path, model_dir):
    _, run_a = uninterrupted
    same_run = [f"trainer.output_dir={run_a.parent}", "trainer.experiment_name=a", *RESUME_SETTINGS]

    auto = Trainer(config(tmp_path, model_dir, *same_run))
    assert auto.step == 4

    fresh = Trainer(config(tmp_path, model_dir, *same_run, "trainer.resume_mode=disable"))
    assert fresh.step == 0
    ckpt_4 = load_file(str(run_a / "checkpoints" / "step_4" / "model.safetensors"))
    assert any(not torch.equal(p.detach(), ckpt_4[n]) for n, p in fresh.parts.learn.model.named_parameters())

    step_2 = run_a / "checkpoints" / "step_2"
    chosen = Trainer(
        config(
            tmp_path, model_dir, *same_run, "trainer.resume_mode=path", f"trainer.resume_from_path={step_2}"
        )
    )
    assert chosen.step == 2
    ckpt_2 = load_file(str(step_2 / "model.safetensors"))
    assert all(torch.equal(p.detach(), ckpt_2[n]) for n, p in chosen.parts.learn.model.named_parameters())
    assert chosen.parts.collect.sampler.state_dict()["position"] == (2 * 2) % 8

    with pytest.raises(UserError, match="not a valid checkpoint: .* \\(no manifest.json"):
        Trainer(
            config(
                tmp_path,
                model_dir,
                *same_run,
                "trainer.resume_mode=path",
                f"trainer.resume_from_path={tmp_path}",
            )
        )


# ------------------------------------------------------------------------- verification, safe loading
def small_checkpoints(tmp_path, steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    manager = CheckpointManager(tmp_path, keep_last=len(steps))
    for step in steps:
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        manager.save(step, model, optimizer, scheduler, {"step": step})
    return manager, model, optimizer, scheduler


def truncate(path, keep=10):
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return len(data)


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog):
    manager, model, optimizer, scheduler = small_checkpoints(tmp_path, [1, 2, 3])
    root = tmp_path / "checkpoints"
    size = truncate(root / "step_3" / "model.safetensors")
    with caplog.at_level("WARNING"):
        assert manager.latest() == root / "step_2"
    assert f"step_3: model.safetensors has 10 bytes, {size} expected" in caplog.text
    # same size, other bytes: the checksum catches it
    data = bytearray((root / "step_2" / "optim.pt").read_bytes())
    data[-30] ^= 0xFF
    (root / "step_2" / "optim.pt").write_bytes(bytes(data))
    assert manager.latest() == root / "step_1"
    assert "step_2: optim.pt does not match its checksum" in caplog.text
    (root / "step_1" / "trainer.json").unlink()
    with pytest.raises(UserError, match=r"no valid checkpoint in .*step_3: .*step_2: .*step_1: trainer.json is missing"):
        manager.latest()
    with pytest.raises(UserError, match=r"not a valid checkpoint: .*step_1 \(trainer.json is missing\)"):
        CheckpointManager.load(root / "step_1", model, optimizer, scheduler)


def test_the_trainer_resumes_from_the_newest_intact_checkpoint(uninterrupted, tmp_path, model_dir, caplog):
    """kill -9 damaged the newest checkpoint (a file cut short): the next start warns and resumes
    from the one before, which repeats the uninterrupted run from there."""
    trainer_a, run_a = uninterrupted
    copy = tmp_path / "runs" / "a"
    shutil.copytree(run_a, copy)
    truncate(copy / "checkpoints" / "step_4" / "optim.pt", keep=100)
    same_run = [f"trainer.output_dir={copy.parent}", "trainer.experiment_name=a", *RESUME_SETTINGS]
    with caplog.at_level("WARNING"):
        resumed = Trainer(config(tmp_path, model_dir, *same_run))
    assert resumed.step == 2
    assert "skipped invalid checkpoints (step_4: optim.pt has 100 bytes" in caplog.text
    resumed.fit()
    final_a, final_b = weights(trainer_a.parts.learn.model), weights(resumed.parts.learn.model)
    for name in final_a:
        assert torch.allclose(final_a[name], final_b[name], atol=1e-6, rtol=0), name


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_loading_runs_no_code_from_the_checkpoint(tmp_path, monkeypatch):
    manager, model, optimizer, scheduler = small_checkpoints(tmp_path, [1])
    folder = tmp_path / "checkpoints" / "step_1"
    state = torch.load(folder / "optim.pt", weights_only=True)
    state["scheduler"]["hook"] = _Payload()  # someone else's checkpoint, manifest rewritten to match
    torch.save(state, folder / "optim.pt")
    checkpoint_module.write_manifest(folder)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="optim.pt holds objects other than tensors and plain data"):
        CheckpointManager.load(folder, model, optimizer, scheduler)
    assert not (tmp_path / "pwned").exists()


def test_trainer_state_round_trips_exactly(tmp_path):
    import random

    import numpy as np

    random.seed(3)
    np.random.seed(4)
    state = {
        "step": 7,
        "rng": checkpoint_module.rng_state(),
        "generator": torch.Generator().manual_seed(5).get_state(),
        "history": [{"step": 0, "val/accuracy": float("nan")}],
        "best_metric": -float("inf"),
        "sampler": {"order": [3, 1, 2], "seed": 1},
    }
    tensors = {}
    encoded = json.loads(json.dumps(checkpoint_module.encode_state(state, tensors)))
    back = checkpoint_module.decode_state(encoded, tensors)
    assert back["rng"]["python"] == state["rng"]["python"]
    numpy_state = back["rng"]["numpy"]
    assert numpy_state[0] == "MT19937" and numpy_state[1].dtype == np.uint32
    assert np.array_equal(numpy_state[1], state["rng"]["numpy"][1]) and numpy_state[2:] == state["rng"]["numpy"][2:]
    assert torch.equal(back["generator"], state["generator"]) and torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert math.isnan(back["history"][0]["val/accuracy"]) and back["best_metric"] == -math.inf
    assert back["sampler"] == state["sampler"]
    checkpoint_module.set_rng_state(back["rng"])
    expected = (random.random(), float(np.random.rand()))
    random.seed(3)
    np.random.seed(4)
    assert (random.random(), float(np.random.rand())) == expected


class FakeCuda:
    """torch.cuda as far as the RNG state goes: `visible` devices, this process on `current`."""

    def __init__(self, visible: int, current: int):
        self.visible, self.current = visible, current
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(visible)}

    def install(self, monkeypatch):
        for name, value in {
            "is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: self.visible,
            "current_device": lambda: self.current, "get_rng_state": self.get, "set_rng_state": self.set,
            "get_rng_state_all": lambda: [self.states[i] for i in range(self.visible)],
        }.items():  # fmt: skip
            monkeypatch.setattr(torch.cuda, name, value)

    def get(self, device):
        return self.states[device].clone()

    def set(self, state, device):
        assert 0 <= device < self.visible, f"cuda:{device} is not visible"
        self.states[device] = state.clone()


def test_a_checkpoint_keeps_its_own_devices_rng_and_resumes_where_fewer_are_visible(monkeypatch):
    """A rank saves its own CUDA device's generator (rank 3 of a node: cuda:3) and a resume
    restores it to the device it runs on, also with fewer GPUs visible; a checkpoint of every
    visible device's state (as earlier versions saved) restores its own or the first."""
    eight = FakeCuda(visible=8, current=3)
    eight.install(monkeypatch)
    eight.states[3] = torch.tensor([33], dtype=torch.uint8)
    saved = checkpoint_module.rng_state()
    assert torch.equal(saved["cuda"], torch.tensor([33], dtype=torch.uint8))
    one = FakeCuda(visible=1, current=0)
    one.install(monkeypatch)
    checkpoint_module.set_rng_state(saved)
    assert torch.equal(one.states[0], torch.tensor([33], dtype=torch.uint8))
    every = {**saved, "cuda": [torch.tensor([i + 10], dtype=torch.uint8) for i in range(8)]}
    checkpoint_module.set_rng_state(every)  # one device visible of the eight saved
    assert torch.equal(one.states[0], torch.tensor([10], dtype=torch.uint8))
    two = FakeCuda(visible=2, current=1)
    two.install(monkeypatch)
    checkpoint_module.set_rng_state(every)
    assert torch.equal(two.states[1], torch.tensor([11], dtype=torch.uint8)) and torch.equal(two.states[0], torch.tensor([0], dtype=torch.uint8))


def test_sharded_format_reads_back_in_one_process_and_names_a_mismatch(tmp_path):
    """The DCP layout (sharded/, one safetensors file per rank with its offsets in the header)
    read by one process; the two-rank write and reads are in test_parallel.py."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    checkpoint_module._save_shards(tmp_path / "sharded", model, None, {"state": {}})
    (stored,) = (tmp_path / "sharded").iterdir()
    assert stored.name.endswith(".safetensors")  # no pickled metadata: nothing in it can run
    assert set(load_file(str(stored))) == {"model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias"}
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    checkpoint_module._load_shards(tmp_path / "sharded", other, None, {"state": {}})
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    wider = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match=r"checkpoint does not match the model: 2 tensors not in .*, e.g. model/2.bias"):
        checkpoint_module._load_shards(tmp_path / "sharded", wider, None, {"state": {}})
