"""The loop's collectives on a GPU run's process group, emulated on a CPU.

An NCCL-only group (`init_process_group("nccl")`, what Ray Train joins for workers with GPUs)
has one backend, registered for the cuda device type; a collective on CPU tensors looks up the
backend for the cpu device type and fails ("No backend type associated with device type cpu").
`init_process_group("cuda:gloo")` builds the same group on a machine without a GPU: one backend,
for cuda only (torch maps "nccl" and "cuda:gloo" to the same device types; checked below), so a
CPU tensor's collective fails at the same look-up, while gloo does the work where one is found.
Two ranks (torch.multiprocessing) on such a group: `Ranks` reduces, gathers and waits over its
own gloo group, with the values worked out by hand, and a real update (`PolicyUpdater`, its
loss totals and metrics reduced over the ranks) gives the one-process update. A group `Ranks`
joins itself on CUDA ("cpu:gloo,cuda:nccl", emulated as "cpu:gloo,cuda:gloo") serves CPU
tensors itself. Ray Train is asked for that backend too (`run_on_ray`, with Ray stubbed)."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import Backend, BackendConfig

from grouprl.trainer import parallel
from grouprl.trainer.parallel import Ranks, process_group_backend, reduce_metrics, serves_cpu
from helpers import free_port

NO_CPU_BACKEND = "No backend type associated with device type cpu"




def _as_rank(rank: int, port: int, fn, args) -> None:
    """One rank: the environment torchrun (or Ray Train) gives it, then `fn(rank, *args)`."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    fn(rank, *args)


def on_two_ranks(fn, *args) -> None:
    """Run `fn(rank, *args)` in two processes; a failed assertion in either fails the test."""
    mp.spawn(_as_rank, args=(free_port(), fn, args), nprocs=2, join=True)


def emulated_nccl_only() -> None:
    """The default group as `init_process_group("nccl")` leaves it, on a CPU."""
    dist.init_process_group("cuda:gloo")
    assert not serves_cpu()
    with pytest.raises(RuntimeError, match=NO_CPU_BACKEND):
        dist.all_reduce(torch.ones(2, dtype=torch.float64))


def test_the_emulated_group_has_the_device_types_of_an_nccl_only_one():
    device_types = lambda backend: set(BackendConfig(Backend(backend)).get_device_backend_map())  # noqa: E731
    assert device_types("nccl") == device_types("cuda:gloo") == {"cuda"}
    assert device_types(process_group_backend("cuda")) == {"cpu", "cuda"}


def test_the_backend_serves_cpu_tensors_beside_the_device():
    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"
    parsed = BackendConfig(Backend(process_group_backend("cuda"))).get_device_backend_map()
    assert parsed == {"cpu": "gloo", "cuda": "nccl"}


def _joined_elsewhere(rank: int) -> None:
    emulated_nccl_only()  # as Ray Train leaves it before the worker function runs
    ranks = Ranks.from_env("cuda")
    assert (ranks.rank, ranks.world, ranks.local_rank, ranks.owns_group) == (rank, 2, rank, False)
    assert ranks.group is not None and serves_cpu(ranks.group)
    assert ranks.reduce([1.0 + rank, 10.0 * rank, 0.5]) == [3.0, 10.0, 1.0]
    assert ranks.reduce([1.0 + rank, -3.0 * rank], "max") == [2.0, 0.0]
    assert ranks.reduce([1.0 + rank, -3.0 * rank], "min") == [1.0, -3.0]
    assert ranks.gather({"rank": rank, "groups": [2 * rank, 2 * rank + 1]}) == [
        {"rank": 0, "groups": [0, 1]},
        {"rank": 1, "groups": [2, 3]},
    ]
    ranks.barrier()
    keys = ("reward/mean", "reward/errors", "time/update", "response/length_max", "adv/min")
    mine = dict(zip(keys, [(0.25, 1.0, 2.0, 5.0, -1.5), (0.75, 2.0, 3.5, 8.0, -0.5)][rank]))
    assert reduce_metrics(mine, ranks) == {
        "reward/mean": 0.5,  # the mean of equal shares
        "reward/errors": 3.0,  # counts add up
        "time/update": 3.5,  # the slowest rank
        "response/length_max": 8.0,
        "adv/min": -1.5,
        "dist/world_size": 2.0,
    }
    ranks.close()  # the launcher's group is not ours to leave
    assert dist.is_initialized()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_on_a_group_that_serves_no_cpu_tensors_use_their_own():
    on_two_ranks(_joined_elsewhere)


def _joined_here(rank: int) -> None:
    # the backend chosen for CUDA, with gloo standing in for NCCL (which a CPU build lacks)
    chosen = parallel.process_group_backend
    parallel.process_group_backend = lambda device_type: chosen(device_type).replace("nccl", "gloo")
    ranks = Ranks.from_env("cuda")
    assert dist.get_backend() == "cpu:gloo,cuda:gloo"
    assert ranks.owns_group and ranks.group is None  # the default group serves CPU tensors itself
    ones = torch.ones(1)
    dist.all_reduce(ones)  # as FSDP's collectives on offloaded (CPU) shards do
    assert ones.item() == 2.0
    assert ranks.reduce([2.0 * rank + 1.0]) == [4.0]
    assert ranks.gather(rank * 7) == [0, 7]
    ranks.barrier()
    ranks.close()
    assert not dist.is_initialized()


@pytest.mark.slow
def test_ranks_that_join_the_group_on_cuda_join_with_a_cpu_backend():
    on_two_ranks(_joined_here)


def _update(rank: int) -> None:
    # imported here: the other tests' ranks need no model code
    from test_update import (
        TEMPERATURE,
        accumulated_grads,
        actor_config,
        assert_grads_close,
        make_trajectories,
        tensors_of,
    )

    from helpers import exact_float64_norms, reference_log_probs, tiny_model_and_tokenizer

    emulated_nccl_only()
    ranks = Ranks.from_env("cuda")
    model = exact_float64_norms(tiny_model_and_tokenizer(dtype=torch.float64, seed=5)[0])
    trajectories = make_trajectories(model.config.vocab_size)  # 2 groups of 4: 7 and 14 loss tokens
    whole = tensors_of(trajectories, mask_truncated=True, pad_token_id=0)
    with torch.no_grad():  # old and reference log-probs away from the current ones (clipping acts)
        lp, _ = reference_log_probs(
            model, whole.prompt_ids, whole.response_ids, whole.response_mask, TEMPERATURE
        )
    gen = torch.Generator().manual_seed(11)
    real = whole.response_mask.bool()
    noise = lambda scale: scale * torch.randn(lp.shape, generator=gen, dtype=lp.dtype)  # noqa: E731
    whole = dataclasses.replace(
        whole, old_log_probs=torch.where(real, lp + noise(0.3), 0.0).float(), ref_log_probs=torch.where(real, lp + noise(0.5), 0.0).float()
    )
    cfg = actor_config(micro_batch_size=3, entropy_coef=0.05, kl_loss_coef=0.2)
    one_steps, one_metrics = accumulated_grads(model, whole, cfg)  # one process, the whole batch

    rows = list(range(4 * rank, 4 * rank + 4))  # this rank's group, padded as wide as the widest
    width = int(ranks.reduce([max(len(trajectories[r].response_ids) for r in rows)], "max")[0])
    mine = tensors_of([trajectories[r] for r in rows], mask_truncated=True, pad_token_id=0, width=width)
    mine = dataclasses.replace(mine, old_log_probs=whole.old_log_probs[rows], ref_log_probs=whole.ref_log_probs[rows])
    steps, metrics = accumulated_grads(model, mine, cfg, num_prompts=1, ranks=ranks)
    metrics = reduce_metrics(metrics, ranks)
    assert metrics.pop("dist/world_size") == 2.0
    assert metrics.keys() == one_metrics.keys()
    for key, value in one_metrics.items():
        if key != "actor/grad_norm":  # each rank's norm is of its own (unreduced) gradient here
            assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # what FSDP's reduce-scatter makes of the ranks' gradients: their mean
    for grad in steps[0]:
        dist.all_reduce(grad, group=ranks.group)
        grad /= ranks.world
    assert_grads_close(steps[0], one_steps[0], 1e-8)
    dist.destroy_process_group()


@pytest.mark.slow
def test_an_update_on_two_ranks_of_the_emulated_group_equals_one_process():
    on_two_ranks(_update)


def _sharded_save(rank: int, root: str) -> None:
    """The checkpoint's own steps of a sharded save (its folder made by one rank, a barrier, every
    rank's shards, then the one writer's files) on the NCCL-only group: the barrier is `Ranks'`.
    The shards themselves are DCP's (device tensors on a GPU), stood in for here."""
    from pathlib import Path

    from grouprl.trainer import checkpoint

    emulated_nccl_only()
    ranks = Ranks.from_env("cuda")
    checkpoint.is_sharded = lambda model: True

    def shards(folder, model, ref_model, optimizer):
        assert folder.parent.is_dir()  # made by the writing rank before the barrier let this one on
        folder.mkdir(exist_ok=True)
        (folder / f"rank{rank}.safetensors").write_bytes(b"x")
        ranks.barrier()  # DCP's save ends in a collective: no rank moves on before every shard is written

    checkpoint._save_shards = shards
    checkpoint.optimizer_state = lambda model, optimizer, whole: {}
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    manager = checkpoint.CheckpointManager(Path(root), 2, barrier=ranks.barrier)
    path = manager.save(3, model, optimizer, scheduler, {"step": 3}, write=ranks.main)
    ranks.barrier()
    assert path.name == "step_3" and checkpoint.problem(path) is None
    assert sorted(f.name for f in (path / checkpoint.SHARDED).iterdir()) == ["rank0.safetensors", "rank1.safetensors"]
    ranks.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_sharded_checkpoint_waits_on_the_ranks_own_group(tmp_path):
    on_two_ranks(_sharded_save, str(tmp_path))


def test_ray_train_joins_the_workers_with_the_same_backend(monkeypatch):
    train_torch = pytest.importorskip("ray.train.torch")
    import ray

    from grouprl.config import load_config
    from grouprl.trainer.launch import run_on_ray

    joined = []

    class Trainer:  # records the backend Ray Train would join the workers with
        def __init__(self, fn, *, torch_config, **_):
            joined.append(torch_config.backend)

        def fit(self):
            pass

    monkeypatch.setattr(train_torch, "TorchTrainer", Trainer)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # a cluster this test does not start
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 2.0})
    monkeypatch.setattr(ray, "put", lambda value: value)
    for device in ("cuda", "cpu"):
        overrides = ["trainer.launcher=ray", "trainer.ray_workers=2", f"trainer.device={device}"]
        run_on_ray(load_config(None, overrides))
    assert joined == ["cpu:gloo,cuda:nccl", "gloo"]
