"""The one seam the loop calls: on a CPU model every device is on (each as its switch says);
on any other device nothing is patched, hooked or registered."""

import copy

import torch

from grouprl import cpu
from grouprl.config import ActorConfig
from helpers import tiny_model_and_tokenizer


def _patched(model) -> int:
    """Modules whose instance carries a forward of its own (a lean or decode patch)."""
    return sum("forward" in m.__dict__ for m in model.modules())


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_a_cpu_model_gets_every_device_and_loses_them_on_leaving():
    model, _ = tiny_model_and_tokenizer()
    layers = model.config.num_hidden_layers
    cfg = ActorConfig(update_trim_every_layers=1)
    with cpu.lean_update(model, cfg) as before_backward:
        # gated MLPs and RMSNorms (2 per layer + the final one) are patched, attention switched
        assert _patched(model) == layers + (2 * layers + 1)
        assert model.config._attn_implementation == "grouprl_sdpa"
        assert _hooks(model) == (layers if cpu.allocator._glibc() is not None else 0)
        assert before_backward is cpu.release_free_memory
    assert _patched(model) == 0 and _hooks(model) == 0
    assert model.config._attn_implementation == "sdpa"

    off = ActorConfig(lean_mlp=False, lean_norm=False, lean_attention=False, update_malloc_trim=False)
    with cpu.lean_update(model, off) as before_backward:
        assert _patched(model) == 0 and _hooks(model) == 0
        assert model.config._attn_implementation == "sdpa"
        assert before_backward() is None and before_backward is not cpu.release_free_memory

    with cpu.lean_scoring(model, cfg):
        assert model.config._attn_implementation == "grouprl_sdpa" and _patched(model) == 0
    with cpu.fast_decode(model):
        assert _patched(model) == sum(type(m) is torch.nn.Linear for m in model.modules())


def test_a_model_elsewhere_than_the_cpu_is_left_alone():
    model, _ = tiny_model_and_tokenizer()
    elsewhere = copy.deepcopy(model).to("meta")  # stands in for a GPU: not on the CPU
    cfg = ActorConfig(update_trim_every_layers=1)
    with cpu.lean_update(elsewhere, cfg) as before_backward:
        assert _patched(elsewhere) == 0 and _hooks(elsewhere) == 0
        assert elsewhere.config._attn_implementation == "sdpa"
        assert before_backward is not cpu.release_free_memory
    with cpu.lean_scoring(elsewhere, cfg), cpu.fast_decode(elsewhere):
        assert _patched(elsewhere) == 0 and elsewhere.config._attn_implementation == "sdpa"


def test_layers_fsdp_gathers_are_also_trimmed_after_their_forward_and_keep_their_lean_patches(monkeypatch):
    """Under FSDP (several ranks) each layer's gathered weights are freed after its forward, holes
    the heap would keep through the forward: the update trims after every k-th layer's forward
    as well as in backward; in one process only backward trims. The MLPs and norms inside the
    layers FSDP wraps are patched as in one process (what the memory plan counts)."""
    from torch.distributed.fsdp import FSDPModule

    from grouprl.cpu import allocator

    if allocator._glibc() is None:
        monkeypatch.setattr(allocator, "_glibc", lambda: object())
    calls: list[str] = []
    monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append("trim") or True)
    cfg = ActorConfig(update_trim_every_layers=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    trims = {}
    for sharded in (False, True):
        model, _ = tiny_model_and_tokenizer(num_hidden_layers=4)
        if sharded:  # the class fully_shard gives a layer (FSDPModule first, then the layer's own)
            for layer in model.model.layers:
                layer.__class__ = type(f"FSDP{type(layer).__name__}", (FSDPModule, type(layer)), {})
        calls.clear()
        with cpu.lean_update(model, cfg):
            assert _patched(model) == 4 + (2 * 4 + 1)
            loss = model(input_ids=ids).logits.sum()
            in_forward = len(calls)
            loss.backward()
        trims[sharded] = (in_forward, len(calls) - in_forward)
        assert _hooks(model) == 0
    assert trims == {False: (0, 2), True: (2, 2)}
