"""Step time with streaming rewards vs scoring the whole batch after generation, with a slow judge.

    .venv/bin/python benchmarks/streaming_rewards.py [--steps 3 --latency 1.0 --cap 8]
    .venv/bin/python benchmarks/streaming_rewards.py --agent [--max-turns 4]

The default recipe (SmolLM2-135M-Instruct, 4 prompts x 8 samples) plus a judge component served
by the fake OpenAI-compatible judge in its own process on 127.0.0.1 (every call answers after
`--latency` seconds, at most `--cap` calls in flight). Two trainers with the same seed, one with
`reward.streaming=true` and one with false, take their steps alternately; both start from the
same weights and prompts, so their work per step is alike. Printed: medians of step time,
generation, the reward time the step waited for, and (streaming) the reward time hidden behind
generation.

`--agent` runs the multi-turn agent loop instead (4 prompts x 4 samples, `--max-turns` turns of
at most 24 tokens, `agent.answer_generator: none`, a stub search tool that returns a fixed
passage after `--search-latency` seconds). A 135M base model does not follow the action
protocol, so the turn in which a sample ends is scheduled: every turn is the model's own
generation (real decode cost; a turn without a valid action gets the corrective observation),
except the sample's last, whose text is replaced by `<answer>0</answer>` (its row leaves the
batch right after, so no cache holds the replaced tokens). The schedule is seeded by the
prompt: a prompt gets a "difficulty" d in 0..max_turns-1 and its samples end in turn d or d+1
(at most the last turn), so groups end at different turns, as a search agent's do, and both
sides see the same schedule. A group is scored once its last sample has ended; each step prints
the turn in which each group ended.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import grouprl
from grouprl.config import load_config
from grouprl.rollout.engines import Generation
from grouprl.rollout.tools.base import Observation
from grouprl.trainer.trainer import Trainer

FAKE_JUDGE = Path(__file__).resolve().parents[1] / "tests" / "rewards" / "judges" / "fake_server.py"

DEFAULT_RECIPE = Path(grouprl.__file__).parent / "configs" / "default.yaml"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="steps per side")
    p.add_argument("--latency", type=float, default=1.0, help="judge latency (s)")
    p.add_argument("--cap", type=int, default=8, help="judge calls in flight")
    p.add_argument("--quick", action="store_true", help="1 step, 2 prompts x 2 samples, 8 tokens")
    p.add_argument("--agent", action="store_true", help="the multi-turn agent loop (see above)")
    p.add_argument("--max-turns", type=int, default=4, help="--agent: most turns per trajectory")
    p.add_argument("--search-latency", type=float, default=0.05, help="--agent: seconds per search")
    return p.parse_args()


class StubSearch:
    """A search tool with no index: one fixed passage for every query, after `latency` s."""

    name = "search"

    def __init__(self, latency: float):
        self.latency = latency

    async def __call__(self, argument, state):
        await asyncio.sleep(self.latency)
        doc = f"doc{state.turn}"
        state.add_hits([{"id": doc, "score": 1.0, "text": ""}])
        return Observation(f"[{doc}] Arithmetic: add, subtract, multiply or divide the numbers given.")


def scheduled_ends(open_session, tokenizer, max_turns: int):
    """`engine.open_session` whose sessions end each sample in its scheduled turn (see above)."""
    answer = "<answer>0</answer>"
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]

    def open_scheduled(prompts, n):
        session = open_session(prompts, n)
        generate = session.generate
        last_turn = []
        for prompt in prompts:
            difficulty = zlib.crc32(str(prompt).encode()) % max_turns
            last_turn += [
                min(max_turns - 1, difficulty + zlib.crc32(f"{prompt}/{j}".encode()) % 2) for j in range(n)
            ]
        turn = [0] * len(last_turn)

        def generate_scheduled(rows, new_tokens, params, generator=None):
            out = generate(rows, new_tokens, params, generator)
            for i, row in enumerate(rows):
                if turn[row] == last_turn[row]:
                    out[i] = Generation(list(answer_ids), answer, "stop")
                turn[row] += 1
            return out

        session.generate = generate_scheduled
        return session

    return open_scheduled


def trainer(streaming: bool, base_url: str, args, run_dir: str) -> Trainer:
    overrides = [
        f"reward.streaming={str(streaming).lower()}",
        f"reward.judges=[{{name: slow, model: fake-judge, base_url: '{base_url}', cache_path: '', "
        f"max_concurrent_requests: {args.cap}, scale: 9}}]",
        "reward.components=[{name: correctness, weight: 1.0}, {name: judge, function: 'judge:slow', weight: 0.5}]",
        "trainer.device=cpu",
        "trainer.resume_mode=disable",
        f"trainer.output_dir={run_dir}",
        f"trainer.experiment_name={'streaming' if streaming else 'batch'}",
        "data.task_val_size=0",
        "trainer.total_steps=100",
    ]
    if args.agent:
        overrides += [
            "agent.enabled=true",
            "agent.tools=[]",  # the stub search is set below: no index to build
            "agent.answer_generator=none",
            f"agent.max_turns={args.max_turns}",
            "agent.max_observation_tokens=64",
            "rollout.n_agent=4",
            "rollout.max_response_length=24",
            "data.max_prompt_length=1024",
        ]
    if args.quick:
        overrides += ["data.train_batch_size=2", "rollout.n_agent=2", "rollout.max_response_length=8"]
    t = Trainer(load_config(DEFAULT_RECIPE, overrides))
    if args.agent:
        t.agent.tools = {"search": StubSearch(args.search_latency)}
        t.engine.open_session = scheduled_ends(t.engine.open_session, t.tokenizer, args.max_turns)
    return t


def group_end_turns(trajectories, n: int) -> list[int]:
    """Per group, the turn (0-based) in which its last sample ended."""
    ends = [sum("finish_reason" in r for r in t.turns) - 1 for t in trajectories]  # policy turns
    return [max(ends[g : g + n]) for g in range(0, len(ends), n)]


def main() -> None:
    args = parse_args()
    if args.quick:
        args.steps = 1
    server = subprocess.Popen(
        [sys.executable, str(FAKE_JUDGE), "--latency", str(args.latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        base_url = server.stdout.readline().strip()
        with tempfile.TemporaryDirectory() as run_dir:
            sides = {s: trainer(s, base_url, args, run_dir) for s in (True, False)}
            records: dict[bool, list[dict]] = {True: [], False: []}
            for step in range(args.steps):
                order = (True, False) if step % 2 == 0 else (False, True)
                for streaming in order:
                    metrics, trajectories, _ = sides[streaming].train_step()
                    records[streaming].append(metrics)
                    ends = ""
                    if args.agent:
                        n = sides[streaming].cfg.rollout.n_agent
                        ends = f", groups ended in turns {group_end_turns(trajectories, n)}"
                    print(
                        f"step {step + 1} {'streaming' if streaming else 'batch    '} step {metrics['time/step']:.2f} s, "
                        f"generate {metrics['time/generate']:.2f} s, reward wait {metrics['time/reward']:.2f} s, "
                        f"hidden {metrics.get('time/reward_hidden', 0.0):.2f} s{ends}",
                        flush=True,
                    )
            for t in sides.values():
                if t.streaming is not None:
                    t.streaming.close()
                t.reward.close()
    finally:
        server.terminate()
        server.wait(timeout=10)

    def med(streaming: bool, key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in records[streaming])

    print()
    setting = f"agent loop, up to {args.max_turns} turns; " if args.agent else ""
    print(
        f"{setting}judge latency {args.latency} s, cap {args.cap}; medians over {args.steps} step(s) per side"
    )
    print("| | streaming | batch | streaming / batch |")
    print("|---|---:|---:|---:|")
    for key, label in [
        ("time/step", "step (s)"),
        ("time/generate", "generation (s)"),
        ("time/reward", "reward wait after generation (s)"),
        ("time/reward_hidden", "reward time hidden behind generation (s)"),
    ]:
        a, b = med(True, key), med(False, key)
        ratio = f"{a / b:.2f}" if b else "-"
        print(f"| {label} | {a:.2f} | {b:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
