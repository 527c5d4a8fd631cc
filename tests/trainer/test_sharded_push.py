"""The weight push of a policy sharded over ranks (`sharded_state`): two ranks (torch.multiprocessing,
gloo) shard a tiny model with FSDP2 as the trainer does (a text model with a tied or untied head,
with LoRA, a Qwen2-VL with its vision blocks), stream its weights one FSDP module at a time, and
every tensor equals what one process streams from the same model whole (LoRA merged, tied
weights once), with one module unsharded at each tensor and every shard back in place after."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grouprl.rollout.engines.vllm import merged_state, sharded_state
from grouprl.trainer.parallel import decoder_layers, gathered, shard
from helpers import free_port, tiny_model_and_tokenizer


def _as_rank(rank: int, port: int, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    fn(rank, *args)
    dist.barrier()
    dist.destroy_process_group()
    # leave as the CLI's ranks do: tearing the interpreter down can abort it from a communication
    # thread ("terminate called without an active exception")
    os._exit(0)


def on_two_ranks(fn, *args) -> None:
    """Run `fn(rank, *args)` in two processes of one gloo group; a failure in either fails the test."""
    mp.spawn(_as_rank, args=(free_port(), fn, args), nprocs=2, join=True)


def policy_model(kind: str):
    """The tiny model as a policy: tied head (transformers' default here), untied, LoRA (every
    linear layer, adapters away from zero so the merge shows), or a tiny Qwen2-VL (vision blocks
    and decoder layers sharded one by one)."""
    if kind == "qwen2_vl":
        from vision_helpers import tiny_vlm

        return tiny_vlm("qwen2_vl", seed=3)[0]
    model, _ = tiny_model_and_tokenizer(seed=3, tie_word_embeddings=kind != "untied")
    if kind == "lora":
        import peft

        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(4)
            model = peft.get_peft_model(model, config)
    return model


def whole_units(policy) -> list[str]:
    """The FSDP modules whose own weights are whole now ("" the root, else the layer's name)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for name, m in policy.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        inner = [sub for sub in m.modules() if sub is not m and isinstance(sub, FSDPModule)]
        nested = {id(p) for sub in inner for p in sub.parameters()}
        own = [p for p in m.parameters() if id(p) not in nested]
        if own and not any(hasattr(p, "to_local") for p in own):
            out.append(name.removeprefix("model.").removeprefix("base_model.model."))
    return out


def _stream(rank: int, kind: str) -> None:
    want = list(merged_state(policy_model(kind)))  # one process, the model whole
    model = policy_model(kind)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    named = {id(m): n for n, m in base.named_modules()}
    layers = [named[id(m)] for m in decoder_layers(model)]  # what FSDP shards one by one
    policy = shard(model)
    assert whole_units(policy) == []
    got, seen = [], []
    for name, tensor in sharded_state(policy):
        got.append((name, tensor))  # kept, as vLLM keeps a layer's tensors until the layer is complete
        seen.append((name, whole_units(policy)))
    assert whole_units(policy) == []  # every module resharded
    assert sorted(n for n, _ in got) == sorted(n for n, _ in want)  # each once (a tied head: not at all)
    assert ("lm_head.weight" in dict(got)) == (kind == "untied")
    expected = dict(want)
    for name, tensor in got:  # exact: gathering float32 shards moves no bit
        assert torch.equal(tensor, expected[name]), name
    # one module whole at each tensor, its owner: the root's weights first, then layer by layer
    owners = [units for _, units in seen]
    assert all(len(units) == 1 for units in owners), owners
    order = list(dict.fromkeys(units[0] for units in owners))
    assert order == ["", *layers] and len(layers) >= 2
    for name, units in seen:
        owner = units[0]
        assert name.startswith(owner + ".") if owner else not any(name.startswith(f"{n}.") for n in layers), name
    # inside the trainer's `gathered` every module is whole already: the same tensors, no gather
    with gathered(policy):
        again = list(sharded_state(policy))
        assert len(whole_units(policy)) == 1 + len(layers)
    assert whole_units(policy) == []
    assert [n for n, _ in again] == [n for n, _ in got]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again, got))
    # float32 weights for a bfloat16 engine: cast as they go out
    assert all(t.dtype == torch.bfloat16 for _, t in sharded_state(policy, torch.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied", "lora", "qwen2_vl"])
def test_a_sharded_policy_streams_its_whole_weights_one_module_at_a_time(kind):
    if kind == "lora":
        pytest.importorskip("peft")
    on_two_ranks(_stream, kind)
