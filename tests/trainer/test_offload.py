"""actor.reference_offload / actor.optimizer_offload: the reference's weights and AdamW's state in
host memory between their uses (trainer/offload.py).

On this CPU the host is the device, so the moves are seen through fakes: tensors on the meta
device stand for an accelerator's (what moves, what stays, that every tensor comes back), and a
recording `move` that copies (so a tensor that is not put back where it belongs is lost) shows
where each lives during a real run's generation, reference pass and update, and that the run's
numbers are the ones without offload."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from tiny import LOWER_FRACTION, tiny_model_dir, write_run_config

from grouprl.config import load_config
from grouprl.trainer import offload
from grouprl.trainer.offload import ParkedModule, ParkedOptimizer, wanted
from grouprl.trainer.trainer import Trainer

META = torch.device("meta")


def empty_move(t: torch.Tensor, device) -> torch.Tensor:
    """A move between the meta device (standing for an accelerator) and the host: the shape and
    dtype arrive (a meta tensor has no values to copy)."""
    return torch.empty(t.shape, dtype=t.dtype, device=device)


def test_the_optimizer_state_on_the_device_moves_out_and_back_and_the_step_counter_stays(monkeypatch):
    monkeypatch.setattr(offload, "move", empty_move)
    p = torch.nn.Parameter(torch.empty(3, 2, device=META))
    optimizer = torch.optim.AdamW([p])
    step = torch.tensor(4.0)  # torch keeps Adam's counter in host memory (not fused or capturable)
    optimizer.state[p] = {"step": step, "exp_avg": torch.empty(3, 2, device=META), "exp_avg_sq": torch.empty(3, 2, device=META)}
    parked = ParkedOptimizer(optimizer, META, enabled=True)

    def where():
        return {k: v.device.type for k, v in optimizer.state[p].items()}

    parked.out()
    assert where() == {"step": "cpu", "exp_avg": "cpu", "exp_avg_sq": "cpu"} and parked.where == "host"
    assert optimizer.state[p]["step"] is step
    assert optimizer.state[p]["exp_avg"].shape == (3, 2)
    parked.out()  # twice: nothing more moves
    with parked.present():
        assert where() == {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}
    assert where() == {"step": "cpu", "exp_avg": "cpu", "exp_avg_sq": "cpu"}
    with pytest.raises(RuntimeError), parked.present():  # an error inside still puts it back out
        raise RuntimeError("step failed")
    assert where()["exp_avg"] == "cpu"
    parked.back()
    assert where() == {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}

    off = ParkedOptimizer(optimizer, META, enabled=False)
    off.out()
    assert where()["exp_avg"] == "meta" and off.where == "device"


def test_a_parked_module_moves_every_parameter_and_buffer(monkeypatch):
    monkeypatch.setattr(offload, "move", empty_move)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3, device=META), torch.nn.BatchNorm1d(3, device=META))
    parked = ParkedModule(module, META, enabled=True)
    tensors = lambda: {t.device.type for t in [*module.parameters(), *module.buffers()]}  # noqa: E731
    parked.out()
    assert tensors() == {"cpu"}
    with parked.present():
        assert tensors() == {"meta"}
    assert tensors() == {"cpu"}
    assert isinstance(module[0].weight, torch.nn.Parameter)  # still registered as parameters

    lora = ParkedModule("adapters-disabled", META, enabled=True)  # LoRA's reference: nothing of its own
    lora.out()
    assert not lora.enabled and lora.where == "device"


def test_auto_offloads_the_reference_on_cuda_only():
    assert wanted("auto", torch.device("cuda", 1)) and not wanted("auto", torch.device("cpu"))
    assert wanted(True, torch.device("cpu")) and not wanted(False, torch.device("cuda"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def run(root, model_dir, *overrides) -> Trainer:
    cfg = write_run_config(root, model_dir, reward=LOWER_FRACTION)
    common = ["actor.kl_loss_coef=0.1", "actor.dtype=float32", "trainer.total_steps=2", "trainer.val_before_train=false"]
    trainer = Trainer(load_config(cfg, [*common, *overrides]))
    return trainer


def test_a_run_generates_without_them_and_learns_as_without_offload(tmp_path, model_dir, monkeypatch):
    from grouprl.rollout.engines.hf import HFEngine
    from grouprl.trainer.update import PolicyUpdater

    plain = run(tmp_path / "plain", model_dir, "actor.reference_offload=false")
    assert not plain.parts.reference_parked.enabled  # auto on a CPU is off too
    plain.fit()

    moved: list[tuple[int, str]] = []

    def copying_move(t, device):  # a fresh copy each time: a tensor not put back is lost
        moved.append((t.numel(), torch.device(device).type))
        return t.detach().clone().requires_grad_(t.requires_grad)

    monkeypatch.setattr(offload, "move", copying_move)
    seen: list[tuple[str, str, str]] = []
    trainer = run(tmp_path / "parked", model_dir, "actor.reference_offload=true", "actor.optimizer_offload=true")
    parts = trainer.parts
    assert parts.reference_parked.where == "host" and moved  # out from the start

    generate, score_all, step = HFEngine.generate, PolicyUpdater.score_all, trainer.optimizer.step

    def watch(what):
        seen.append((what, parts.reference_parked.where, parts.optimizer_parked.where))

    def watched_generate(self, *args, **kwargs):
        watch("generate")
        return generate(self, *args, **kwargs)

    def watched_score_all(self, model, tensors):
        watch("reference" if model is parts.ref_model else "policy")
        return score_all(self, model, tensors)

    @functools.wraps(step)  # as the scheduler's own wrapper (which it checks for)
    def watched_step(*args, **kwargs):
        watch("optimizer step")
        return step(*args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", watched_generate)
    monkeypatch.setattr(PolicyUpdater, "score_all", watched_score_all)
    monkeypatch.setattr(trainer.optimizer, "step", watched_step)
    trainer.fit()

    kinds = {what for what, *_ in seen}
    assert {"generate", "reference", "optimizer step"} <= kinds
    for what, reference, optimizer in seen:
        if what == "generate":  # neither on the device while the policy generates
            assert (reference, optimizer) == ("host", "host"), what
        elif what == "reference":
            assert (reference, optimizer) == ("device", "host"), what
        elif what == "optimizer step":
            assert (reference, optimizer) == ("host", "device"), what
    assert parts.reference_parked.where == "host" and parts.optimizer_parked.where == "host"
    # the reference came in and went out once a step, the optimizer state likewise (and both for
    # the final checkpoint's save): every reference tensor each time
    ref_tensors = len(list(trainer.ref_model.parameters())) + len(list(trainer.ref_model.buffers()))
    assert len(moved) >= (1 + 2 * 2) * ref_tensors

    # the same numbers (one process, the same threads: bitwise)
    metrics = lambda t: [  # noqa: E731
        {k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
        for line in (t.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert metrics(plain) == metrics(trainer) and len(metrics(plain)) >= 2
    for (n, p), (_, q) in zip(plain.model.named_parameters(), trainer.model.named_parameters()):
        assert torch.equal(p, q), n
    for (n, p), (_, q) in zip(plain.ref_model.named_parameters(), trainer.ref_model.named_parameters()):
        assert torch.equal(p, q), n
    state = lambda t: [v for s in t.optimizer.state.values() for v in s.values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(state(plain), state(trainer), strict=True))

    # the checkpoint the run saved resumes with them out of the device again
    resumed = run(tmp_path / "parked", model_dir, "actor.reference_offload=true", "actor.optimizer_offload=true", "trainer.total_steps=3")
    assert resumed.step == 2
    assert resumed.parts.reference_parked.where == "host" and resumed.parts.optimizer_parked.where == "host"
    assert all(torch.equal(a, b) for a, b in zip(state(plain), state(resumed), strict=True))
