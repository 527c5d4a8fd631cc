"""Decode-time linear layers on a CPU: the faster of two equal products, measured per shape.

A decode step multiplies a few rows (the active samples, one token each) by every weight matrix.
For such a product `x @ W.T`, the BLAS kernel a CPU build picks can be several times slower than
the same product taken as `(W @ x.T).T`: on the x86_64 test machine with MKL, 8-48 rows times
SmolLM2-135M's matrices ran 2x faster the second way (a whole 32-row decode step 146 -> 63 ms of
matrix products), while 1-2 rows and 64 or more ran faster the first way. Which way wins depends
on the CPU, the BLAS build, the shape and the row count, so nothing is assumed: the first calls
of each (weight shape, rows, dtype) take both forms (in alternating order), time them and
return the usual form's result, and later calls use the faster one. The other form is kept only
where its results were bitwise the usual one's on every trial: both compute the same sums, but a
BLAS may add them in another order for one form and one row count (seen on an Intel Xeon with
MKL at 2 and 8 rows: differences of 4e-5), and a choice made by timing must never change a
number, or two runs of the same seed, or one batch cut in two chunks, would sample other tokens.
So the block changes speed only.

`small_batch_linear(model)` applies this to the model's plain `nn.Linear` layers (a LoRA layer's
base layer included) for the duration of a `with` block; nothing is changed outside it, and on
other devices it does nothing.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from grouprl.cpu.module_patch import forward_replaced

MAX_ROWS = 64  # above this the two forms ran alike everywhere measured; not worth timing
TRIALS = 2  # timed calls of each form before the choice is fixed (the faster of each form's best)

# (weight shape, rows, dtype, autocast dtype or None) -> True when (W @ x.T).T is the faster form
# and gave the usual form's numbers bitwise on every trial
_CHOICE: dict[tuple, bool] = {}
# the same key -> (usual form's times, transposed form's times, both forms equal so far)
_TRIALS: dict[tuple, tuple[list[float], list[float], list[bool]]] = {}


def _transposed_product(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(weight, x2.t())  # [out_features, rows]
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    return out.t().contiguous()  # the layers after it run slower on a transposed layout


def _trial(key: tuple, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Both forms, timed, in alternating order; the usual form's result."""
    usual_times, transposed_times, equal = _TRIALS.setdefault(key, ([], [], [True]))
    results = {}
    order = (False, True) if len(usual_times) % 2 == 0 else (True, False)
    for transposed in order:
        start = time.perf_counter()
        results[transposed] = _transposed_product(x2, weight, bias) if transposed else F.linear(x2, weight, bias)
        (transposed_times if transposed else usual_times).append(time.perf_counter() - start)
    equal[0] = equal[0] and torch.equal(results[False], results[True])
    if len(usual_times) >= TRIALS:
        _CHOICE[key] = equal[0] and min(transposed_times) < min(usual_times)
        del _TRIALS[key]
    return results[False]


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_ROWS or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    key = (tuple(weight.shape), rows, weight.dtype, autocast)
    choice = _CHOICE.get(key)
    x2 = x.reshape(rows, x.shape[-1])
    if choice is None:
        out = _trial(key, x2, weight, bias)
    elif choice:
        out = _transposed_product(x2, weight, bias)
    else:
        out = F.linear(x2, weight, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def small_batch_linear(model: torch.nn.Module):
    """Within the `with` block, the model's plain CPU `nn.Linear` layers take their product in the
    faster of the two forms for inputs of at most MAX_ROWS rows (gradient mode off only)."""
    return forward_replaced(
        model, _forward, lambda m: type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
    )
