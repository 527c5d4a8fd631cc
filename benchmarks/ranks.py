"""One process against several ranks (torchrun, FSDP2) on the same recipe, alternated: step time
and its parts, and the memory each rank holds with and without sharding.

    .venv/bin/python benchmarks/ranks.py                      # default recipe, 3 steps, 2 rounds
    .venv/bin/python benchmarks/ranks.py --steps 4 --rounds 3 --ranks 2
    .venv/bin/python benchmarks/ranks.py --quick              # smoke test: 2 steps, 1 round

Three layouts, each a fresh `grouprl train` (the default recipe, validation off, same seed):
`1 process` (the threads of the machine), `N ranks sharded` (actor.fsdp_size=-1: one copy of
the weights, gradients and optimizer state split over the ranks) and `N ranks replicated`
(actor.fsdp_size=1: every rank holds all of it, gradients all-reduced, i.e. data parallel only).
Ranks run one thread each (OMP_NUM_THREADS=1), so N ranks on an N-core machine use the same cores
as the one process. Each round runs the three in turn, the first one flipping every round.

Printed per run and as medians over rounds (the first step left out as warm-up): step time,
generation and update time, peak RSS per process (`perf/peak_rss_gb`, the largest rank's), and
`perf/state_gb` (what a rank holds of the policy's weights and optimizer state between steps),
with ratios against the one process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("time/step", "time/generate", "time/update", "perf/peak_rss_gb", "perf/state_gb")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(layout: str, ranks: int, args, out: Path) -> dict[str, float]:
    """One training run; the medians of its steps after the first."""
    name = layout.replace(" ", "-")
    overrides = [
        f"trainer.total_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_final=false",
        "trainer.save_best=false",
        f"trainer.output_dir={out}",
        f"trainer.experiment_name={name}",
    ]
    env = dict(os.environ)
    if layout == "1 process":
        command = [sys.executable, "-m", "grouprl", "train"]
    else:
        env["OMP_NUM_THREADS"] = "1"
        overrides.append("actor.fsdp_size=1" if layout.endswith("replicated") else "actor.fsdp_size=-1")
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "grouprl", "train",
        ]  # fmt: skip
    done = subprocess.run([*command, *overrides], env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{layout} failed:\n{done.stderr[-3000:]}")
    steps = [
        m
        for m in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines())
        if "time/step" in m
    ]
    kept = steps[1:] or steps
    return {k: statistics.median(m[k] for m in kept) for k in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 round")
    parser.add_argument("--out", help="write every run's figures here (JSON)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 2, 1
    layouts = ["1 process", f"{args.ranks} ranks sharded", f"{args.ranks} ranks replicated"]
    results: dict[str, list[dict]] = {layout: [] for layout in layouts}
    for r in range(args.rounds):
        order = layouts if r % 2 == 0 else layouts[::-1]
        for layout in order:
            with tempfile.TemporaryDirectory() as out:
                figures = run(layout, args.ranks, args, Path(out))
            results[layout].append(figures)
            print(f"round {r + 1} {layout:>20}: " + " ".join(f"{k}={v:.3f}" for k, v in figures.items()), flush=True)
    base = {k: statistics.median(f[k] for f in results[layouts[0]]) for k in KEYS}
    print(f"\nmedians over {args.rounds} rounds (steps 2..{args.steps}); ratio to 1 process in brackets")
    print(f"{'':>20} " + " ".join(f"{k:>24}" for k in KEYS))
    for layout in layouts:
        med = {k: statistics.median(f[k] for f in results[layout]) for k in KEYS}
        cells = [f"{med[k]:.3f} ({med[k] / base[k]:.2f}x)" if base[k] else f"{med[k]:.3f}" for k in KEYS]
        print(f"{layout:>20} " + " ".join(f"{c:>24}" for c in cells))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
