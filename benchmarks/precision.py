"""Where bf16 autocast spends its time against float32 and bf16 weights: generation on the built-in
engine and one forward + backward of the update, on the default policy (SmolLM2-135M).

    python benchmarks/precision.py                      # CUDA when there is one, else the CPU
    python benchmarks/precision.py --rows 8 --prompts 4 --tokens 64 --rounds 3 --profile

Modes, each on the same prompts and seeds:
- float32: float32 weights, no autocast;
- autocast: float32 weights under bf16 autocast (what `actor.dtype=auto` runs on a GPU);
- bf16 weights: a bfloat16 copy of the model, no autocast (what an engine with its own bf16 copy
  of the weights, e.g. vLLM, computes in).
Per mode: median generation seconds over the rounds (the first round is a warm-up and left out),
milliseconds per decode step, and the update's forward + backward (log-probs of the sampled
tokens, summed) on the generated sequences. `--profile` adds the number of device kernels and
of autocast casts per decode step (torch.profiler) for each mode.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import torch

from grouprl.config import ModelConfig
from grouprl.rollout.engines.base import SamplingParams
from grouprl.rollout.engines.hf import HFEngine
from grouprl.trainer.models import load_causal_lm, load_tokenizer, resolve_model_path, shape_stable_attention

QUESTIONS = [
    "Tom has 7 apples and buys 5 more. How many apples does he have?",
    "A box holds 12 pencils. How many pencils are in 3 boxes?",
    "Sara read 45 pages on Monday and 38 on Tuesday. How many pages did she read?",
    "There are 64 chairs in 8 equal rows. How many chairs are in each row?",
    "A train travels 60 km an hour for 3 hours. How far does it go?",
    "Ben had 50 marbles and gave away 17. How many are left?",
    "A shop sells 9 cakes a day. How many cakes does it sell in a week?",
    "Lia saves 15 dollars a month. How much does she save in 6 months?",
]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def update_pass(model, sequences, prompt_len, device, dtype):
    """Forward + backward of the sampled tokens' summed log-probs (one padded batch)."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, device=device)
        mask[i, : len(s)] = 1
    ctx = (
        torch.autocast(device.type, dtype=dtype)
        if dtype is not None
        else torch.autocast(device.type, enabled=False)
    )
    with ctx:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_len - 1 : -1].float()
    lp = logits.log_softmax(-1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
    loss = -(lp * mask[:, prompt_len:]).sum() / mask[:, prompt_len:].sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def profile_counts(device, fn, decode_steps):
    """Kernels launched and autocast casts (aten::_to_copy) per decode step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        sync(device)
    events = prof.key_averages()
    kernels = sum(
        e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    )
    casts = sum(e.count for e in events if e.key == "aten::_to_copy")
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    return kernels / max(decode_steps, 1), casts / max(decode_steps, 1), ops / max(decode_steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="max new tokens")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per mode (first = warm-up)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape_stable_attention(device)  # as grouprl runs (no cuDNN attention on CUDA)
    cfg = ModelConfig(path=args.model)
    path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(cfg, path)
    base = load_causal_lm(cfg, path, device, torch.float32)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in QUESTIONS[: args.prompts]
    ]
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts
    ]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0)
    bf16_copy = copy.deepcopy(base).to(torch.bfloat16)
    modes = [("float32", base, None), ("autocast", base, torch.bfloat16), ("bf16 weights", bf16_copy, None)]
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"torch {torch.__version__}; {args.prompts} prompts x {args.rows} samples, up to {args.tokens} tokens"
    )
    results = {}
    for round_ in range(args.rounds):  # modes alternate within each round
        for name, model, dtype in modes:
            engine = HFEngine(model, tokenizer, report_log_probs=True)
            gen = torch.Generator(device=device).manual_seed(round_)
            ctx = (lambda d=dtype: torch.autocast(device.type, dtype=d)) if dtype else None

            def generate(engine=engine, gen=gen, ctx=ctx):
                if ctx is None:
                    return engine.generate(prompts, args.rows, params, gen)
                with ctx():
                    return engine.generate(prompts, args.rows, params, gen)

            seconds, outs = timed(device, generate)
            steps = max(len(o.token_ids) for o in outs)
            width = max(len(p) for p in prompts)
            padded = [[tokenizer.pad_token_id or 0] * (width - len(p)) + p for p in prompts]
            sequences = [padded[i // args.rows] + o.token_ids for i, o in enumerate(outs)]
            upd_dtype = torch.bfloat16 if name == "autocast" else None
            upd_model = base if name != "bf16 weights" else bf16_copy
            upd_s, _ = timed(device, functools.partial(update_pass, upd_model, sequences, width, device, upd_dtype))
            if round_:
                r = results.setdefault(name, {"gen": [], "step_ms": [], "update": [], "tokens": []})
                r["gen"].append(seconds)
                r["step_ms"].append(1000 * seconds / max(steps, 1))
                r["update"].append(upd_s)
                r["tokens"].append(statistics.fmean(len(o.token_ids) for o in outs))
    print("| mode | generate s | ms per decode step | update fwd+bwd s | mean response tokens |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {statistics.median(r['gen']):.3f} | {statistics.median(r['step_ms']):.2f} | "
            f"{statistics.median(r['update']):.3f} | {statistics.fmean(r['tokens']):.1f} |"
        )
    if args.profile:
        print("\n| mode | device kernels per decode step | casts per step | aten ops per step |")
        print("|---|---:|---:|---:|")
        for name, model, dtype in modes:
            engine = HFEngine(model, tokenizer, report_log_probs=True)
            fixed = SamplingParams(max_new_tokens=16, temperature=1.0)
            gen = torch.Generator(device=device).manual_seed(0)

            def run(engine=engine, gen=gen, dtype=dtype, fixed=fixed):
                with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    return engine.generate(prompts, args.rows, fixed, gen)

            k, c, o = profile_counts(device, run, 16)
            print(f"| {name} | {k:.0f} | {c:.0f} | {o:.0f} |")
    del bf16_copy, base


if __name__ == "__main__":
    main()
