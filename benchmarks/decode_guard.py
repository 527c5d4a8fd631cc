"""The default recipe's generation speed at an older commit against this tree, alternating.

    .venv/bin/python benchmarks/decode_guard.py                        # ed3dff3 vs this tree, 2 rounds
    .venv/bin/python benchmarks/decode_guard.py --commit ed3dff3 --rounds 3 --steps 3
    .venv/bin/python benchmarks/decode_guard.py --against main    # ed3dff3 vs main's commit

The older commit (and `--against`'s, in place of this tree) is checked out with `git worktree add --detach` into a temporary folder (removed
at the end); each run is `grouprl train` of the default recipe in float32 (no baseline
evaluation, 8 held-out prompts, no checkpoint between steps) in a process of its own, imported
from that tree's `src/` with the same Python environment. Rounds alternate the order (the older
commit first on even rounds). Printed per run: generated tokens/s (`perf/gen_tokens_per_s`),
`time/generate` and the mean response length of steps 2.. (step 1 warms up the decode-time
product choices and the allocator); then the medians over runs and the ratio this tree / older
(tokens/s: above 1 is faster here). Run it on an otherwise idle machine (both sides use every
core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = [
    "actor.dtype=float32",
    "trainer.val_before_train=false",
    "trainer.save_freq=0",
    "trainer.save_best=false",
    "trainer.save_final=false",
    "data.task_val_size=8",
]


def run(tree: Path, out: Path, name: str, steps: int, python: str) -> dict[str, float]:
    """One default-recipe run from `tree`'s sources; the means of steps 2.. of its metrics."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [python, "-m", "grouprl", "train", f"trainer.total_steps={steps}", *RECIPE,
           f"trainer.output_dir={out}", f"trainer.experiment_name={name}"]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    later = [r for r in rows if r.get("step", 0) >= 2 and "perf/gen_tokens_per_s" in r]
    return {
        "tokens_per_s": statistics.mean(r["perf/gen_tokens_per_s"] for r in later),
        "generate_s": statistics.mean(r["time/generate"] for r in later),
        "length": statistics.mean(r["response/length_mean"] for r in later),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="ed3dff3", help="the older commit (default ed3dff3)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per run (steps 2.. are measured)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--against", help="a commit to measure in place of this tree")
    args = parser.parse_args()
    if args.steps < 2:
        sys.exit("--steps must be at least 2 (step 1 is a warm-up)")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    here = args.against or f"{head}{'+changes' if dirty else ''}"
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="grouprl-guard-") as tmp:
        old_tree = Path(tmp) / "old"
        new_tree = Path(tmp) / "new" if args.against else ROOT
        for tree, commit in ((old_tree, args.commit), (new_tree, args.against)):
            if tree != ROOT:
                subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True,
                               capture_output=True)  # fmt: skip
        try:
            for r in range(args.rounds):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                for side in order:
                    tree = old_tree if side == "old" else new_tree
                    res = run(tree, Path(tmp) / "runs", f"{side}{r}", args.steps, args.python)
                    results[side].append(res)
                    label = args.commit if side == "old" else here
                    print(f"round {r} {label:>14}: {res['tokens_per_s']:7.1f} tokens/s  generate "
                          f"{res['generate_s']:.2f} s  length {res['length']:.1f}", flush=True)  # fmt: skip
        finally:
            for tree in {old_tree, new_tree} - {ROOT}:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    med = {side: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for side, rs in results.items()}
    print(f"\nmedians over {args.rounds} runs a side, steps 2-{args.steps}, float32:")
    for key, unit in (("tokens_per_s", "tokens/s"), ("generate_s", "s generate"), ("length", "tokens a response")):
        print(f"  {key:>13}: {args.commit} {med['old'][key]:8.2f}  {here} {med['new'][key]:8.2f}  "
              f"ratio {med['new'][key] / med['old'][key]:.3f} ({unit})")  # fmt: skip


if __name__ == "__main__":
    main()
