"""grouprl/devices.py: cached memory given back at phase boundaries (CUDA's caching allocator,
a CPU's malloc heap), a thread put on its rank's GPU, and an engine process made to see its GPU
alone (vLLM in one process takes cuda:0). CUDA is faked: what is checked is what is asked of it."""

import contextlib
import threading

import pytest
import torch

import grouprl.devices as devices
import grouprl.trainer.pipeline as pipeline_module
from grouprl.config import load_config
from grouprl.errors import UserError
from grouprl.trainer.trainer import Trainer
from trainer.tiny import tiny_model_dir, write_run_config


def test_cached_memory_goes_back_on_cuda_and_on_a_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext(calls.append(("on", str(d)))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setattr(devices, "release_free_memory", lambda: calls.append(("malloc_trim",)) or True)
    devices.release_cached_memory(torch.device("cuda", 1))
    devices.release_cached_memory("cpu")
    assert calls == [("on", "cuda:1"), ("empty_cache",), ("malloc_trim",)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # nothing cached before CUDA starts
    devices.release_cached_memory("cuda:0")
    assert calls[-1] == ("malloc_trim",)


def test_a_thread_is_put_on_its_ranks_gpu(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    devices.use_device(torch.device("cuda", 3))
    devices.use_device("cpu")
    assert chosen == [torch.device("cuda", 3)]


@pytest.mark.parametrize(
    "device, visible, local, seen",
    [
        ("cuda:1", None, "cuda:0", "1"),
        ("cuda:1", "4,5,6", "cuda:0", "5"),  # the launcher's list, read through
        ("cuda:0", "7", "cuda:0", "7"),
        ("cpu", None, "cpu", None),
    ],
)
def test_an_engine_process_sees_its_gpu_alone(device, visible, local, seen):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert devices.own_device(device, environ) == torch.device(local)
    assert environ.get("CUDA_VISIBLE_DEVICES") == seen


def test_a_gpu_outside_the_visible_ones_is_one_line():
    with pytest.raises(UserError, match=r"cuda:2 is not among the GPUs this process may use \(CUDA_VISIBLE_DEVICES=0,1\)"):
        devices.own_device("cuda:2", {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_the_rollout_threads_of_an_asynchronous_run_take_the_ranks_device(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(pipeline_module, "use_device", lambda d: seen.append((threading.current_thread().name, str(d))))
    config = write_run_config(tmp_path, tiny_model_dir(tmp_path / "model"))
    Trainer(load_config(config, ["rollout.max_staleness=1", "trainer.total_steps=2", "trainer.val_before_train=false"])).fit()
    assert sorted(seen) == [("grouprl-generate", "cpu"), ("grouprl-score", "cpu")]
