"""Step time with streaming rewards vs scoring the whole batch after generation, with a slow judge.

    .venv/bin/python benchmarks/streaming_rewards.py [--steps 3 --latency 1.0 --cap 8]

The default recipe (SmolLM2-135M-Instruct, 4 prompts x 8 samples) plus a judge component served
by the fake OpenAI-compatible judge in its own process on 127.0.0.1 (every call answers after
`--latency` seconds, at most `--cap` calls in flight). Two trainers with the same seed, one with
`reward.streaming=true` and one with false, take their steps alternately; both start from the
same weights and prompts, so their work per step is alike. Printed: medians of step time,
generation, the reward time the step waited for, and (streaming) the reward time hidden behind
generation.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import grouprl
from grouprl.config import load_config
from grouprl.trainer.trainer import Trainer

DEFAULT_RECIPE = Path(grouprl.__file__).parent / "configs" / "default.yaml"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="steps per side")
    p.add_argument("--latency", type=float, default=1.0, help="judge latency (s)")
    p.add_argument("--cap", type=int, default=8, help="judge calls in flight")
    p.add_argument("--quick", action="store_true", help="1 step, 2 prompts x 2 samples, 8 tokens")
    return p.parse_args()


def trainer(streaming: bool, base_url: str, cap: int, run_dir: str, quick: bool) -> Trainer:
    overrides = [
        f"reward.streaming={str(streaming).lower()}",
        f"reward.judges=[{{name: slow, model: fake-judge, base_url: '{base_url}', cache_path: '', "
        f"max_concurrent_requests: {cap}, scale: 9}}]",
        "reward.components=[{name: correctness, weight: 1.0}, {name: judge, function: 'judge:slow', weight: 0.5}]",
        "trainer.device=cpu",
        "trainer.resume_mode=disable",
        f"trainer.output_dir={run_dir}",
        f"trainer.experiment_name={'streaming' if streaming else 'batch'}",
        "data.task_val_size=0",
        "trainer.total_steps=100",
    ]
    if quick:
        overrides += ["data.train_batch_size=2", "rollout.n_agent=2", "rollout.max_response_length=8"]
    return Trainer(load_config(DEFAULT_RECIPE, overrides))


def main() -> None:
    args = parse_args()
    if args.quick:
        args.steps = 1
    server = subprocess.Popen(
        [sys.executable, "-m", "grouprl.rewards.judges.fake_server", "--latency", str(args.latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        base_url = server.stdout.readline().strip()
        with tempfile.TemporaryDirectory() as run_dir:
            sides = {s: trainer(s, base_url, args.cap, run_dir, args.quick) for s in (True, False)}
            records: dict[bool, list[dict]] = {True: [], False: []}
            for step in range(args.steps):
                order = (True, False) if step % 2 == 0 else (False, True)
                for streaming in order:
                    metrics, _ = sides[streaming].train_step()
                    records[streaming].append(metrics)
                    print(
                        f"step {step + 1} {'streaming' if streaming else 'batch    '} step {metrics['time/step']:.2f} s, "
                        f"generate {metrics['time/generate']:.2f} s, reward wait {metrics['time/reward']:.2f} s, "
                        f"hidden {metrics.get('time/reward_hidden', 0.0):.2f} s",
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
    print(f"judge latency {args.latency} s, cap {args.cap}; medians over {args.steps} step(s) per side")
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
