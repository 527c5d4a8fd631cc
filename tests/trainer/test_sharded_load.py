"""Loading a policy sharded over ranks (trainer/slices.py, parallel.shard's `source`): every rank
builds the model with its parameters on the meta device and reads only its shards' slices of the
safetensors files. On two ranks (torch.multiprocessing, gloo) the sharded policy gathered whole
is what one process loads (a tied head, an untied one, LoRA adapters drawn from the seed, a VLM's
tower under transformers' renamed keys and its rotary tables), each rank read about half the
model's bytes, and a whole copy (the generation copy of asynchronous runs) reads every byte once.
A checkpoint that is not safetensors loads the old way: rank 0 reads it and broadcasts it. A
rank's start-up holds its shards and no whole root: FSDP's root is set up without gathering the
embeddings (which a first forward through the root would, with its buffer: twice their size)."""

import pytest
import torch
from test_sharded_push import on_two_ranks
from transformers import AutoModelForCausalLM

from grouprl.config import LoraConfig, ModelConfig
from grouprl.trainer.memory import GIB, PeakMeter
from grouprl.trainer.models import load_causal_lm
from grouprl.trainer.parallel import load_into, shard, whole_state_dict
from grouprl.trainer.slices import Checkpoint, seed_adapters
from helpers import tiny_config, tiny_model_and_tokenizer

CPU = torch.device("cpu")
KINDS = ("tied", "untied", "lora", "qwen2_vl", "bin")


def settings(folder, kind: str) -> ModelConfig:
    lora = LoraConfig(rank=4, alpha=8) if kind == "lora" else LoraConfig()
    return ModelConfig(path=str(folder), lora=lora, gradient_checkpointing=kind == "lora")


def loaded_here(folder, kind: str):
    """What one process loads (the same seed: LoRA's adapters start the same)."""
    torch.manual_seed(0)
    return load_causal_lm(settings(folder, kind), str(folder), CPU, torch.float32)


def load_on_rank(rank: int, folders: dict[str, str]) -> None:
    for kind, folder in folders.items():  # one pair of ranks for every kind (a start costs seconds)
        if kind == "wide":
            shard_peak_on_rank(rank, folder)
        else:
            load_kind_on_rank(rank, folder, kind)


def load_kind_on_rank(rank: int, folder: str, kind: str) -> None:
    cfg = settings(folder, kind)
    torch.manual_seed(0)
    model = load_causal_lm(cfg, folder, CPU, torch.float32, weights=False)
    assert all(p.is_meta for p in model.parameters())
    source = Checkpoint.of(model, folder, torch.initial_seed())
    assert (source is None) == (kind == "bin")
    if source is None:  # rank 0 reads the whole model and broadcasts it
        whole_model = loaded_here(folder, kind) if rank == 0 else None
        source = dict(whole_model.state_dict()) if rank == 0 else {}
    shard(model, source=source, device=CPU)
    want_model = loaded_here(folder, kind)
    got, want = whole_state_dict(model), want_model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    buffers = dict(model.named_buffers())
    for name, b in want_model.named_buffers():  # built on each rank, kept through the fill
        assert torch.equal(buffers[name], b), name
    whole_bytes = sum(t.numel() * t.element_size() for t in {id(p): p for p in want_model.parameters()}.values())
    if isinstance(source, Checkpoint):  # this rank's slices only: half the model, a row or so more
        assert 0.4 * whole_bytes < source.read_bytes < 0.6 * whole_bytes, (source.read_bytes, whole_bytes)
        source.read_bytes = 0
    # a whole copy (the generation copy of asynchronous runs) loaded the same way
    copy = load_causal_lm(cfg, folder, CPU, torch.float32, weights=False)
    load_into(copy, source, CPU)
    whole = dict(copy.state_dict())
    assert all(torch.equal(whole[name], want[name]) for name in want)
    if isinstance(source, Checkpoint):
        adapters = sum(t.numel() * 4 for n, t in want_model.named_parameters() if "lora_" in n)
        assert source.read_bytes == whole_bytes - adapters  # every weight once, the adapters from the seed
    if kind != "qwen2_vl":
        head, embeddings = copy.get_output_embeddings(), copy.get_input_embeddings()
        assert (head.weight is embeddings.weight) == bool(copy.config.get_text_config().tie_word_embeddings)


@pytest.mark.slow
def test_each_rank_reads_its_slices_and_gets_the_files_weights(tmp_path):
    from vision_helpers import tiny_vlm

    folders = {kind: str(tmp_path / kind) for kind in KINDS}
    # shard_peak_on_rank's: an embedding of 64 MiB (65,536 x 256, float32, tied to the head), two small layers
    folders["wide"] = str(tmp_path / "wide")
    config = tiny_config(vocab_size=65536, hidden_size=256, intermediate_size=512, num_attention_heads=8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folders["wide"])
    for kind, folder in folders.items():
        if kind == "wide":
            continue
        if kind == "qwen2_vl":
            tiny_vlm("qwen2_vl", folder, seed=3)
        else:
            model, _ = tiny_model_and_tokenizer(folder, seed=3, tie_word_embeddings=kind != "untied")
            if kind == "bin":  # the weights as a pickled state dict, as older checkpoints have them
                torch.save(model.state_dict(), tmp_path / kind / "pytorch_model.bin")
                (tmp_path / kind / "model.safetensors").unlink()
    on_two_ranks(load_on_rank, folders)


def shard_peak_on_rank(rank: int, folder: str) -> None:
    """The resident set's rise over shard() with a checkpoint read in slices: this rank's shards
    (about half the model) and no more; the old first forward through the root (the fallback for a
    torch without FSDP's lazy initialisation) adds the whole embedding and its all-gather buffer,
    which the same meter sees."""
    import torch.distributed as dist

    from grouprl.trainer import parallel

    lazy_init, rises = parallel.fsdp_lazy_init, {}
    for way in ("lazy", "forward"):
        model = load_causal_lm(ModelConfig(path=folder), folder, CPU, torch.float32, weights=False)
        source = Checkpoint.of(model, folder, 0)
        meter = PeakMeter(CPU)
        if way == "forward":  # a torch whose FSDP has no lazy initialisation to call
            parallel.fsdp_lazy_init = lambda policy: None
        dist.barrier()
        meter.start()
        before = meter.read()["peak"]
        try:
            policy = shard(model, source=source, device=CPU)
        finally:
            parallel.fsdp_lazy_init = lazy_init
        rises[way] = (meter.read()["peak"] - before) * GIB
        embedding = model.get_input_embeddings().weight
        local = {id(p): p.to_local() for p in policy.parameters()}.values()
        shards = sum(t.numel() * t.element_size() for t in local)
        whole_embedding = embedding.numel() * embedding.element_size()
        assert 0.45 * 4 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) < shards
        del policy, model, source
    # the lazy way: the shards (a third of the root's size to spare); the forward: 2 x the root more
    assert rises["lazy"] < shards + whole_embedding / 3, (rises, shards, whole_embedding)
    assert rises["forward"] > shards + 1.5 * whole_embedding, (rises, shards, whole_embedding)


def test_lora_adapters_come_from_the_seed_alone(tmp_path):
    """One process's adapters are the seed's, whatever the global generator did before: what
    lets each rank make them without a broadcast."""
    tiny_model_and_tokenizer(tmp_path, seed=3)
    cfg = settings(tmp_path, "lora")
    models = []
    for draws in (0, 5):
        torch.manual_seed(7)
        torch.rand(draws)  # the global generator moved on
        models.append(load_causal_lm(cfg, str(tmp_path), CPU, torch.float32))
    adapters = [{n: p for n, p in m.named_parameters() if "lora_" in n} for m in models]
    assert adapters[0] and all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])
    a = [p for n, p in adapters[0].items() if "lora_A" in n]
    b = [p for n, p in adapters[0].items() if "lora_B" in n]
    assert all(p.abs().max() > 0 for p in a) and all(not p.any() for p in b)  # A drawn, B zeros (peft's default)
    fan_in = a[0].shape[1]
    assert float(a[0].abs().max()) <= fan_in**-0.5  # kaiming-uniform with a = sqrt(5): U(-1/sqrt(fan_in), ...)
    first_a = next(n for n in adapters[0] if "lora_A" in n)
    seed_adapters(models[1], 8)  # another seed, other adapters
    assert not torch.equal(dict(models[1].named_parameters())[first_a], adapters[0][first_a])
