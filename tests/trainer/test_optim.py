"""AdamW and the learning-rate schedule: warm-up, then constant, cosine or linear decay.
Expected values worked out by hand."""

import math

import pytest
import torch

from grouprl.config import OptimConfig
from grouprl.trainer.optim import build_optimizer, build_scheduler, lr_factor


def factors(total, **kwargs):
    cfg = OptimConfig(**kwargs)
    return [lr_factor(step, total, cfg) for step in range(total)]


def test_constant_without_warmup_is_one():
    assert factors(5) == [1.0] * 5


def test_linear_warmup_then_constant():
    # warm-up of 4 steps: the k-th optimizer step (0-based) runs at (k + 1) / 4 of the peak
    assert factors(6, warmup_steps=4) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_ratio_and_warmup_steps_priority():
    assert factors(10, warmup_ratio=0.2)[:3] == [0.5, 1.0, 1.0]  # int(0.2 * 10) = 2 warm-up steps
    assert factors(10, warmup_ratio=0.2, warmup_steps=5)[:5] == [0.2, 0.4, 0.6, 0.8, 1.0]  # steps win
    assert factors(4, warmup_ratio=0.2)[0] == 1.0  # int(0.8) = 0: no warm-up


def test_cosine_after_warmup():
    # warm-up 2, total 10: progress = (step - 2) / 8; factor = 0.5 * (1 + cos(pi * progress))
    got = factors(10, warmup_steps=2, scheduler="cosine")
    assert got[:2] == [0.5, 1.0]
    assert got[2] == pytest.approx(1.0)  # progress 0
    assert got[4] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))  # progress 2/8
    assert got[6] == pytest.approx(0.5)  # progress 1/2
    assert got[9] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert lr_factor(10, 10, OptimConfig(warmup_steps=2, scheduler="cosine")) == pytest.approx(0.0)


def test_cosine_with_a_floor():
    cfg = OptimConfig(scheduler="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, 8, cfg) == pytest.approx(1.0)
    assert lr_factor(4, 8, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # 0.55
    assert lr_factor(8, 8, cfg) == pytest.approx(0.1)
    assert lr_factor(20, 8, cfg) == pytest.approx(0.1)  # past the end: stays at the floor


def test_linear_decay():
    # no warm-up, total 4: 1 - step / 4
    assert factors(4, scheduler="linear") == pytest.approx([1.0, 0.75, 0.5, 0.25])
    # warm-up 2, total 6, floor 0.2: after warm-up 0.2 + 0.8 * (1 - (step - 2) / 4)
    assert factors(6, scheduler="linear", warmup_steps=2, min_lr_ratio=0.2) == pytest.approx(
        [0.5, 1.0, 1.0, 0.8, 0.6, 0.4]
    )


def test_warmup_longer_than_training_never_decays():
    assert factors(3, warmup_steps=5, scheduler="cosine") == pytest.approx([0.2, 0.4, 0.6])
    assert lr_factor(7, 3, OptimConfig(warmup_steps=5, scheduler="cosine")) == 1.0


def test_scheduler_drives_the_optimizer_step_by_step():
    """The lr each optimizer.step() actually uses is peak * lr_factor(k) for the k-th step."""
    param = torch.nn.Parameter(torch.zeros(1))
    cfg = OptimConfig(lr=0.1, warmup_steps=2, scheduler="linear", min_lr_ratio=0.0)
    optimizer = build_optimizer([param], cfg)
    scheduler = build_scheduler(optimizer, cfg, total_optimizer_steps=6)
    used = []
    for _ in range(6):
        used.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
    assert used == pytest.approx([0.05, 0.1, 0.1, 0.075, 0.05, 0.025])


def test_build_optimizer_takes_the_config():
    param = torch.nn.Parameter(torch.ones(2))
    cfg = OptimConfig(lr=3e-4, betas=[0.8, 0.95], eps=1e-6, weight_decay=0.1)
    optimizer = build_optimizer([param], cfg)
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-4,
        (0.8, 0.95),
        1e-6,
        0.1,
    )
    # one AdamW step with a zero gradient moves the weight only by decoupled weight decay
    param.grad = torch.zeros(2)
    optimizer.step()
    assert torch.allclose(param.detach(), torch.full((2,), 1 - 3e-4 * 0.1))
