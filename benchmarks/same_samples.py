"""How often a sample's tokens depend on the batch it was computed in, on the built-in engine.

    .venv/bin/python benchmarks/same_samples.py                 # SmolLM2-135M, float32, 5 seeds
    .venv/bin/python benchmarks/same_samples.py --dtype bfloat16 --seeds 3

Every row draws from its own random stream (`RowStreams`), so two runs of the same rows differ
only where the floats a row's logits come from differ: a CPU BLAS may sum a product in another
order for another row count, and attention runs over the batch's width. Two measurements:

- chunking: the default recipe's first training prompts (4 x 8 samples, its sampling settings),
  the whole batch in one call against one prompt's 8 samples a call (`rollout.gen_batch_size=1`);
- schedules: the agent loop (4 prompts x 4 samples, at most 4 turns of 48 tokens, temperature
  0.8, a search tool that answers at once) in lock step (`agent.schedule=turn`) against one
  trajectory at a time (`trajectory`: rows join and leave a running batch).

Printed per seed: identical responses (trajectories) out of all, and where the first differing
one parts (its token index); then the totals. Not a speed measurement: any load is fine.
"""

from __future__ import annotations

import argparse
import asyncio

import torch

from grouprl.config import AgentConfig, ModelConfig, load_config
from grouprl.data.sample import Sample
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.engines.hf import HFEngine
from grouprl.rollout.engines.streams import RowStreams, mix_seed
from grouprl.rollout.tools.base import Observation
from grouprl.trainer.models import load_causal_lm, load_tokenizer, resolve_model_path


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Instant:
    name = "search"

    async def __call__(self, argument, state):
        await asyncio.sleep(0)
        return Observation(f"Result for {argument[:40]}: the bridge opened in 1932.")


def chunking(engine, tokenizer, seed: int) -> tuple[int, int, list[int]]:
    from grouprl.cli import DEFAULT_RECIPE
    from grouprl.data.prompts import encode_prompt
    from grouprl.data.tasks.arithmetic import make_arithmetic

    cfg = load_config(DEFAULT_RECIPE, ["actor.dtype=float32"])
    samples = make_arithmetic(cfg.data.train_batch_size, seed)
    prompts = [encode_prompt(tokenizer, s.messages) for s in samples]
    n = cfg.rollout.n_agent
    from grouprl.rollout.engines.base import SamplingParams

    r = cfg.rollout
    params = SamplingParams(max_new_tokens=r.max_response_length, temperature=r.temperature, stop=list(r.stop))
    rows = range(len(prompts) * n)
    whole = engine.generate(prompts, n, params, RowStreams(mix_seed(seed, 1, 0), rows))
    engine.max_batch = n  # one prompt's n samples a call
    apart = engine.generate(prompts, n, params, RowStreams(mix_seed(seed, 1, 0), rows))
    engine.max_batch = 0
    same = sum(a.token_ids == b.token_ids for a, b in zip(whole, apart))
    parts = [first_difference(a.token_ids, b.token_ids) for a, b in zip(whole, apart) if a.token_ids != b.token_ids]
    return same, len(whole), parts


def schedules(engine, tokenizer, seed: int) -> tuple[int, int, list[int]]:
    from grouprl.rollout.engines.base import SamplingParams

    samples = [Sample(uid=f"q{g}", messages=[{"role": "user", "content": f"Question {g}: when did bridge {g} open?"}])
               for g in range(4)]  # fmt: skip
    params = SamplingParams(max_new_tokens=48, temperature=0.8)
    out = {}
    for schedule in ("turn", "trajectory"):
        cfg = AgentConfig(enabled=True, schedule=schedule, max_turns=4, tools=["search"], answer_generator="none")
        loop = AgentLoop(engine, tokenizer, {"search": Instant()}, cfg)
        out[schedule] = loop.run(samples, loop.encode_prompts(samples), 4, params, RowStreams(seed, range(16)))
    pairs = list(zip(out["turn"], out["trajectory"]))
    same = sum(a.response_ids == b.response_ids for a, b in pairs)
    parts = [first_difference(a.response_ids, b.response_ids) for a, b in pairs if a.response_ids != b.response_ids]
    return same, len(pairs), parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--only", choices=["chunking", "schedules"], default=None)
    args = p.parse_args()
    path = resolve_model_path(ModelConfig(path="builtin:smollm2-135m-instruct"))
    tokenizer = load_tokenizer(ModelConfig(path=path), path)
    model = load_causal_lm(ModelConfig(path=path), path, torch.device("cpu"), getattr(torch, args.dtype)).eval()
    engine = HFEngine(model, tokenizer)
    print(f"SmolLM2-135M, {args.dtype}, {torch.get_num_threads()} threads")
    for name, measure in (("chunking", chunking), ("schedules", schedules)):
        if args.only not in (None, name):
            continue
        total_same = total = 0
        for seed in range(args.seeds):
            same, count, parts = measure(engine, tokenizer, seed)
            total_same, total = total_same + same, total + count
            print(f"  {name:>9} seed {seed}: {same}/{count} identical" + (f" (first parts at token {sorted(parts)})" if parts else ""), flush=True)
        print(f"{name}: {total_same}/{total} identical ({100 * total_same / total:.1f}%)", flush=True)


if __name__ == "__main__":
    main()
