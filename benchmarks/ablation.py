"""Group-aware compute, one switch at a time: update time, peak memory and log-prob agreement.

    .venv/bin/python benchmarks/ablation.py                      # default setting, all variants
    .venv/bin/python benchmarks/ablation.py --long               # 1,024-token prompts, 8 x 64 responses
    .venv/bin/python benchmarks/ablation.py --quick              # smoke test

Every variant runs in its own child process (so peak RSS is its own), in rotated order each
round. A child loads the built-in SmolLM2-135M-Instruct (float32 master weights), builds the same
step (G groups x n samples; the default recipe's few-shot arithmetic prompts, or 1,024-token
prompts with --long; responses of seeded random tokens with lengths spread over [R/2, R]), then
times `PolicyUpdater.update` (forward + backward + AdamW) `--updates` times and keeps the median
of all but the first. It also writes the log-probs of the initial model (`score_all`), which the
parent compares with the naive variant's. The generation variants time `HFEngine.generate` of the
same prompts with and without the one-prefill-per-group cache expansion.

Variants (each turns one thing off, or on, relative to `grouprl`):
  grouprl          shared prefix with the responses of a prompt packed end to end (no padding),
                   the opening all prompts share (system prompt, example turn) run once,
                   LM head at response positions in chunks with a hand-written backward,
                   micro-batches of 16 rows (the recipe's), float32, fused AdamW, lean MLPs,
                   lean RMSNorms, grouped-query attention on unrepeated keys/values,
                   malloc_trim before each backward and at every 5th layer inside it,
                   tied head gradient added into .grad
  no-shared-prefix every row runs prompt + response (what TRL and verl do)
  no-shared-opening  each group's prompt runs whole, the opening all prompts share included
  no-packing       shared prefix, but one padded response per row on the prompt's repeated cache
  autograd-head    the LM head chunks under activation checkpointing with autograd's backward
  full-logits      the [tokens, vocab] logits of a micro-batch materialised at once (no chunks)
  bf16             bf16 autocast (native only on AVX512-BF16/AMX CPUs and CUDA)
  token-budget     micro-batches by a token budget (--budget) instead of a row count
  grad-ckpt        gradient checkpointing, shared prefix kept
  no-lean-mlp      the gated MLPs keep all four intermediate tensors (autograd's own backward)
  no-lean-norm     the RMSNorms keep their normalised input too (autograd's own backward)
  no-lean-attention  keys/values repeated per query head, a float mask made in every layer
  no-trim          no malloc_trim at all (freed activations stay resident in the heap)
  trim-outside-backward  malloc_trim before each backward only, not at every 5th layer inside it
  mmap-1mib        malloc blocks of 1 MiB and more mmapped during the update (lowest peak)
  naive            all of the above off: full sequences, full logits, no lean layers (TRL-like)
  gen-shared / gen-repeat   generation with one prefill per group vs n copies
  gen-plain-decode generation without the measured product form and the roomy KV cache
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "grouprl": {},
    "no-shared-prefix": {"shared_prefix": False},
    "no-shared-opening": {"shared_opening": False},
    "no-packing": {"pack": False},
    "autograd-head": {"autograd_head": True},
    "full-logits": {"full_logits": True},
    "bf16": {"dtype": "bfloat16"},
    "token-budget": {"token_budget": True},
    "grad-ckpt": {"grad_ckpt": True},
    "no-lean-mlp": {"lean_mlp": False},
    "no-lean-norm": {"lean_norm": False},
    "no-lean-attention": {"lean_attention": False},
    "no-trim": {"malloc_trim": False},
    "trim-outside-backward": {"trim_every_layers": 0},
    "mmap-1mib": {"mmap_threshold_kb": 1024},
    "naive": {
        "shared_prefix": False,
        "full_logits": True,
        "lean_mlp": False,
        "lean_norm": False,
        "lean_attention": False,
        "malloc_trim": False,
    },
    "gen-shared": {"generate": True},
    "gen-repeat": {"generate": True, "share_prompt_prefill": False},
    "gen-plain-decode": {"generate": True, "plain_decode": True},
}
GIB = 1024**3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--updates", type=int, default=3, help="timed updates per child (the first is warm-up)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--n-agent", type=int, default=8)
    p.add_argument("--response-tokens", type=int, default=48)
    p.add_argument("--micro-batch-size", type=int, default=16, help="rows per micro-batch (the recipe's)")
    p.add_argument(
        "--budget", type=int, default=0, help="token budget (default: the average 8-row micro-batch)"
    )
    p.add_argument("--long", action="store_true", help="1,024-token prompts, 8 x 64 responses, 2 groups")
    p.add_argument("--variants", default="", help="comma-separated subset")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 round, 2 updates, 2 x 2 rows")
    p.add_argument("--out", type=Path, default=None, help="write the summary as JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.long:
        args.groups, args.response_tokens = 2, 64
        args.prompt_tokens = 1024
    else:
        args.prompt_tokens = 0  # the recipe's prompts
    if args.quick:
        args.rounds, args.updates, args.groups, args.n_agent, args.response_tokens = 1, 2, 2, 2, 8
    return args


# ---------------------------------------------------------------------------------- child
def build_step(args, tokenizer, vocab_size: int):
    """Prompts (token ids) and response tensors, deterministic."""
    import torch

    from grouprl.data import encode_prompt, make_task
    from grouprl.data.sample import Sample
    from grouprl.rollout.trajectory import Trajectory
    from grouprl.trainer.update import build_step_tensors

    samples = make_task("arithmetic", args.groups, seed=7, split="train")
    prompts = [encode_prompt(tokenizer, s.messages) for s in samples]
    if args.prompt_tokens:  # long prompts: the few-shot prompt's text repeated, cut to length
        prompts = [(p * (args.prompt_tokens // len(p) + 1))[: args.prompt_tokens] for p in prompts]
    gen = torch.Generator().manual_seed(0)
    r = args.response_tokens
    trajectories, advantages = [], []
    for sample, prompt in zip(samples, prompts):
        for j in range(args.n_agent):
            length = int(torch.randint(max(r // 2, 1), r + 1, (1,), generator=gen))
            response = torch.randint(3, vocab_size, (length,), generator=gen).tolist()
            advantages.append(float(torch.randn((), generator=gen)))
            trajectories.append(
                Trajectory(
                    sample=Sample(uid=sample.uid, messages=sample.messages),
                    index=j,
                    prompt_ids=prompt,
                    response_ids=response,
                    loss_mask=[1] * length,
                )
            )
    return prompts, build_step_tensors(trajectories, "cpu", mask_truncated=False, pad_token_id=0, advantages=advantages)


def full_logits_stats(hidden, targets, head, *, temperature=1.0, with_entropy=False, chunk_size=256):
    """The LM head over all positions of the micro-batch at once, no recomputation."""
    from grouprl.trainer.head_stats import _token_stats

    return _token_stats(hidden, targets, head, temperature, with_entropy)


def run_child(args) -> dict:
    import torch

    from grouprl.config import ActorConfig, ModelConfig, OptimConfig
    from grouprl.rollout.engines.hf import HFEngine, SamplingParams
    from grouprl.trainer import head_stats, logprobs
    from grouprl.trainer.models import (
        load_causal_lm,
        load_tokenizer,
        resolve_compute_dtype,
        resolve_model_path,
    )
    from grouprl.trainer.optim import build_optimizer, build_scheduler
    from grouprl.trainer.update import PolicyUpdater

    v = VARIANTS[args.child]
    torch.manual_seed(0)
    model_cfg = ModelConfig(
        path="builtin:smollm2-135m-instruct", dtype="float32", gradient_checkpointing=bool(v.get("grad_ckpt"))
    )
    path = resolve_model_path(model_cfg)
    tokenizer = load_tokenizer(model_cfg, path)
    model = load_causal_lm(model_cfg, path, torch.device("cpu"), torch.float32)
    prompts, tensors = build_step(args, tokenizer, model.config.vocab_size)
    out: dict = {"variant": args.child}

    if v.get("generate"):
        if v.get("plain_decode"):
            import contextlib

            from grouprl.rollout.engines import hf as hf_engine

            hf_engine.cpu.fast_decode = lambda model: contextlib.nullcontext()
            hf_engine._reserve_room = lambda cache, room: None
        engine = HFEngine(model, tokenizer, share_prompt_prefill=v.get("share_prompt_prefill", True))
        params = SamplingParams(max_new_tokens=args.response_tokens, temperature=0.7)
        times = []
        for k in range(args.updates):
            gen = torch.Generator().manual_seed(k)
            t0 = time.perf_counter()
            engine.generate(prompts, args.n_agent, params, gen)
            times.append(time.perf_counter() - t0)
        out["time"] = times
    else:
        if v.get("full_logits"):
            logprobs.chunked_token_stats = full_logits_stats  # the module-level name the paths call
        if v.get("pack") is False:
            logprobs.PACK_TOKENS = 0
        if v.get("autograd_head"):
            head_stats._plain_linear = lambda head: False  # the checkpointed-chunk path
        rows_per_micro = args.micro_batch_size
        budget = 0
        if v.get("token_budget"):
            mean_response = float(tensors.response_mask.sum(-1).float().mean())
            budget = args.budget or int(len(prompts[0]) + rows_per_micro * mean_response)
            out["budget"] = budget
        actor = ActorConfig(
            policy_loss="gspo",
            clip_low=3e-4,
            clip_high=4e-4,
            loss_agg_mode="seq-mean-token-mean",
            micro_batch_size=rows_per_micro,
            micro_batch_tokens=budget,
            shared_prefix=v.get("shared_prefix", True),
            shared_opening=v.get("shared_opening", True),
            lean_mlp=v.get("lean_mlp", True),
            lean_norm=v.get("lean_norm", True),
            lean_attention=v.get("lean_attention", True),
            update_malloc_trim=v.get("malloc_trim", True),
            update_trim_every_layers=v.get("trim_every_layers", 5),
            update_mmap_threshold_kb=v.get("mmap_threshold_kb", 0),
            optim=OptimConfig(lr=1e-7),
        )
        compute = resolve_compute_dtype(v.get("dtype", "float32"), torch.device("cpu"), torch.float32)
        updater = PolicyUpdater(actor, temperature=1.0, pad_token_id=0, compute_dtype=compute)
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            model.eval()
            lp = updater.score_all(model, tensors)
        torch.save(lp.float(), args.child_out + ".lp.pt")
        optimizer = build_optimizer(params, actor.optim)
        scheduler = build_scheduler(optimizer, actor.optim, args.updates)
        times = []
        for _ in range(args.updates):
            t0 = time.perf_counter()
            updater.update(model, optimizer, scheduler, tensors, args.groups, params)
            times.append(time.perf_counter() - t0)
        out["time"] = times
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    out["prompt_tokens"] = len(prompts[0])
    out["response_tokens_mean"] = float(tensors.response_mask.sum(-1).float().mean())
    return out


# ---------------------------------------------------------------------------------- parent
def main() -> None:
    args = parse_args()
    if args.child:
        result = run_child(args)
        Path(args.child_out).write_text(json.dumps(result))
        return
    names = [n for n in (args.variants.split(",") if args.variants else VARIANTS) if n]
    if args.long and not args.variants:
        names = ["grouprl", "no-shared-prefix", "naive"]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        sys.exit(f"unknown variant(s): {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    records: dict[str, list[dict]] = {n: [] for n in names}
    passthrough = (
        [
            f"--groups={args.groups}",
            f"--n-agent={args.n_agent}",
            f"--response-tokens={args.response_tokens}",
            f"--micro-batch-size={args.micro_batch_size}",
            f"--updates={args.updates}",
            f"--budget={args.budget}",
        ]
        + (["--long"] if args.long else [])
        + (["--quick"] if args.quick else [])
    )
    tmp = tempfile.mkdtemp(prefix="grouprl-ablation-")
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no variant always first
        for name in order:
            out = os.path.join(tmp, f"{name}-{r}.json")
            cmd = [sys.executable, __file__, f"--child={name}", f"--child-out={out}", *passthrough]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            result = json.loads(Path(out).read_text())
            result["lp_path"] = out + ".lp.pt"
            records[name].append(result)
            print(
                f"round {r + 1} {name:17s} {statistics.median(result['time'][1:] or result['time']):7.2f} s "
                f"(child {time.perf_counter() - t0:.0f} s), peak RSS {result['peak_rss_gib']:.2f} GiB",
                flush=True,
            )
    summarise(args, records)


def summarise(args, records: dict[str, list[dict]]) -> None:
    import torch

    def median_time(name: str) -> float:
        return statistics.median(t for rec in records[name] for t in (rec["time"][1:] or rec["time"]))

    reference = "naive" if "naive" in records else None
    ref_lp = torch.load(records[reference][0]["lp_path"]) if reference else None
    base = "grouprl" if "grouprl" in records else None
    first = next(iter(records.values()))[0]
    print()
    print(
        f"setting: {args.groups} groups x {args.n_agent} samples, prompt {first['prompt_tokens']} tokens, "
        f"responses {first['response_tokens_mean']:.1f} tokens on average; {platform.machine()}, "
        f"{os.cpu_count()} cores; medians over {args.rounds} round(s) x {max(args.updates - 1, 1)} update(s)"
    )
    print()
    print("| variant | time (s) | vs grouprl | peak RSS (GiB) | max abs log-prob diff vs naive |")
    print("|---|---:|---:|---:|---:|")
    summary = {}
    for name in records:
        t = median_time(name)
        rss = max(rec["peak_rss_gib"] for rec in records[name])
        ratio = t / median_time(base) if base and not name.startswith("gen-") else float("nan")
        diff = ""
        if ref_lp is not None and not name.startswith("gen-"):
            diff = f"{float((torch.load(records[name][0]['lp_path']) - ref_lp).abs().max()):.1e}"
        print(f"| {name} | {t:.2f} | {ratio:.2f} | {rss:.2f} | {diff} |")
        summary[name] = {"time_s": t, "ratio": ratio, "peak_rss_gib": rss, "max_lp_diff": diff}
    if "gen-shared" in records and "gen-repeat" in records:
        print(
            f"\ngeneration, one prefill per group / n prefills: {median_time('gen-shared') / median_time('gen-repeat'):.2f}"
        )
    if "gen-shared" in records and "gen-plain-decode" in records:
        print(
            "generation, measured product form + roomy cache / plain decode: "
            f"{median_time('gen-shared') / median_time('gen-plain-decode'):.2f}"
        )
    if "grouprl" in records and "no-shared-prefix" in records:
        print(
            f"update, shared / naive prefix: {median_time('grouprl') / median_time('no-shared-prefix'):.2f}"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}, indent=2)
        )


if __name__ == "__main__":
    main()
