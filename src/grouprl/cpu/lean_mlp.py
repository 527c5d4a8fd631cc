"""Gated MLPs that keep half the activations for backward.

A gated MLP (`down(act(gate(x)) * up(x))`: Llama, Qwen2/3, Mistral, SmolLM, Gemma ...) leaves
four [tokens, intermediate] tensors for autograd: gate(x) for the activation, act(gate(x)) and
up(x) for the product, and the product for `down`. Those are the largest activations of a
decoder layer. `lean_mlp(model)` runs such MLPs through one autograd function that keeps gate(x)
and up(x) only and recomputes the activation and the product in backward (elementwise work, a
few percent of the layer's time): about 2 x tokens x intermediate floats less per layer. The
numbers and gradients are those of the module's own forward (tested to float64 precision).

Only modules whose class `forward` is exactly that expression are taken; anything else keeps its
own forward. A `down` layer that is not a plain `nn.Linear` (a LoRA layer) is called as it is,
and the function then covers the activation and product only (one tensor saved instead of two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grouprl.cpu.module_patch import forward_replaced, forward_source

_GATED = "self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))"


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    source = forward_source(type(module))
    gated = f"return{_GATED}" in source or f"down_proj={_GATED}" in source
    return gated and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))


class _GatedDown(torch.autograd.Function):
    """y = (act(g) * u) @ W.T + b, saving g and u (and W) only. Under autocast the forward's
    product runs in the autocast dtype and so do the backward's (the dtype of grad_out)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, act):
        ctx.act, ctx.bias_dtype = act, None if bias is None else bias.dtype
        ctx.save_for_backward(gate, up, weight)
        return F.linear(act(gate) * up, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_weight, need_bias = ctx.needs_input_grad[:4]
        with torch.enable_grad():
            g = gate.detach().requires_grad_(need_gate)
            u = up.detach().requires_grad_(need_up)
            hidden = ctx.act(g) * u  # recomputed: elementwise only
        grad_weight = grad_bias = grad_gate = grad_up = None
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        if need_weight:
            flat_hidden = hidden.detach().reshape(-1, hidden.shape[-1]).to(flat_grad.dtype)
            grad_weight = (flat_grad.t() @ flat_hidden).to(weight.dtype)
        if ctx.bias_dtype is not None and need_bias:
            grad_bias = flat_grad.sum(0).to(ctx.bias_dtype)
        inputs = [t for t, need in ((g, need_gate), (u, need_up)) if need]
        if inputs:
            grad_hidden = (grad_out @ weight.to(grad_out.dtype)).to(hidden.dtype)
            grads = iter(torch.autograd.grad(hidden, inputs, grad_hidden))
            grad_gate = next(grads) if need_gate else None
            grad_up = next(grads) if need_up else None
        return grad_gate, grad_up, grad_weight, grad_bias, None


class _ActMul(torch.autograd.Function):
    """act(g) * u, saving g and u only (for a `down` layer that is not a plain linear)."""

    @staticmethod
    def forward(ctx, gate, up, act):
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return act(gate) * up

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        need_gate, need_up = ctx.needs_input_grad[:2]
        with torch.enable_grad():
            g = gate.detach().requires_grad_(need_gate)
            u = up.detach().requires_grad_(need_up)
            hidden = ctx.act(g) * u
        inputs = [t for t, need in ((g, need_gate), (u, need_up)) if need]
        if not inputs:
            return None, None, None
        grads = iter(torch.autograd.grad(hidden, inputs, grad_out.to(hidden.dtype)))
        return (next(grads) if need_gate else None), (next(grads) if need_up else None), None


def _lean_forward(self, x):
    if not torch.is_grad_enabled():
        return type(self).forward(self, x)
    gate, up = self.gate_proj(x), self.up_proj(x)
    down = self.down_proj
    if type(down) is torch.nn.Linear and not (down._forward_hooks or down._forward_pre_hooks):
        return _GatedDown.apply(gate, up, down.weight, down.bias, self.act_fn)
    return down(_ActMul.apply(gate, up, self.act_fn))


def lean_mlp(model: torch.nn.Module, enabled: bool = True):
    """Within the `with` block, the model's gated MLPs keep gate(x) and up(x) only for backward.
    The block yields how many MLPs it took."""
    return forward_replaced(model, _lean_forward, _is_gated_mlp if enabled else lambda m: False)
