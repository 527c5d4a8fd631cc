"""Asynchronous training against a slow judge: step time with rollout.max_staleness 0, 1, 2, and
held-out accuracy after the same number of samples synchronously and one step off policy.

    .venv/bin/python benchmarks/async_judge.py --latency 5 --steps 6 --rounds 2     # step time
    .venv/bin/python benchmarks/async_judge.py --ks 1 --engine-process  # k=1: thread vs engine process
    .venv/bin/python benchmarks/async_judge.py --ks 1 --engine-service  # ... vs an engine service's engine
    .venv/bin/python benchmarks/async_judge.py --learn --steps 20 --seeds 42 1 2     # accuracy

Step time: the default recipe (SmolLM2-135M-Instruct, arithmetic, 4 prompts x 8 samples) with a
judge component (weight 0.5) served by the fake OpenAI-compatible judge in its own process on
127.0.0.1, every call answered after `--latency` seconds (all of a step's calls in flight at
once). One `grouprl train` per k (fixed lag), `--steps` steps, rounds alternating the order.
`--engine-process` adds k=1 with the engine in a process of its own (rollout.engine_process),
`--engine-service` k=1 with the engine of a `grouprl engine serve` on 127.0.0.1
(rollout.engine_address; requests over TCP, as from another machine), both on one torch thread
beside the trainer's (the engine process takes half the cores when it shares the trainer's CPU).
Printed per k: median step time (steps after the first), the update's wait for its batch
(`time/wait_batch`), generation and update time, and the judge time hidden: (sync step - step)
/ latency, the share of one judge wait per step that no longer holds a step up.

`--learn`: no judge; the default recipe for `--steps` steps with k = 0 and k = 1 (fixed lag,
the same seed; each of `--seeds`), held-out accuracy on 128 prompts before and after, with its
standard error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_JUDGE = ROOT / "tests" / "rewards" / "judges" / "fake_server.py"


def run(k, overrides: list[str], out: Path, name: str) -> list[dict]:
    command = [
        sys.executable, "-m", "grouprl", "train", f"rollout.max_staleness={k}", "trainer.device=cpu",
        "trainer.resume_mode=disable", "trainer.save_freq=0", "trainer.save_final=false", "trainer.save_best=false",
        "trainer.loggers=[jsonl]", f"trainer.output_dir={out}", f"trainer.experiment_name={name}", *overrides,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    if done.returncode:
        raise SystemExit(f"k={k} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def engine_service() -> tuple[str, subprocess.Popen]:
    """`grouprl engine serve` on 127.0.0.1 (one CPU engine, one torch thread), a fresh key in this
    process's environment (the runs inherit it); (its address, its process)."""
    os.environ["GROUPRL_ENGINE_KEY"] = secrets.token_hex(16)
    command = [sys.executable, "-m", "grouprl", "engine", "serve", "--port", "0", "--devices", "cpu"]
    service = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = service.stdout.readline()
    if not line.startswith("engine service on "):
        raise SystemExit(f"the engine service did not start: {line!r}")
    return line.split()[3], service


def step_time(args) -> None:
    judge = subprocess.Popen(
        [sys.executable, str(FAKE_JUDGE), "--latency", str(args.latency)], stdout=subprocess.PIPE, text=True
    )
    service = None
    try:
        base_url = judge.stdout.readline().strip().split()[-1]
        overrides = [
            f"reward.judges=[{{name: slow, model: fake-judge, base_url: '{base_url}', cache_path: '', "
            "max_concurrent_requests: 64, scale: 9}]",
            "reward.components=[{name: correctness, weight: 1.0}, {name: judge, function: 'judge:slow', weight: 0.5}]",
            "data.task_val_size=0",
            f"trainer.total_steps={args.steps}",
            "actor.dtype=float32",
        ]
        ks: list = list(args.ks) + (["1 (engine process)"] if args.engine_process else [])
        extra = {"1 (engine process)": ["rollout.engine_process=true"]}
        if args.engine_service:
            address, service = engine_service()
            ks.append("1 (engine service)")
            extra["1 (engine service)"] = [f"rollout.engine_address={address}"]
        figures: dict = {k: [] for k in ks}
        with tempfile.TemporaryDirectory(prefix="async-judge-") as tmp:
            for r in range(args.rounds):
                for k in ks[r % len(ks) :] + ks[: r % len(ks)]:
                    staleness = int(str(k).split()[0])
                    name = f"k{staleness}-{ks.index(k)}-r{r}"
                    steps = [m for m in run(staleness, overrides + extra.get(k, []), Path(tmp), name) if "time/step" in m][1:]
                    figures[k] += steps
                    print(f"round {r + 1} k={k}: step {statistics.median(m['time/step'] for m in steps):.2f} s", flush=True)
    finally:
        judge.terminate()
        if service is not None:
            service.terminate()
    med = {k: {key: statistics.median(m.get(key, 0.0) for m in figures[k]) for key in
               ("time/step", "time/wait_batch", "time/generate", "time/update", "time/reward")} for k in ks}  # fmt: skip
    print(f"\njudge latency {args.latency:g} s, {args.steps} steps x {args.rounds} rounds (medians, first step left out)")
    print("| max_staleness | step s | update waits for its batch s | generate s | update s | judge time hidden |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k in ks:
        m = med[k]
        hidden = f"{(med[0]['time/step'] - m['time/step']) / args.latency:.0%}" if 0 in med else "-"
        print(f"| {k} | {m['time/step']:.2f} | {m['time/wait_batch']:.2f} | {m['time/generate']:.2f} | "
              f"{m['time/update']:.2f} | {hidden} |")  # fmt: skip
    for k in ks:
        if k != 0 and 0 in med:
            print(f"k={k} / k=0: step {med[k]['time/step'] / med[0]['time/step']:.2f}x")
    for where in ("engine process", "engine service"):
        if f"1 ({where})" in med and 1 in med:
            ratio = med[f"1 ({where})"]["time/step"] / med[1]["time/step"]
            print(f"k=1: {where} / thread: step {ratio:.2f}x")


def learn(args) -> None:
    finals: dict[int, list[float]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="async-learn-") as tmp:
        for seed in args.seeds:
            overrides = [f"trainer.total_steps={args.steps}", "trainer.test_freq=0", "data.task_val_size=128",
                         f"trainer.seed={seed}"]  # fmt: skip
            for k in (0, 1):
                records = run(k, overrides, Path(tmp), f"k{k}-s{seed}")
                evals = [m["val/accuracy"] for m in records if "val/accuracy" in m]
                before, after = evals[0], evals[-1]
                finals[k].append(after)
                se = math.sqrt(after * (1 - after) / 128)
                steps = [m for m in records if "time/step" in m]
                stale = statistics.fmean(m.get("rollout/staleness_mean", 0.0) for m in steps)
                print(f"seed {seed} k={k}: held-out accuracy {before:.3f} -> {after:.3f} (+-{se:.3f}) after "
                      f"{len(steps)} steps x 32 samples; mean staleness {stale:.2f}", flush=True)  # fmt: skip
    for k, values in finals.items():
        print(f"k={k}: mean final accuracy {statistics.fmean(values):.3f} over seeds {args.seeds}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latency", type=float, default=5.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--learn", action="store_true")
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="the max_staleness values to time")
    p.add_argument("--engine-process", action="store_true", help="also k=1 with rollout.engine_process=true")
    p.add_argument("--engine-service", action="store_true", help="also k=1 with a local grouprl engine serve")
    p.add_argument("--seeds", type=int, nargs="+", default=[42], help="--learn: trainer seeds (the recipe's is 42)")
    args = p.parse_args()
    learn(args) if args.learn else step_time(args)


if __name__ == "__main__":
    main()
