"""The two rollout engines side by side on the default recipe: `hf` (the built-in decode loop over
the trainer's model) and `vllm` (vLLM in-process, its own copy of the weights pushed after every
update), each in its own environment and a fresh process, alternated.

    .venv/bin/python benchmarks/engines.py                 # SmolLM2-135M, the recipe's 4 x 8, fp32
    .venv/bin/python benchmarks/engines.py --gen-batches 2 --max-new-tokens 128
    .venv/bin/python benchmarks/engines.py --quick         # smoke test

Needs both environments (`make setup setup-vllm`). vLLM's CPU build pins another transformers
(`.venv-vllm`), and once loaded it binds the process's threads, so the two engines cannot share a
process fairly: each round starts one child per engine (hf in `.venv`, vllm in `.venv-vllm`; the
first engine flips every round). A child builds a trainer of the default recipe (same seed, same
weights), then measures:

- generation: the recipe's first `--batch x --gen-batches` training prompts through
  `engine.generate`, n samples each, with the recipe's sampling settings (or `--max-new-tokens`
  without stop strings), after a warm-up call: generated tokens/s, and tokens/s counting the
  prompts' n-fold prefill;
- steps: `--steps` whole training steps (`train_step`), the first left out as warm-up: step
  time, generation, update, the weight push into the engine (`time/weight_sync`), and the
  trainer-vs-engine log-prob mismatch of vLLM's samples.

Printed: each child's figures, then medians over rounds with the ratio vllm / hf (above 1 is
faster for tokens/s, below 1 for times).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "RESULT "
ENGINES = ("hf", "vllm")


def child(args) -> None:
    """One engine in this process: build, warm up, measure; one JSON line on stdout."""
    import torch

    from grouprl.cli import DEFAULT_RECIPE
    from grouprl.config import load_config
    from grouprl.rollout.engines.base import SamplingParams
    from grouprl.trainer.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"rollout.engine={args.child}",
            f"trainer.output_dir={out}",
            f"data.train_batch_size={args.batch}",
            f"rollout.n_agent={args.n}",
            "trainer.total_steps=1000",
            "actor.dtype=float32",
            "rollout.kv_cache_gb=1",
            "rollout.max_model_len=512",
        ]
        if args.model:
            overrides.append(f"model.path={args.model}")
        t0 = time.perf_counter()
        trainer = Trainer(load_config(DEFAULT_RECIPE, overrides))
        start_up = time.perf_counter() - t0
        prompts = trainer.parts.collect.train_prompts[: args.batch * args.gen_batches]
        params = trainer.collector.sampling_params()
        if args.max_new_tokens:
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=params.temperature)

        def generate(batch, seed):
            start = time.perf_counter()
            out = trainer.parts.collect.engine.generate(batch, args.n, params, torch.Generator().manual_seed(seed))
            return time.perf_counter() - start, sum(len(g.token_ids) for g in out)

        generate(prompts[:2], 0)  # warm-up: first calls, kernels, first batch shapes
        seconds, generated = generate(prompts, 100 + args.round)
        fed = generated + sum(len(p) for p in prompts) * args.n
        steps = [trainer.train_step()[0] for _ in range(args.steps)]
        if trainer.parts.collect.streaming is not None:
            trainer.parts.collect.streaming.close()
        trainer.parts.collect.reward.close()
    kept = steps[1:] or steps
    keys = ["time/step", "time/generate", "time/update", "time/weight_sync", "perf/tokens_per_s",
            "rollout/mismatch_mean", "rollout/mismatch_max"]
    result = {
        "engine": args.child,
        "start_up": start_up,
        "gen_seconds": seconds,
        "generated": generated,
        "gen_tokens_per_s": generated / seconds,
        "tokens_per_s": fed / seconds,
        "prompt_tokens": statistics.mean(len(p) for p in prompts),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **{k: statistics.median(m[k] for m in kept) for k in keys if all(k in m for m in kept)},
        "rewards": [m["reward/mean"] for m in steps],
    }
    print(MARK + json.dumps(result), flush=True)


def run_child(engine: str, round_index: int, args) -> dict:
    python = args.hf_python if engine == "hf" else args.vllm_python
    command = [python, str(Path(__file__).resolve()), "--child", engine, "--round", str(round_index),
               "--batch", str(args.batch), "--n", str(args.n), "--gen-batches", str(args.gen_batches),
               "--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.steps)]
    if args.model:
        command += ["--model", args.model]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
    if done.returncode != 0 or not lines:
        sys.exit(f"{engine} child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="model.path (default: the recipe's SmolLM2-135M)")
    p.add_argument("--batch", type=int, default=4, help="prompts per step (the recipe's 4)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the recipe's 8)")
    p.add_argument("--gen-batches", type=int, default=4, help="generation part: prompts, as multiples of --batch")
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help="generation part: this many tokens, no stop strings (0 = the recipe's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="training steps per child (the first is warm-up)")
    p.add_argument("--hf-python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--quick", action="store_true", help="1 round, 1 step, 2 x 2 samples")
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.batch, args.n, args.gen_batches = 1, 1, 2, 2, 1
    if args.child:
        child(args)
        return

    print(f"batch={args.batch} n={args.n} gen prompts={args.batch * args.gen_batches} "
          f"max_new_tokens={args.max_new_tokens or 'recipe'} steps/child={args.steps} python={platform.python_version()}")
    results: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for r in range(args.rounds):
        for e in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            x = run_child(e, r, args)
            results[e].append(x)
            print(
                f"round {r} {e:5s} start-up {x['start_up']:5.1f} s  gen {x['gen_seconds']:6.2f} s "
                f"({x['generated']} tokens, {x['gen_tokens_per_s']:6.1f} tok/s, with prefill {x['tokens_per_s']:7.1f})  "
                f"step {x['time/step']:6.2f}  generate {x['time/generate']:5.2f}  update {x['time/update']:5.2f}  "
                f"push {x['time/weight_sync']:5.3f}  threads {x['threads']}  rewards {[round(v, 3) for v in x['rewards']]}",
                flush=True,
            )
    print("\nmedians over rounds (ratio vllm / hf)")
    for key in ("start_up", "gen_tokens_per_s", "tokens_per_s", "time/step", "time/generate", "time/update",
                "time/weight_sync", "perf/tokens_per_s"):
        b, a = (statistics.median(x[key] for x in results[e]) for e in ENGINES)
        print(f"{key:18s} hf {b:9.3f}  vllm {a:9.3f}  ratio {a / b if b else float('inf'):6.2f}")
    mm = [x["rollout/mismatch_max"] for x in results["vllm"] if "rollout/mismatch_max" in x]
    if mm:
        print(f"vllm: trainer-vs-engine log-prob difference, largest over the measured steps {max(mm):.2e}")


if __name__ == "__main__":
    main()
