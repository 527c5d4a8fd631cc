"""What a new batch shape costs with and without cuDNN's fused attention, on a random model of
SmolLM2-135M's shape (no weights needed): decode steps over a growing cache and one forward +
backward per new sequence length, as RL's micro-batches have, in float32 and in bf16 autocast.

    python benchmarks/attention_shapes.py            # on CUDA (on a CPU: a 2-layer model, plumbing only)

Each line: milliseconds per decode step (two passes of 40 steps: the first meets every cache
length for the first time) and seconds per update at four new lengths, then at two lengths seen
before. grouprl leaves cuDNN's attention out on CUDA (`trainer.models.shape_stable_attention`);
the `cudnn` lines show why.
"""

from __future__ import annotations

import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = 32


def model():
    full = DEVICE == "cuda"
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576 if full else 64, intermediate_size=1536 if full else 128,
        num_hidden_layers=30 if full else 2, num_attention_heads=9 if full else 2,
        num_key_value_heads=3 if full else 1, head_dim=64 if full else 32, tie_word_embeddings=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to(DEVICE)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def precision(mode):
    return torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=mode == "autocast")


def batch(length):
    ids = torch.randint(0, 49152, (ROWS, length), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[: ROWS // 2, :7] = 0  # left padding on half the rows, as a group batch has
    return ids, mask


def decode_ms(m, mode, steps=40):
    ids, mask = batch(60)
    with torch.no_grad(), precision(mode):
        out = m(input_ids=ids, attention_mask=mask, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1)
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones((ROWS, 1))], -1)
            out = m(input_ids=token[:, None], attention_mask=mask, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1)
            token.tolist()  # the engine reads each step's tokens
        sync()
    return 1000 * (time.perf_counter() - start) / steps


def update_s(m, mode, length):
    ids, mask = batch(length)
    sync()
    start = time.perf_counter()
    with precision(mode):
        logits = m(input_ids=ids, attention_mask=mask).logits
    logits.float().logsumexp(-1).mean().backward()
    m.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def main():
    m = model()
    cudnn = torch.backends.cudnn.version() if DEVICE == "cuda" else None
    print(f"{DEVICE}, torch {torch.__version__}, cuDNN {cudnn}; {ROWS} rows")
    decode_ms(m, "float32", 3)
    update_s(m, "float32", 50)  # warm-up
    kernels = {
        "cudnn": [
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ],
        "no cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    }
    for name, allowed in kernels.items():
        for mode in ("float32", "autocast"):
            with sdpa_kernel(allowed, set_priority=True):
                first, second = decode_ms(m, mode), decode_ms(m, mode)
                updates = [update_s(m, mode, n) for n in (90, 97, 103, 110, 90, 97)]
            new = " ".join(f"{u:.3f}" for u in updates[:4])
            print(
                f"{name:8s} {mode:8s} decode ms/step {first:.1f} then {second:.1f} | "
                f"update s, new lengths {new} | seen lengths {updates[4]:.3f} {updates[5]:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
