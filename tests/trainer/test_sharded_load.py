"""Loading a policy sharded over ranks (trainer/setup.py, parallel.shard's `source`): rank 0 reads
the weights into host memory, the other ranks build the model with its parameters on the meta
device, and each rank's shards are made on its device and filled from rank 0's, a tensor at a
time. On two ranks (torch.multiprocessing, gloo) the sharded policy gathered whole is what one
process loads (a tied head, LoRA adapters as rank 0 initialised them, a VLM's tower and its
rotary tables), and rank 1 never holds the whole model."""

import os
import re

import pytest
import torch
from test_sharded_push import on_two_ranks

from grouprl.config import LoraConfig, ModelConfig
from grouprl.trainer.models import load_causal_lm
from grouprl.trainer.parallel import fill_from_rank0, shard, whole_state_dict
from helpers import tiny_model_and_tokenizer

CPU = torch.device("cpu")


def settings(folder, kind: str) -> ModelConfig:
    lora = LoraConfig(rank=4, alpha=8) if kind == "lora" else LoraConfig()
    return ModelConfig(path=str(folder), lora=lora, gradient_checkpointing=kind == "lora")


def loaded_here(folder, kind: str):
    """What one process loads (the same seed: LoRA's adapters start the same)."""
    torch.manual_seed(0)
    return load_causal_lm(settings(folder, kind), str(folder), CPU, torch.float32)


def load_on_rank(rank: int, folders: dict[str, str]) -> None:
    for kind, folder in folders.items():  # one pair of ranks for every kind (a start costs seconds)
        load_kind_on_rank(rank, folder, kind)


def load_kind_on_rank(rank: int, folder: str, kind: str) -> None:
    cfg = settings(folder, kind)
    torch.manual_seed(0)
    model = load_causal_lm(cfg, folder, CPU, torch.float32, weights=rank == 0)
    assert all(p.is_meta for p in model.parameters()) == (rank != 0)
    source = dict(model.state_dict()) if rank == 0 else {}
    shard(model, source=source, device=CPU)
    got, want = whole_state_dict(model), loaded_here(folder, kind).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    buffers = dict(model.named_buffers())
    for name, b in loaded_here(folder, kind).named_buffers():  # built on each rank, kept through the fill
        assert torch.equal(buffers[name], b), name
    # a whole copy (the generation copy of asynchronous runs) filled the same way
    copy = load_causal_lm(cfg, folder, CPU, torch.float32, weights=False)
    fill_from_rank0(copy, source, CPU)
    whole = dict(copy.state_dict())
    assert all(torch.equal(whole[name], want[name]) for name in want)
    if kind != "qwen2_vl":
        head, embeddings = copy.get_output_embeddings(), copy.get_input_embeddings()
        assert (head.weight is embeddings.weight) == bool(copy.config.get_text_config().tie_word_embeddings)


@pytest.mark.slow
def test_each_rank_fills_its_shards_from_rank_0_and_gets_the_files_weights(tmp_path):
    from vision_helpers import tiny_vlm

    folders = {kind: str(tmp_path / kind) for kind in ("tied", "untied", "lora", "qwen2_vl")}
    for kind, folder in folders.items():
        if kind == "qwen2_vl":
            tiny_vlm("qwen2_vl", folder, seed=3)
        else:
            tiny_model_and_tokenizer(folder, seed=3, tie_word_embeddings=kind != "untied")
    on_two_ranks(load_on_rank, folders)


def rss_peak_gb() -> float:
    status = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 2**20


def measure_on_rank(rank: int, folder: str, whole_gb: float) -> None:
    from grouprl.cpu.allocator import mapped_large_blocks

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss_peak_gb()
    # large blocks mmapped and unmapped when freed: the resident set follows the live tensors, not
    # the holes malloc's heap keeps (which vary from run to run)
    with mapped_large_blocks(1 << 20):
        model = load_causal_lm(ModelConfig(path=folder), folder, CPU, torch.float32, weights=rank == 0)
        shard(model, source=dict(model.state_dict()) if rank == 0 else {}, device=CPU)
    grew = rss_peak_gb() - before
    print(f"rank {rank}: resident set grew by {grew:.3f} GiB, the model is {whole_gb:.3f} GiB")
    largest_gb = 4096 * 1536 * 4 / 2**30  # an MLP weight: whole while filled, then its half
    if rank == 1:  # its half and a tensor or two at a time, not the model (loading it whole and
        # then sharding takes 1.5 times the model): 0.25 of 0.42 GiB here
        assert grew < whole_gb / 2 + 3 * largest_gb, (grew, whole_gb)
    else:  # rank 0: its whole host copy and its half
        assert grew > 0.9 * whole_gb, (grew, whole_gb)


@pytest.mark.slow
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resident-set peak reset")
def test_rank_1_never_holds_the_whole_model(tmp_path):
    folder = tmp_path / "model"
    model, _ = tiny_model_and_tokenizer(
        folder, hidden_size=1536, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=12,
        num_key_value_heads=12, max_position_embeddings=256,
    )  # fmt: skip
    whole_gb = sum(p.numel() for p in model.parameters()) * 4 / 2**30
    del model
    on_two_ranks(measure_on_rank, str(folder), whole_gb)
