"""actor.reference_offload / actor.optimizer_offload: the reference's weights and AdamW's state in
host memory between their uses (trainer/offload.py).

A tensor parks by its storage: its bytes go to a host buffer made once, its storage shrinks to
nothing, and coming back it is the same tensor object with the same bytes. On this CPU the host
is the device and nothing moves; the tests let it move (`offload.parks`), so a real run's
generation, reference pass and update see where each lives, and the run's numbers are the ones
without offload."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from tiny import LOWER_FRACTION, tiny_model_dir, write_run_config

from grouprl.config import load_config
from grouprl.trainer import offload
from grouprl.trainer.offload import ParkedModule, ParkedOptimizer, parks_beside, wanted
from grouprl.trainer.trainer import Trainer

CPU = torch.device("cpu")


@pytest.fixture
def moving(monkeypatch):
    """Parking moves on this CPU as it would on an accelerator."""
    monkeypatch.setattr(offload, "parks", lambda device: True)


def held(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_the_optimizer_state_parks_and_comes_back_and_the_step_counter_stays(moving):
    p = torch.nn.Parameter(torch.zeros(3, 2))
    optimizer = torch.optim.AdamW([p])
    step = torch.tensor(4.0, device="meta")  # stands for torch's counter, kept where it is (another device)
    exp_avg, exp_avg_sq = torch.randn(3, 2), torch.rand(3, 2)
    want = exp_avg.clone(), exp_avg_sq.clone()
    optimizer.state[p] = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    parked = ParkedOptimizer(optimizer, CPU, enabled=True)

    parked.out()
    assert parked.where == "host" and held(exp_avg) == held(exp_avg_sq) == 0  # their storage given back
    assert optimizer.state[p]["step"] is step and optimizer.state[p]["exp_avg"] is exp_avg
    buffers = dict(parked._host)
    parked.out()  # twice: nothing more moves
    with parked.present():
        assert torch.equal(exp_avg, want[0]) and torch.equal(exp_avg_sq, want[1])  # the same tensors, the same bytes
        exp_avg.add_(1.0)  # the update changes them in place
    assert held(exp_avg) == 0
    with pytest.raises(RuntimeError), parked.present():  # an error inside still puts it back out
        raise RuntimeError("step failed")
    assert held(exp_avg) == 0
    parked.back()
    assert torch.equal(exp_avg, want[0] + 1.0)
    assert all(parked._host[k] is b for k, b in buffers.items()) and len(buffers) == 2  # made once

    off = ParkedOptimizer(optimizer, CPU, enabled=False)
    off.out()
    assert held(exp_avg) > 0 and off.where == "device"


def test_a_parked_module_parks_every_parameter_and_buffer_once(moving):
    module = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    module[1].weight = module[0].weight  # tied: one storage under two names
    module[2].running_mean.normal_()
    want = {n: t.clone() for n, t in module.state_dict().items()}
    parked = ParkedModule(module, CPU, enabled=True)
    parked.out()
    assert all(held(t) == 0 for t in [*module.parameters(), *module.buffers()])
    assert len(parked._host) == len(list(module.parameters())) + len(list(module.buffers()))  # the tie once
    with parked.present():
        got = module.state_dict()
        assert all(torch.equal(got[n], w) for n, w in want.items())
    assert isinstance(module[0].weight, torch.nn.Parameter) and module[1].weight is module[0].weight

    lora = ParkedModule("adapters-disabled", CPU, enabled=True)  # LoRA's reference: nothing of its own
    lora.out()
    assert not lora.enabled and lora.where == "device"


def test_on_a_cpu_nothing_moves_and_fsdps_own_offload_leaves_nothing_to_park():
    t = torch.ones(4)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    optimizer.state[optimizer.param_groups[0]["params"][0]] = {"exp_avg": t}
    parked = ParkedOptimizer(optimizer, CPU, enabled=True)
    parked.out()
    assert held(t) == 16 and parked.where == "device"
    assert not parks_beside(True, True, torch.device("cuda", 0))  # the shards and state in host memory already
    assert parks_beside(True, False, torch.device("cuda", 0)) and parks_beside(False, True, torch.device("cuda", 0))


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
    assert not plain.parts.learn.reference.parked.enabled  # auto on a CPU is off too
    plain.fit()

    monkeypatch.setattr(offload, "parks", lambda device: True)
    seen: list[tuple[str, str, str]] = []
    trainer = run(tmp_path / "parked", model_dir, "actor.reference_offload=true", "actor.optimizer_offload=true")
    parts = trainer.parts.learn
    ref_tensors = [*trainer.parts.learn.reference.model.parameters(), *trainer.parts.learn.reference.model.buffers()]
    assert parts.reference.parked.where == "host" and all(held(t) == 0 for t in ref_tensors)  # out from the start

    generate, score_all, step = HFEngine.generate, PolicyUpdater.score_all, trainer.parts.learn.optimizer.step

    def watch(what):
        seen.append((what, parts.reference.parked.where, parts.optimizer_parked.where))

    def watched_generate(self, *args, **kwargs):
        watch("generate")
        return generate(self, *args, **kwargs)

    def watched_score_all(self, model, tensors):
        watch("reference" if model is parts.reference.model else "policy")
        return score_all(self, model, tensors)

    @functools.wraps(step)  # as the scheduler's own wrapper (which it checks for)
    def watched_step(*args, **kwargs):
        watch("optimizer step")
        return step(*args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", watched_generate)
    monkeypatch.setattr(PolicyUpdater, "score_all", watched_score_all)
    monkeypatch.setattr(trainer.parts.learn.optimizer, "step", watched_step)
    host_buffers = dict(parts.reference.parked._host)
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
    assert parts.reference.parked.where == "host" and parts.optimizer_parked.where == "host"
    # the reference's host buffers made once, at the start, and reused every step
    assert host_buffers and all(parts.reference.parked._host[k] is b for k, b in host_buffers.items())
    state_tensors = [v for s in trainer.parts.learn.optimizer.state.values() for v in s.values() if v.dim()]
    assert state_tensors and all(held(v) == 0 for v in state_tensors)  # AdamW's state parked after the run

    # the same numbers (one process, the same threads: bitwise)
    metrics = lambda t: [  # noqa: E731
        {k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
        for line in (t.parts.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert metrics(plain) == metrics(trainer) and len(metrics(plain)) >= 2
    for (n, p), (_, q) in zip(plain.parts.learn.model.named_parameters(), trainer.parts.learn.model.named_parameters()):
        assert torch.equal(p, q), n
    with parts.reference.parked.present():
        for (n, p), (_, q) in zip(plain.parts.learn.reference.model.named_parameters(), trainer.parts.learn.reference.model.named_parameters()):
            assert torch.equal(p, q), n
    state = lambda t: [v for s in t.parts.learn.optimizer.state.values() for v in s.values()]  # noqa: E731
    with parts.optimizer_parked.present():
        assert all(torch.equal(a, b) for a, b in zip(state(plain), state(trainer), strict=True))

    # the checkpoint the run saved resumes with them out of the device again
    resumed = run(tmp_path / "parked", model_dir, "actor.reference_offload=true", "actor.optimizer_offload=true", "trainer.total_steps=3")
    assert resumed.step == 2
    assert resumed.parts.learn.reference.parked.where == "host" and resumed.parts.learn.optimizer_parked.where == "host"
    with resumed.parts.learn.optimizer_parked.present():
        assert all(torch.equal(a, b) for a, b in zip(state(plain), state(resumed), strict=True))
