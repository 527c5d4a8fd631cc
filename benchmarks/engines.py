"""The two rollout engines side by side: `hf` (the built-in decode loop over the trainer's model)
and `vllm` (vLLM in-process, its own copy of the weights pushed after every update), alternated
in one process on the default recipe.

    .venv-vllm/bin/python benchmarks/engines.py                  # SmolLM2-135M, the recipe's 4 x 8, fp32
    .venv-vllm/bin/python benchmarks/engines.py --gen-batches 16 --max-new-tokens 128
    .venv-vllm/bin/python benchmarks/engines.py --quick          # smoke test

Runs in the vLLM environment (`make setup-vllm`). Two trainers of the default recipe are built,
one per engine, from the same seed and weights. Two parts, each alternating the engines (the
first engine of a round flips every round), medians over rounds:

- generation: the same prompts (the recipe's training prompts, `--gen-batches` of them) through
  `engine.generate` with the recipe's sampling settings (or `--max-new-tokens` without stop
  strings): generated tokens/s and tokens/s counting the prompts' n-fold prefill;
- steps: whole training steps (`train_step`): step time, generation, update, the weight push
  into the engine (`time/weight_sync`), and the trainer-vs-engine log-prob mismatch that vLLM's
  samples come with.

Ratios are vllm / hf (above 1 is faster for tokens/s, below 1 for times).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch

from grouprl.cli import DEFAULT_RECIPE
from grouprl.config import load_config
from grouprl.rollout.engines.base import SamplingParams
from grouprl.trainer.trainer import Trainer

ENGINES = ("hf", "vllm")


def build(engine: str, out: str, args) -> Trainer:
    overrides = [
        f"rollout.engine={engine}",
        f"trainer.output_dir={out}",
        f"trainer.experiment_name={engine}",
        f"data.train_batch_size={args.batch}",
        f"rollout.n_agent={args.n}",
        "trainer.total_steps=1000",
        "actor.dtype=float32",
        "rollout.kv_cache_gb=1",
        "rollout.max_model_len=512",
    ]
    if args.model:
        overrides.append(f"model.path={args.model}")
    return Trainer(load_config(DEFAULT_RECIPE, overrides))


def generation(trainer: Trainer, prompts, args, seed: int) -> dict:
    params = trainer.sampling_params()
    if args.max_new_tokens:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=params.temperature)
    start = time.perf_counter()
    out = trainer.engine.generate(prompts, args.n, params, torch.Generator().manual_seed(seed))
    seconds = time.perf_counter() - start
    generated = sum(len(g.token_ids) for g in out)
    fed = generated + sum(len(p) for p in prompts) * args.n
    return {"seconds": seconds, "gen_tokens_per_s": generated / seconds, "tokens_per_s": fed / seconds,
            "generated": generated}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="model.path (default: the recipe's SmolLM2-135M)")
    p.add_argument("--batch", type=int, default=4, help="prompts per step (the recipe's 4)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the recipe's 8)")
    p.add_argument("--gen-batches", type=int, default=4, help="prompts per generation call, as multiples of --batch")
    p.add_argument("--max-new-tokens", type=int, default=0, help="generation part: this many tokens, no stop strings (0 = the recipe's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="training steps per engine per round")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--quick", action="store_true", help="1 round, 1 step, 2 x 2 samples")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.batch, args.n, args.gen_batches = 1, 1, 2, 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        trainers = {e: build(e, out, args) for e in ENGINES}
        print(f"built both trainers in {time.perf_counter() - t0:.1f} s")
        prompts = trainers["hf"].train_prompts[: args.batch * args.gen_batches]
        print(
            f"threads={torch.get_num_threads()} prompts={len(prompts)} n={args.n} "
            f"max_new_tokens={args.max_new_tokens or trainers['hf'].cfg.rollout.max_response_length} "
            f"mean prompt tokens={statistics.mean(len(x) for x in prompts):.0f} "
            f"python={platform.python_version()} torch={torch.__version__}"
        )
        for e in ENGINES:  # warm-up: first calls, kernels, vLLM's first batch shapes
            generation(trainers[e], prompts[:2], args, seed=0)

        gen: dict[str, list[dict]] = {e: [] for e in ENGINES}
        for r in range(args.rounds):
            for e in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                g = generation(trainers[e], prompts, args, seed=100 + r)
                gen[e].append(g)
                print(f"gen round {r} {e:5s} {g['seconds']:7.2f} s  generated {g['generated']:6d}  "
                      f"gen tokens/s {g['gen_tokens_per_s']:8.1f}  tokens/s {g['tokens_per_s']:8.1f}")

        steps: dict[str, list[dict]] = {e: [] for e in ENGINES}
        for r in range(args.rounds):
            for e in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                for _ in range(args.steps):
                    m, _ = trainers[e].train_step()
                    steps[e].append(m)
                    print(
                        f"step {trainers[e].step:3d} {e:5s} step {m['time/step']:6.2f} s  generate {m['time/generate']:6.2f}  "
                        f"update {m['time/update']:6.2f}  old log-probs {m['time/old_ref_log_probs']:5.2f}  "
                        f"push {m['time/weight_sync']:6.3f}  reward {m['reward/mean']:.3f}"
                        + (f"  mismatch mean {m['rollout/mismatch_mean']:.2e} max {m['rollout/mismatch_max']:.2e}"
                           if "rollout/mismatch_mean" in m else "")
                    )

    print("\nmedians (vllm / hf)")
    for key in ("seconds", "gen_tokens_per_s", "tokens_per_s"):
        a, b = (statistics.median(g[key] for g in gen[e]) for e in ("vllm", "hf"))
        print(f"generation {key:22s} hf {b:9.2f}  vllm {a:9.2f}  ratio {a / b:5.2f}")
    for key in ("time/step", "time/generate", "time/update", "time/old_ref_log_probs", "time/weight_sync",
                "perf/tokens_per_s"):
        a, b = (statistics.median(m[key] for m in steps[e]) for e in ("vllm", "hf"))
        print(f"step       {key:22s} hf {b:9.3f}  vllm {a:9.3f}  ratio {a / max(b, 1e-9):5.2f}")
    mm = [m["rollout/mismatch_max"] for m in steps["vllm"]]
    print(f"vllm log-prob mismatch (trainer vs engine), max over steps: {max(mm):.2e}; "
          f"mean of step means {statistics.mean(m['rollout/mismatch_mean'] for m in steps['vllm']):.2e}")


if __name__ == "__main__":
    main()
