"""Decode-time linear layers on a CPU: the fastest of a few equal products, measured per shape.

A decode step multiplies a few rows (the active samples, one token each) by every weight matrix.
For such a product `x @ W.T`, the BLAS kernel a CPU build picks can be several times slower than
the same product taken another way. Two other forms are tried: `(W @ x.T).T` (on the x86_64 test
machine with MKL, 8-48 rows times SmolLM2-135M's matrices ran 2x faster that way), and, for a
matrix of many outputs (a vocabulary head), the usual product taken over slices of 1,024 output
features (on an Intel Xeon with MKL, 2-11 rows times SmolLM2's 49,152 x 576 head: 16-37 ms whole,
11-21 ms in slices). Which form wins depends on the CPU, the BLAS build, the shape and the row
count, so nothing is assumed: the first calls of each (weight shape, rows, dtype) take every form
(in rotating order), time them and return the usual form's result, and later calls use the
fastest. A form is kept only where its results were bitwise the usual one's on every trial: the
forms compute the same sums, but a BLAS may add them in another order for one form and one row
count (the transposed form, on that Xeon at 2-11 rows: differences of 4e-5), and a choice made
by timing must never change a number, or two runs of the same seed would sample other tokens.
So the block changes speed only. (The slices keep each output's sum whole, which is why they
matched bitwise wherever they were measured.)

`small_batch_linear(model)` applies this to the model's plain `nn.Linear` layers (a LoRA layer's
base layer included) for the duration of a `with` block; nothing is changed outside it, and on
other devices it does nothing. Within `usual_products()` (a pass that carries prefill tokens
beside the decode rows, whose row count varies from pass to pass) every product is the usual one,
untimed.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.nn.functional as F

from grouprl.cpu.module_patch import forward_replaced

MAX_ROWS = 64  # above this the forms ran alike everywhere measured; not worth timing
TRIALS = 2  # timed calls of each form before the choice is fixed (the fastest of each form's best)
SLICE = 1024  # output features per product of the sliced form, tried for weights of 4 slices or more

# (weight shape, rows, dtype, autocast dtype or None) -> the form later calls take: the fastest of
# those that gave the usual form's numbers bitwise on every trial
_CHOICE: dict[tuple, str] = {}
# the same key -> (each form's times, whether it matched the usual form's numbers on every trial)
_TRIALS: dict[tuple, tuple[dict[str, list[float]], dict[str, bool]]] = {}


_usual_only = threading.local()


@contextlib.contextmanager
def usual_products():
    """Within the block (on this thread), the patched layers take the usual product, untimed."""
    was = getattr(_usual_only, "on", False)
    _usual_only.on = True
    try:
        yield
    finally:
        _usual_only.on = was


def _usual_product(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x2, weight, bias)


def _transposed_product(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(weight, x2.t())  # [out_features, rows]
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    return out.t().contiguous()  # the layers after it run slower on a transposed layout


def _sliced_product(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The usual product over slices of SLICE output features, side by side -> [rows, out_features]."""
    return torch.cat(
        [F.linear(x2, weight[i : i + SLICE], None if bias is None else bias[i : i + SLICE]) for i in range(0, weight.shape[0], SLICE)],
        dim=-1,
    )  # fmt: skip


def _forms(weight: torch.Tensor) -> list[str]:
    """The forms tried for `weight` (the usual one first)."""
    return ["usual", "transposed"] + (["sliced"] if weight.shape[0] >= 4 * SLICE else [])


def _product(form: str, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if form == "transposed":
        return _transposed_product(x2, weight, bias)
    if form == "sliced":
        return _sliced_product(x2, weight, bias)
    return _usual_product(x2, weight, bias)


def _trial(key: tuple, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Every form, timed, in rotating order; the usual form's result."""
    forms = _forms(weight)
    times, equal = _TRIALS.setdefault(key, ({f: [] for f in forms}, {f: True for f in forms}))
    done = len(times["usual"])
    order = forms[done % len(forms) :] + forms[: done % len(forms)]
    results = {}
    for form in order:
        start = time.perf_counter()
        results[form] = _product(form, x2, weight, bias)
        times[form].append(time.perf_counter() - start)
    for form in forms:
        equal[form] = equal[form] and torch.equal(results[form], results["usual"])
    if done + 1 >= TRIALS:
        kept = [f for f in forms if equal[f]]  # the usual form always
        _CHOICE[key] = min(kept, key=lambda f: (min(times[f]), forms.index(f)))
        del _TRIALS[key]
    return results["usual"]


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_ROWS or torch.is_grad_enabled() or getattr(_usual_only, "on", False):
        return F.linear(x, weight, bias)
    autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    key = (tuple(weight.shape), rows, weight.dtype, autocast)
    choice = _CHOICE.get(key)
    x2 = x.reshape(rows, x.shape[-1])
    if choice is None:
        out = _trial(key, x2, weight, bias)
    else:
        out = _product(choice, x2, weight, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def small_batch_linear(model: torch.nn.Module):
    """Within the `with` block, the model's plain CPU `nn.Linear` layers take their product in the
    fastest of the equal forms for inputs of at most MAX_ROWS rows (gradient mode off only)."""
    return forward_replaced(
        model, _forward, lambda m: type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
    )
