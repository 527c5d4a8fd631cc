"""A VLM's training step on the built-in engine against vLLM, in one process and on 2 ranks
(torchrun, FSDP2, one vLLM engine per rank), alternated, in the vLLM environment.

    .venv-vllm/bin/python benchmarks/vlm_engines.py                  # 3 steps x 2 rounds
    .venv-vllm/bin/python benchmarks/vlm_engines.py --steps 4 --rounds 3 --out vlm_engines.json
    .venv-vllm/bin/python benchmarks/vlm_engines.py --quick          # 2 steps, 1 round

Each run is a fresh `grouprl train configs/vlm.yaml` on the embedded VLM
(`builtin:smolvlm-smollm2-135m`: SmolVLM's architecture with SmolLM2's weights and a small
random tower; 64 x 64 shapes scenes, 16 image tokens each), validation off, the same seed, in
float32 (vLLM's CPU build runs float32 or bf16; float32 keeps both engines on the same numbers).
Four layouts: hf and vllm, in 1 process and on 2 ranks (ranks one thread each, so 2 ranks on 2
cores use the cores the one process uses). Each round runs the four in turn, the order
rotating every round. Printed: median step, generation, update and weight-sync time over the
steps after the first, peak RSS (the largest rank's), and ratios: vllm / hf at the same ranks,
and 2 ranks / 1 process on the same engine.
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
KEYS = ("time/step", "time/generate", "time/update", "time/weight_sync", "perf/peak_rss_gb")
LAYOUTS = [("hf", 1), ("vllm", 1), ("hf", 2), ("vllm", 2)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(engine: str, ranks: int, args, out: Path) -> dict[str, float]:
    """One training run; the medians of its steps after the first."""
    name = f"{engine}-{ranks}"
    overrides = [
        "model.path=builtin:smolvlm-smollm2-135m",
        f"data.train_batch_size={args.batch}",
        f"rollout.n_agent={args.n}",
        f"rollout.engine={engine}",
        "rollout.kv_cache_gb=0.5",
        "rollout.enforce_eager=true",
        "rollout.max_model_len=256",
        "actor.dtype=float32",
        "rollout.dtype=float32",
        f"trainer.total_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "data.task_val_size=0",
        "trainer.save_final=false",
        "trainer.save_best=false",
        "trainer.save_freq=0",
        "trainer.resume_mode=disable",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={out}",
        f"trainer.experiment_name={name}",
    ]
    env = dict(os.environ)
    command = [sys.executable, "-m", "grouprl", "train", str(ROOT / "configs" / "vlm.yaml")]
    if ranks > 1:
        env["OMP_NUM_THREADS"] = "1"
        command[1:3] = [
            "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "grouprl",
        ]  # fmt: skip
    done = subprocess.run([*command, *overrides], env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    steps = [m for m in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines()) if "time/step" in m]
    kept = steps[1:] or steps
    return {k: statistics.median(m.get(k, 0.0) for m in kept) for k in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="scenes per step (a multiple of 2)")
    parser.add_argument("--n", type=int, default=4, help="samples per scene")
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 round")
    parser.add_argument("--out", help="write every run's figures here (JSON)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 2, 1
    runs: dict[tuple[str, int], list[dict[str, float]]] = {layout: [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="vlm-engines-") as tmp:
        for r in range(args.rounds):
            order = LAYOUTS[r % len(LAYOUTS) :] + LAYOUTS[: r % len(LAYOUTS)]
            for engine, ranks in order:
                figures = run(engine, ranks, args, Path(tmp) / f"round{r}")
                runs[(engine, ranks)].append(figures)
                print(f"round {r + 1} {engine} x{ranks}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()),
                      flush=True)  # fmt: skip
    med = {layout: {k: statistics.median(f[k] for f in runs[layout]) for k in KEYS} for layout in LAYOUTS}
    print(f"\n{args.batch} scenes x {args.n} samples, {args.steps} steps x {args.rounds} rounds (medians)")
    print("| engine | ranks | step s | generate s | update s | weight sync s | peak RSS GB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for engine, ranks in LAYOUTS:
        m = med[(engine, ranks)]
        print(f"| {engine} | {ranks} | {m['time/step']:.2f} | {m['time/generate']:.2f} | {m['time/update']:.2f} | "
              f"{m['time/weight_sync']:.3f} | {m['perf/peak_rss_gb']:.2f} |")  # fmt: skip
    for ranks in (1, 2):
        v, h = med[("vllm", ranks)], med[("hf", ranks)]
        print(f"vllm / hf, {ranks} rank(s): step {v['time/step'] / h['time/step']:.2f}x, "
              f"generate {v['time/generate'] / h['time/generate']:.2f}x")  # fmt: skip
    for engine in ("hf", "vllm"):
        two, one = med[(engine, 2)], med[(engine, 1)]
        print(f"2 ranks / 1 process, {engine}: step {two['time/step'] / one['time/step']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({f"{e}-{r}": runs[(e, r)] for e, r in LAYOUTS}, indent=1))


if __name__ == "__main__":
    main()
