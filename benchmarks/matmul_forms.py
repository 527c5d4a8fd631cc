"""A decode step's matrix products on SmolLM2-135M's shapes, per form of the product.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/matmul_forms.py

Per row count: the milliseconds of one decode step's products (30 layers: q/o, k/v, gate/up,
down; then the vocabulary head) in the usual form, with the transposed form where it is faster
(what a choice by timing alone takes), and with the sliced head (what `cpu/small_matmul.py` may
take where its numbers are bitwise the usual one's); and the row counts where the transposed
form's numbers differ. Random float32 weights, best of 15 calls each; run it on an idle machine.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from grouprl.cpu.small_matmul import _sliced_product, _transposed_product

# (out, in) -> products of that shape per decode step
SHAPES = {(576, 576): 60, (192, 576): 60, (1536, 576): 60, (576, 1536): 30, (49152, 576): 1}


def best(product, x, w, n: int = 15) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        product(x, w, None)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads; ms per decode step's products, float32")
    for rows in (2, 4, 8, 11, 16, 32):
        usual = transposed = sliced = 0.0
        differs = False
        for shape, count in SHAPES.items():
            w, x = torch.randn(shape) * 0.02, torch.randn(rows, shape[1])
            u = best(F.linear, x, w)
            usual += u * count
            transposed += min(u, best(_transposed_product, x, w)) * count
            sliced += (min(u, best(_sliced_product, x, w)) if shape[0] >= 4096 else u) * count
            differs |= not torch.equal(F.linear(x, w), _transposed_product(x, w, None))
        print(f"rows {rows:3d}: usual {usual * 1e3:7.2f}  transposed where faster {transposed * 1e3:7.2f}  "
              f"sliced head {sliced * 1e3:7.2f}  transposed bitwise equal: {not differs}")  # fmt: skip


if __name__ == "__main__":
    main()
