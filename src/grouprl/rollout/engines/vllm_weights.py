"""The policy's weights as vLLM loads them, and their push into the engine's own copy.

After every optimizer step the trainer calls the engine's `weights_updated(model)`, which streams
the policy's parameters into vLLM's model in place (`reload_weights` on the worker, no disk),
LoRA adapters merged on the fly, one layer at a time (the trainer's model is not touched), and
resets the prefix cache, whose blocks were computed with the old weights (`push`). On several
ranks the weights are gathered one FSDP module at a time (`sharded_state`), every rank the same
all-gathers in the same order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping

import torch

from grouprl.rollout.engines.vllm_shims import refresh_tied_head


def merged_state(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """(name, tensor) of the policy's weights as a plain checkpoint names them: LoRA adapters
    added into their base weights (W + scale * B @ A), the model unchanged; floating-point
    tensors cast to `dtype` (the engine's) when given. A layer's delta is computed when its base
    weight goes out and dropped right after, so one delta at a time exists (all of them at once
    would be the size of the adapted layers: ~26 GB for a 7B model with LoRA on every linear).
    Tied weights go out once (`named_parameters` skips repeats; vLLM ties the head itself)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = dict(base.named_modules()) if base is not model else {}
    for name, param in base.named_parameters():
        if ".lora_" not in name:
            yield _merged(name, param, modules, dtype)


def _merged(name: str, param: torch.Tensor, modules: Mapping, dtype, own: bool = False):
    """One weight as `merged_state` sends it (its LoRA delta added, cast to `dtype`); `own`: in
    storage of its own, never the parameter's (which FSDP frees when it reshards)."""
    tensor = param.detach()
    made = False
    if name.endswith(".base_layer.weight"):
        delta = _lora_delta(modules.get(name.removesuffix(".base_layer.weight")))
        if delta is not None:
            tensor, made = tensor + delta.to(tensor.dtype), True
            del delta  # gone before the tensor leaves: the consumer may hold on to it
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor, made = tensor.to(dtype), True
    if own and not made:
        tensor = tensor.clone()
    return name.replace(".base_layer.", "."), tensor


def sharded_state(root: torch.nn.Module, dtype: torch.dtype | None = None):
    """`merged_state` of the policy an FSDP2 root shards over the ranks (`root.model`, the root's
    forward running it), gathered one FSDP module at a time: the root's own weights (embeddings,
    final norm, head: what no layer holds), then each layer in order, each unsharded, streamed
    and resharded before the next, so one layer's weights are whole at a time (plus what the
    consumer keeps of them: yielded tensors are copies, since resharding frees the gathered
    storage). A LoRA layer's adapters sit in the same module as its base weight, so its delta is
    computed from whole tensors. The gathered weights are FSDP's compute copies (its
    `param_dtype` under mixed precision), the weights the update's forward and generation on
    the built-in engine see. Every rank must run this generator to its end, in step: each
    unshard is an all-gather over the ranks. Inside the trainer's `gathered` (`root.whole`)
    the weights are whole already and nothing is gathered."""
    from torch.distributed.fsdp import FSDPModule

    model = root.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = dict(base.named_modules())
    layers = {name: m for name, m in modules.items() if isinstance(m, FSDPModule) and m is not root}
    owned: dict[str, list[str]] = {"": []}  # a module's name in `base` ("" the root) -> its weights
    owned.update((name, []) for name in layers)
    for name, _ in base.named_parameters():  # tied weights once
        if ".lora_" in name:
            continue
        parts = name.split(".")
        # the innermost FSDP module holding the weight, else the root
        owner = next((p for k in range(len(parts) - 1, 0, -1) if (p := ".".join(parts[:k])) in layers), "")
        owned[owner].append(name)
    whole = getattr(root, "whole", False)
    for owner, names in owned.items():  # the same order on every rank
        unit = layers.get(owner, root)
        if not names:
            continue
        if not whole:
            unit.unshard()
        try:
            for name in names:  # looked up now: unsharding swaps the module's parameters
                yield _merged(name, base.get_parameter(name), modules, dtype, own=True)
        finally:
            if not whole:
                unit.reshard()


def _lora_delta(module) -> torch.Tensor | None:
    """The summed delta weight of a LoRA layer's active adapters; None where there is none."""
    if module is None:
        return None
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer) or module.merged:
        return None
    # linear adapters live in lora_A, embedding adapters in lora_embedding_A
    held = set(module.lora_A) | set(getattr(module, "lora_embedding_A", {}))
    delta = None
    for adapter in module.active_adapters:
        if adapter in held:
            part = module.get_delta_weight(adapter)
            delta = part if delta is None else delta + part
    return delta


@contextlib.contextmanager
def quiet(name: str, level: int = logging.ERROR):
    """Raise logger `name`'s level inside the block."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(max(level, before))
    try:
        yield
    finally:
        logger.setLevel(before)


def push(llm, weights: Iterator[tuple[str, torch.Tensor]], *, images: bool) -> None:
    """`weights` into `llm`'s model in place, then the caches they make stale: the prefix cache
    (keys and values of the old weights) and, for a VLM policy (`images`), the encoder cache
    (image features of the old vision tower). The stream is drained to its end whatever the load
    read of it, so that every rank makes every gather of a sharded push."""
    with quiet("vllm"):  # a line per push, and one per weightless layer: not the user's business
        # `weights_iterator` / `is_checkpoint_format` came with vLLM 0.16 (0.15 takes no arguments)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        for _ in weights:  # whatever the load left unread: every rank makes every gather
            pass
        llm.collective_rpc(refresh_tied_head)
        llm.reset_prefix_cache()
        if images:  # image features of the old vision tower
            llm.llm_engine.reset_encoder_cache()
