"""The engine-trainer mismatch over a whole run: the default recipe in bf16 with and without the
importance correction, and in float32, with held-out accuracy and the per-step gap.

    .venv/bin/python benchmarks/mismatch.py                   # 20 steps each, evaluation every 5
    .venv/bin/python benchmarks/mismatch.py --steps 4 --test-freq 2 --val-size 16   # a quick look
    .venv/bin/python benchmarks/mismatch.py --cost-rounds 6     # what recording the log-probs costs

Three runs of `grouprl train` (the default recipe, the same seed), one after the other:
`bf16 corrected` (actor.dtype=bfloat16: generation and update under bf16 autocast; the
default correction, token ratios truncated at 2), `bf16 uncorrected` (the same with
algorithm.rollout_is=off; the engine still records its log-probs, so the gap is measured) and
`float32` (actor.dtype=float32 rollout.dtype=float32, rollout.check_log_probs=true: the gap is
measured there too, where it should be float noise). Printed: held-out accuracy at each
evaluation, and per step the mean and largest |trainer - engine| log-prob gap, the k3 KL of
the two distributions on the sampled tokens and the mean importance weight; then a markdown
table for RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "bf16 corrected": ["actor.dtype=bfloat16", "rollout.dtype=auto"],
    "bf16 uncorrected": ["actor.dtype=bfloat16", "rollout.dtype=auto", "algorithm.rollout_is=off"],
    "float32": ["actor.dtype=float32", "rollout.dtype=float32", "rollout.check_log_probs=true"],
}


def run(name: str, overrides: list[str], args, out: Path) -> list[dict]:
    """One training run of the default recipe; its metrics.jsonl records."""
    experiment = name.replace(" ", "-")
    command = [
        sys.executable, "-m", "grouprl", "train", *overrides,
        f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
        f"data.task_val_size={args.val_size}", f"trainer.seed={args.seed}",
        "trainer.max_time_minutes=0", "trainer.save_freq=0", "trainer.save_final=false",
        "trainer.save_best=false", f"trainer.output_dir={out}", f"trainer.experiment_name={experiment}",
        "trainer.loggers=[jsonl]",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    path = out / experiment / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def summary(records: list[dict]) -> dict:
    steps = [r for r in records if "rollout/mismatch_mean" in r or "actor/grad_norm" in r]
    evals = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    gap = [r.get("rollout/mismatch_mean", float("nan")) for r in steps]
    return {
        "evals": evals,
        "gap_mean": gap,
        "gap_max": [r.get("rollout/mismatch_max", float("nan")) for r in steps],
        "kl_k3": [r.get("rollout/kl_k3", float("nan")) for r in steps],
        "is_mean": [r.get("rollout/is_mean", float("nan")) for r in steps],
        "step_time": statistics.median(r["time/step"] for r in steps[1:]) if len(steps) > 1 else float("nan"),
    }


def recording_cost(rounds: int) -> None:
    """What recording the engine's log-probs costs the built-in engine: one bf16 generation of a
    default step (4 prompts x 8 samples, 40 tokens) with and without, alternated, same samples."""
    import time

    from grouprl.cli import DEFAULT_RECIPE
    from grouprl.config import load_config
    from grouprl.trainer.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="grouprl-mismatch-") as tmp:
        cfg = load_config(DEFAULT_RECIPE, ["actor.dtype=bfloat16", "data.task_val_size=0", f"trainer.output_dir={tmp}"])
        trainer = Trainer(cfg)
        samples, prompts = trainer.collector.next_prompts()
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for record in (r % 2 == 0, r % 2 == 1):
                trainer.parts.collect.engine.report_log_probs = record
                t0 = time.perf_counter()
                trainer.collector.rollout(samples, prompts, cfg.rollout.n_agent, stream=(0, 0))  # the same streams each round
                times[record].append(time.perf_counter() - t0)
    with_, without = statistics.median(times[True]), statistics.median(times[False])
    print(f"\nrecording the engine's log-probs (bf16 generation of one default step, {rounds} rounds, medians): "
          f"{with_:.2f} s with, {without:.2f} s without, ratio {with_ / without:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--val-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated names of " + ", ".join(RUNS))
    parser.add_argument("--cost-rounds", type=int, default=0, help="only time the recording of log-probs (N rounds)")
    args = parser.parse_args(argv)
    if args.cost_rounds:
        recording_cost(args.cost_rounds)
        return 0
    names = [n.strip() for n in args.runs.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="grouprl-mismatch-") as tmp:
        for name in names:
            results[name] = summary(run(name, RUNS[name], args, Path(tmp)))
            s = results[name]
            print(f"\n{name}: median step {s['step_time']:.2f} s")
            print("  held-out accuracy: " + ", ".join(f"step {k}: {v:.3f}" for k, v in s["evals"]))
            print("  gap mean per step: " + " ".join(f"{v:.2g}" for v in s["gap_mean"]))
            print("  gap max per step:  " + " ".join(f"{v:.2g}" for v in s["gap_max"]))
            print("  k3 KL per step:    " + " ".join(f"{v:.2g}" for v in s["kl_k3"]))
            print("  IS mean per step:  " + " ".join(f"{v:.4g}" for v in s["is_mean"]))
    print("\n| run | " + " | ".join(f"acc @{k}" for k, _ in results[names[0]]["evals"])
          + " | gap mean (median of steps) | gap max (largest) | k3 KL (median) | median step |")
    print("|---|" + "---:|" * (len(results[names[0]]["evals"]) + 4))
    for name, s in results.items():
        finite = lambda xs: [x for x in xs if x == x] or [float("nan")]  # noqa: E731
        print(
            f"| {name} | " + " | ".join(f"{v:.3f}" for _, v in s["evals"])
            + f" | {statistics.median(finite(s['gap_mean'])):.2g} | {max(finite(s['gap_max'])):.2g}"
            + f" | {statistics.median(finite(s['kl_k3'])):.2g} | {s['step_time']:.2f} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
