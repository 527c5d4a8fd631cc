"""The agent loop with and without KV reuse across turns: turns/s, generated tokens/s and
tokens fed to the model, alternated A/B in one process.

    .venv/bin/python benchmarks/agent_loop.py                       # SmolLM2-135M (built in), fp32
    .venv/bin/python benchmarks/agent_loop.py --model tiny --quick  # tiny random model, smoke test

Both sides run the same `AgentLoop` on the same prompts with greedy decoding; only
`agent.reuse_kv_cache` differs. The search tool is a fake that returns observations of a fixed
token length, so every turn's observation costs the same; the policy's own text decides its
actions (turns with no valid action get the corrective observation, also a fixed text). Each round runs both sides (reuse first on even rounds); printed figures are
medians over rounds, with the ratio reuse / re-prefill, and a check that both sides produced
the same token ids. The frozen answer generator is a stub that returns a fixed answer: its
cost does not depend on KV reuse.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

import torch

from grouprl.config import AgentConfig, ModelConfig
from grouprl.data.sample import Sample
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.answer import AnswerResult
from grouprl.rollout.engines.hf import HFEngine, SamplingParams
from grouprl.rollout.tools.base import Observation

QUESTIONS = [
    "In which year was the Eiffel Tower completed?",
    "Who painted the ceiling of the Sistine Chapel?",
    "What is the tallest mountain in Africa?",
    "Which river flows through Vienna?",
    "What is the chemical symbol of tungsten?",
    "Who wrote the novel Middlemarch?",
    "How many moons does Mars have?",
    "What is the capital of Australia?",
]


class FixedLengthSearch:
    """Returns `length` tokens of filler text per query, after `latency` seconds."""

    name = "search"

    def __init__(self, tokenizer, length: int, latency: float):
        words = " ".join(f"passage{i}" for i in range(4 * length))
        ids = tokenizer(words, add_special_tokens=False)["input_ids"][:length]
        self.text = tokenizer.decode(ids)
        self.latency = latency

    async def __call__(self, argument, state):
        await asyncio.sleep(self.latency)
        state.add_hits([{"id": f"doc{state.turn}", "score": 1.0, "text": ""}])
        return Observation(self.text)


class FixedAnswer:
    async def answer(self, requests):
        return [AnswerResult("<answer>-</answer>") for _ in requests]


def load_policy(name: str, device: torch.device):
    if name == "tiny":
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from helpers import tiny_model_and_tokenizer

        model, tokenizer = tiny_model_and_tokenizer()
        return model.to(device), tokenizer
    from grouprl.trainer.models import load_causal_lm, load_tokenizer, resolve_model_path

    cfg = ModelConfig(path="builtin:smollm2-135m-instruct" if name == "builtin" else name)
    path = resolve_model_path(cfg)
    return load_causal_lm(cfg, path, device, torch.float32).eval(), load_tokenizer(cfg, path)


def run_side(loop: AgentLoop, samples, prompts, args) -> dict:
    engine = loop.engine
    prefill0, decode0 = engine.prefill_tokens, engine.decode_tokens
    params = SamplingParams(max_new_tokens=args.turn_tokens, temperature=0.0)
    start = time.perf_counter()
    trajectories = loop.run(samples, prompts, args.n, params)
    seconds = time.perf_counter() - start
    turns = sum(sum(1 for r in t.turns if r["tokens"]) for t in trajectories)
    generated = sum(t.num_policy_tokens for t in trajectories)
    return {
        "seconds": seconds,
        "turns_per_s": turns / seconds,
        "tokens_per_s": generated / seconds,
        "turns": turns,
        "generated": generated,
        "prefill_tokens": engine.prefill_tokens - prefill0,
        "decode_tokens": engine.decode_tokens - decode0,
        "ids": [t.response_ids for t in trajectories],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin", help="builtin (SmolLM2-135M), tiny, or a model folder")
    p.add_argument("--batch", type=int, default=4, help="prompts")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--turns", type=int, default=5, help="agent.max_turns")
    p.add_argument("--turn-tokens", type=int, default=32, help="most tokens generated per turn")
    p.add_argument("--obs-tokens", type=int, default=128, help="tokens per search observation")
    p.add_argument("--latency", type=float, default=0.0, help="seconds each search call waits")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--quick", action="store_true", help="1 round, 2 x 2 samples, 3 turns of 8 tokens")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.batch, args.n, args.turns, args.turn_tokens = 1, 2, 2, 3, 8
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    model, tokenizer = load_policy(args.model, device)
    samples = [
        Sample(uid=f"q{i}", messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(args.batch)
    ]
    tools = {"search": FixedLengthSearch(tokenizer, args.obs_tokens, args.latency)}
    loops = {}
    for reuse in (True, False):
        cfg = AgentConfig(max_turns=args.turns, reuse_kv_cache=reuse, max_observation_tokens=0)
        loops[reuse] = AgentLoop(HFEngine(model, tokenizer), tokenizer, tools, cfg, FixedAnswer())
    prompts = loops[True].encode_prompts(samples)

    print(
        f"model={args.model} device={device} threads={torch.get_num_threads()} batch={args.batch} n={args.n} "
        f"turns={args.turns} turn_tokens={args.turn_tokens} obs_tokens={args.obs_tokens} "
        f"prompt_tokens={[len(x) for x in prompts]} python={platform.python_version()} torch={torch.__version__}"
    )
    results: dict[bool, list[dict]] = {True: [], False: []}
    run_side(loops[True], samples[:1], prompts[:1], argparse.Namespace(**{**vars(args), "n": 1}))  # warm-up
    for round_index in range(args.rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for reuse in order:
            r = run_side(loops[reuse], samples, prompts, args)
            results[reuse].append(r)
            print(
                f"round {round_index} {'reuse    ' if reuse else 'reprefill'} {r['seconds']:7.2f} s  "
                f"turns/s {r['turns_per_s']:7.2f}  tokens/s {r['tokens_per_s']:8.1f}  "
                f"prefill tokens {r['prefill_tokens']:7d}  turns {r['turns']}"
            )
    same = all(a["ids"] == b["ids"] for a, b in zip(results[True], results[False]))
    print(f"identical token ids on both sides: {same}")
    for key in ("seconds", "turns_per_s", "tokens_per_s", "prefill_tokens"):
        a = statistics.median(r[key] for r in results[True])
        b = statistics.median(r[key] for r in results[False])
        print(f"median {key:15s} reuse {a:10.2f}  reprefill {b:10.2f}  ratio reuse/reprefill {a / b:6.2f}")


if __name__ == "__main__":
    main()
