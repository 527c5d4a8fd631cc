"""RMSNorms that keep one activation for backward instead of two.

The RMSNorm of Llama, Qwen2/3, Mistral, SmolLM (and their VL text models),
`w * (x * rsqrt(mean(x^2) + eps))`, leaves its input x and the normalised x for autograd; the
next linear layers keep the output as well. `lean_norm(model)` runs those norms through one
autograd function that keeps x and the [tokens, 1] reciprocal RMS only and recomputes the
normalised x in backward (elementwise work): one [tokens, hidden] tensor less per norm, two per
decoder layer. Numbers and gradients are those of the module's own forward, its dtype casts
included (a bf16 or float32 input is normalised in float32; a float64 one stays float64, where
transformers would round it to float32).

Only modules whose class `forward` is exactly that computation are taken (Gemma's `(1 + w)`
norm, for one, keeps its own forward).
"""

from __future__ import annotations

import torch

from grouprl.cpu.module_patch import forward_replaced, forward_source

_RMS_NORM = (
    "input_dtype=hidden_states.dtype"
    "hidden_states=hidden_states.to(torch.float32)"
    "variance=hidden_states.pow(2).mean(-1,keepdim=True)"
    "hidden_states=hidden_states*torch.rsqrt(variance+self.variance_epsilon)"
    "returnself.weight*hidden_states.to(input_dtype)"
)


def _is_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return _RMS_NORM in forward_source(type(module)) and isinstance(weight, torch.Tensor) and hasattr(module, "variance_epsilon")


class _RMSNorm(torch.autograd.Function):
    """y = w * (x_f * r).to(x.dtype) with x_f = x in float32 (at least) and r = rsqrt(mean(x_f^2) + eps),
    saving x and r. Backward, with n = x_f * r and g_n the gradient reaching n:
    dx_f = r * g_n - x_f * r^3 * mean(g_n * x_f)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, rstd, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        xf = x.to(rstd.dtype)
        normed = xf * rstd
        grad_w = grad_x = None
        if need_w:
            prod = grad_out * normed.to(x.dtype)
            grad_w = prod.reshape(-1, prod.shape[-1]).sum(0).to(weight.dtype)
        if need_x:
            g_n = (grad_out * weight).to(rstd.dtype)
            dot = (g_n * xf).mean(-1, keepdim=True)
            grad_x = (rstd * g_n - xf * rstd.pow(3) * dot).to(x.dtype)
        return grad_x, grad_w, None


def _lean_forward(self, hidden_states):
    if not torch.is_grad_enabled():
        return type(self).forward(self, hidden_states)
    return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def lean_norm(model: torch.nn.Module, enabled: bool = True):
    """Within the `with` block, the model's RMSNorms keep their input and reciprocal RMS only for
    backward. The block yields how many norms it took."""
    return forward_replaced(model, _lean_forward, _is_rms_norm if enabled else lambda m: False)
