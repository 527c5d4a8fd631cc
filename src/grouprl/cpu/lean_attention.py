"""Grouped-query attention without the key/value copies, on CPU.

With a mask, transformers' `sdpa` attention repeats each key/value head for the query heads that
share it before calling `scaled_dot_product_attention` (its fused kernels on CUDA take no mask
with grouped heads), and torch turns a boolean mask into a float one in every layer. Autograd
then keeps, per layer, keys and values num_heads / num_kv_heads times over and a float copy of
the mask. torch's CPU kernel takes a mask and grouped heads together (`enable_gqa`), so within
`lean_attention(model)` a CPU model on `sdpa` attends with the unrepeated keys and values and a
float mask made once per forward (shared by all layers). Same kernel, same numbers.

The switch goes through transformers' attention registry: the configs of the model's modules
name `grouprl_sdpa` (registered here, with the `sdpa` mask builder) inside the block and `sdpa`
again after it. Anything the function does not cover (another device, no grouped heads, a
position bias, a paged cache, soft-capping) goes to transformers' own `sdpa` function.

`decode_attention(model)` (a decode loop's, inside `cpu.fast_decode`) keeps transformers' own
`sdpa` function and only hands it the float form of the boolean mask, made once per forward:
torch otherwise turns the mask into that same float form in every layer (two `where` calls a
layer, ~2-3 ms of a 20-30 ms decode step of SmolLM2's layout at 16 rows). Bitwise the same.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from grouprl.cpu.module_patch import on_cpu

NAME = "grouprl_sdpa"
DECODE = "grouprl_sdpa_decode"


class _FloatMask(threading.local):
    """The float form of the boolean mask last seen on this thread (0 where a key is seen, -inf
    where not: what torch makes of it in every layer): the layers of one forward pass get the
    same mask object, so it is converted once and autograd keeps one copy. Per thread: a rollout
    may decode beside an update's scoring."""

    source: torch.Tensor | None = None
    converted: torch.Tensor | None = None

    def of(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if mask.dtype != torch.bool:
            return mask
        if self.source is not mask or self.converted is None or self.converted.dtype != dtype:
            converted = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            converted.masked_fill_(~mask, float("-inf"))
            self.source, self.converted = mask, converted
        return self.converted

    def clear(self) -> None:
        self.source = self.converted = None


_float_mask = _FloatMask()


def grouped_sdpa_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' attention-function signature; [B, H, T, D] in, ([B, T, H, D], None) out."""
    plain = not any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap"))
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if not (plain and grouped and query.device.type == "cpu" and not kwargs.get("output_attentions")):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    mask = None if attention_mask is None else _float_mask.of(attention_mask, query.dtype)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=is_causal, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def decode_sdpa_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' `sdpa` function, given the float form of a boolean mask, made once for the
    layers of a forward pass (`_FloatMask`)."""
    if attention_mask is not None:
        attention_mask = _float_mask.of(attention_mask, query.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionInterface.register(DECODE, decode_sdpa_forward)
AttentionMaskInterface.register(DECODE, sdpa_mask)


@contextlib.contextmanager
def attention_named(model: torch.nn.Module, name: str, names: tuple[str, ...] = ("sdpa",)):
    """Within the block, the configs of `model`'s modules whose attention is one of `names` name
    `name` (an attention function in transformers' registry); each gets its own back after.
    Yields how many configs it switched."""
    configs, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if id(config) not in seen and getattr(config, "_attn_implementation", None) in names:
            seen.add(id(config))
            configs.append((config, config._attn_implementation_internal))
    for config, _ in configs:
        config._attn_implementation_internal = name
    try:
        yield len(configs)
    finally:
        for config, was in configs:
            config._attn_implementation_internal = was


@contextlib.contextmanager
def lean_attention(model: torch.nn.Module, enabled: bool = True):
    """Within the block, a CPU model on `sdpa` attention attends through `grouped_sdpa_forward`.
    Yields how many configs it switched (0: nothing to do)."""
    if not (enabled and on_cpu(model)):
        yield 0
        return
    try:
        with attention_named(model, NAME) as switched:
            yield switched
    finally:
        _float_mask.clear()


@contextlib.contextmanager
def decode_attention(model: torch.nn.Module):
    """Within the block, a CPU model on `sdpa` attention attends through `decode_sdpa_forward`."""
    if not on_cpu(model):
        yield 0
        return
    try:
        with attention_named(model, DECODE) as switched:
            yield switched
    finally:
        _float_mask.clear()
